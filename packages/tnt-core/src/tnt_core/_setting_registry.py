"""Every ``TNT_*`` variable a process knows: tnt-core's own and those its installed plugins
declare through the ``tnt_register_settings`` hook.

One registry feeds ``tnt run``'s check of every exported and ``-x`` value, ``tnt
settings`` and the docs' tables, so a third-party backend's settings are listed and
checked like the built-in ones. A plugin's names carry a prefix of its own
(``TNT_GLOO_``): :meth:`tnt_core.SettingGroup.declare` refuses a name outside it, and the
registry a prefix or group name that two plugins, or a plugin and tnt-core, both claim,
with one line naming both.
"""

from __future__ import annotations

from typing import NamedTuple

from ._errors import ConfigError, PluginError
from ._settings import CORE_GROUPS, VARIABLES, SettingGroup, Variable

__all__ = ["InstalledSettings", "SettingsRegistry", "REGISTER_HOOK"]

#: the hook through which plugins hand over their groups
REGISTER_HOOK = "tnt_register_settings"


class _Owner(NamedTuple):
    """Who declared a group: a plugin (its name, as ``TNT_DISABLE_PLUGINS`` takes it, and
    its distribution) or tnt-core."""

    name: str
    distribution: str | None

    @property
    def is_core(self) -> bool:
        return self.name == _CORE.name

    def __str__(self) -> str:
        if self.is_core:
            return "tnt-core"
        return f"plugin {self.name!r}" + (f" ({self.distribution})" if self.distribution else "")


_CORE = _Owner("tnt-core", None)


class InstalledSettings:
    """The setting groups of tnt-core and of every plugin that declared some, each with who
    declared it. Made by :func:`installed_settings`."""

    def __init__(self) -> None:
        self._groups: dict[str, SettingGroup] = {g.name: g for g in CORE_GROUPS}
        self._owners: dict[str, _Owner] = {g.name: _CORE for g in CORE_GROUPS}

    @property
    def groups(self) -> dict[str, SettingGroup]:
        """Every group by name: tnt-core's, then the plugins' in the order of their names."""
        core = [g for g in self._groups.values() if self._owners[g.name].is_core]
        return {g.name: g for g in core + self.plugin_groups}

    @property
    def plugin_groups(self) -> list[SettingGroup]:
        """The groups plugins declared, in the order of their names."""
        return sorted((g for g in self._groups.values() if not self._owners[g.name].is_core),
                      key=lambda g: g.name)

    @property
    def variables(self) -> dict[str, Variable]:
        """Every declared variable by name, group by group (as :attr:`groups`)."""
        return {name: var for g in self.groups.values() for name, var in g.variables.items()}

    def owner(self, group: str) -> str:
        """Who declared the group ``group``: ``tnt-core`` or ``plugin 'gloo' (tnt-comm-gloo)``."""
        return str(self._owners[group])

    def group_of(self, name: str) -> SettingGroup | None:
        """The plugin group whose prefix ``name`` starts with, declared there or not."""
        return next((g for g in self.plugin_groups if g.prefix and name.startswith(g.prefix)),
                    None)

    def variable(self, name: str) -> Variable:
        """The declaration of ``name``; :class:`ConfigError` for an undeclared name (naming
        the plugin's settings when ``name`` has a plugin's prefix: a typo, most likely)."""
        for group in self._groups.values():
            if name in group.variables:
                return group.variables[name]
        owning = self.group_of(name)
        if owning is not None:
            raise ConfigError(f"{name} is not a setting of {self.owner(owning.name)}; its "
                              f"settings are {', '.join(owning.variables) or 'none'}")
        raise ConfigError(f"{name} is not a Tarantella-NT variable (`tnt settings` lists them)")

    def add(self, group: SettingGroup, *, plugin: str, distribution: str | None = None) -> None:
        """Add ``group`` as declared by ``plugin`` (of ``distribution``); what
        :meth:`SettingsRegistry.add` does for the plugin it was made for."""
        owner = _Owner(plugin, distribution)
        if not isinstance(group, SettingGroup):
            raise PluginError(f"tnt {owner} passed {group!r} to registry.add in "
                              f"{REGISTER_HOOK}; it takes a tnt_core.SettingGroup")
        if self._groups.get(group.name) is group and self._owners[group.name] == owner:
            return  # the same group handed over twice: nothing new
        if group.prefix is None:
            raise PluginError(f"tnt {owner} declares the setting group {group.name!r} without a "
                              "prefix; a plugin's variables need one of their own, e.g. "
                              f"SettingGroup({group.name!r}, ..., prefix='TNT_"
                              f"{group.name.upper().replace('-', '_')}_')")
        if group.name in self._groups:
            raise _clash(owner, self._owners[group.name],
                         f"a setting group named {group.name!r}")
        for name in VARIABLES:
            if name.startswith(group.prefix):
                raise PluginError(f"tnt {owner} declares settings with the prefix "
                                  f"{group.prefix}, which tnt-core's {name} starts with; a "
                                  "plugin's prefix must be its own (e.g. TNT_<PLUGIN>_)")
        for other in self.plugin_groups:
            assert other.prefix is not None  # every plugin group has one (above)
            if other.prefix.startswith(group.prefix) or group.prefix.startswith(other.prefix):
                what = (f"settings with the prefix {group.prefix}" if other.prefix == group.prefix
                        else f"settings with the overlapping prefixes {other.prefix} and "
                             f"{group.prefix}")
                raise _clash(owner, self._owners[other.name], what)
        self._groups[group.name] = group
        self._owners[group.name] = owner


def _clash(new: _Owner, old: _Owner, what: str) -> PluginError:
    if new == old:
        return PluginError(f"tnt {new} declares {what} twice")
    if old.is_core:
        return PluginError(f"tnt {new} declares {what}, which is tnt-core's; rename it")
    return PluginError(f"tnt {old} and {new} both declare {what}; uninstall one, or skip one "
                       f"with TNT_DISABLE_PLUGINS={new.name}")


class SettingsRegistry:
    """What ``tnt_register_settings`` hands one plugin: it adds its groups with :meth:`add`.

    One registry per plugin, so that an error names the plugin it is about.
    """

    def __init__(self, installed: InstalledSettings, plugin: str,
                 distribution: str | None = None) -> None:
        self._installed = installed
        self._owner = _Owner(plugin, distribution)

    @property
    def plugin(self) -> str:
        """The name of the plugin this registry is for."""
        return self._owner.name

    def __str__(self) -> str:
        return str(self._owner)

    def add(self, group: SettingGroup) -> None:
        """Add ``group``, the :class:`tnt_core.SettingGroup` of this plugin's variables.

        :class:`tnt_core.PluginError` for a group without a prefix, or with a name or a
        prefix that tnt-core or another plugin has (a prefix overlapping another counts:
        ``TNT_GLOO_`` and ``TNT_GLOO_SHM_``).
        """
        self._installed.add(group, plugin=self._owner.name, distribution=self._owner.distribution)
