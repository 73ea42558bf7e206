"""Gathering every ``TNT_*`` declaration of a process: tnt-core's own and those of the
installed plugins, each asked through the ``tnt_register_settings`` hook with a registry
of its own (``_setting_registry``), so that an error names the plugin it is about.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pluggy

from ._errors import PluginError, TntError
from ._plugins import BUILTIN_PLUGINS, get_plugin_manager
from ._setting_registry import REGISTER_HOOK, InstalledSettings, SettingsRegistry
from ._settings import VARIABLES, bad_input

__all__ = ["installed_settings", "read_setting"]


def installed_settings(pm: pluggy.PluginManager | None = None) -> InstalledSettings:
    """tnt-core's settings and those of every plugin ``pm`` (default: the process's plugin
    manager) has loaded.

    Collected on every call, one plugin after the other (the hook only hands over groups
    the plugins made at import time): a plugin registered since is included.
    :class:`tnt_core.PluginError`, one line when uncaught, when a plugin's declaration is
    wrong or clashes with another's.
    """
    pm = pm or get_plugin_manager()
    installed = InstalledSettings()
    distributions = {pm.get_name(plugin): dist.project_name
                     for plugin, dist in pm.list_plugin_distinfo()}
    impls = getattr(pm.hook, REGISTER_HOOK).get_hookimpls()
    for impl in impls:
        name = impl.plugin_name
        registry = SettingsRegistry(installed, name, "tnt-core" if name in BUILTIN_PLUGINS
                                    else distributions.get(name))
        only_this = pm.subset_hook_caller(REGISTER_HOOK, [i.plugin for i in impls if i is not impl])
        try:
            only_this(registry=registry)
        except TntError as exc:
            bad_input(exc)
            raise
        except Exception as exc:  # a bug in the plugin: say whose, keep the cause
            raise bad_input(PluginError(f"tnt {registry} failed to declare its settings "
                                        f"({REGISTER_HOOK}): {type(exc).__name__}: {exc}")) from exc
    return installed


def read_setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of the variable ``name`` in ``environ`` (default: ``os.environ``),
    tnt-core's own or an installed plugin's.

    How packages outside tnt-core read a setting, e.g.
    ``read_setting("TNT_TENSORBOARD_ON_ALL_DEVICES")`` is a bool. tnt-core's own are
    looked up without loading plugins.
    """
    var = VARIABLES.get(name) or installed_settings().variable(name)
    return var.read(environ)
