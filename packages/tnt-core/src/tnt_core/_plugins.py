"""The plugin manager: loads ``tnt`` entry points, registers built-ins, checks specs.

Load order (as tox does): specs -> names blocked by ``TNT_DISABLE_PLUGINS`` -> the
``tnt`` entry-point group (unless ``TNT_DISABLE_PLUGIN_AUTOLOAD``) -> modules named in
``TNT_PLUGINS`` (like ``pytest -p``: a plugin without packaging) -> built-ins ->
``check_pending()``, so a hook name typo in any plugin fails at start-up.
"""

from __future__ import annotations

import logging
import threading
from importlib import metadata

import pluggy

from . import _hookspecs as hookspecs
from . import _settings as settings
from ._errors import PluginError
from ._markers import ENTRY_POINT_GROUP, PROJECT_NAME
from ._settings import bad_input

__all__ = ["get_plugin_manager", "reset_plugin_manager", "BUILTIN_PLUGINS"]

#: Modules of tnt-core that implement hooks themselves. The test-only ``store`` backend is
#: not one: tests register it through ``TNT_PLUGINS``
#: (:func:`tnt_core.testing.enable_store_backend`).
BUILTIN_PLUGINS = ("tnt_core._local_backend",)

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
log = logging.getLogger("tnt.plugins")


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Load the ``tnt`` entry points through pluggy, one name at a time.

    pluggy's loader keeps the distribution of each plugin (``pm.list_plugin_distinfo()``,
    for reports of what is installed); one name per call lets a broken plugin be named
    with its distribution instead of surfacing as a bare ImportError.
    """
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.is_blocked(ep.name) or pm.has_plugin(ep.name):
            continue
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
        except Exception as exc:  # name the broken plugin instead of a bare ImportError
            dist = ep.dist.name if ep.dist else "an unknown distribution"
            raise bad_input(PluginError(
                f"cannot load tnt plugin {ep.name!r} ({ep.value}) from {dist}: {exc}. "
                f"Reinstall or uninstall it, or set TNT_DISABLE_PLUGINS={ep.name} to skip it"
            )) from exc


def _warn_unknown_disabled(disabled: list[str], plugins: list[str]) -> None:
    """A name in ``TNT_DISABLE_PLUGINS`` that no plugin has: a warning, not an error, since a
    site may disable a plugin that only some of its nodes have installed."""
    entry_points = sorted({ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)})
    known = set(entry_points) | set(plugins) | set(BUILTIN_PLUGINS)
    unknown = [name for name in disabled if name not in known]
    if unknown:
        log.warning("TNT_DISABLE_PLUGINS names %s, which no installed tnt plugin is called "
                    "(installed: %s); ignored", ", ".join(repr(n) for n in unknown),
                    ", ".join(entry_points) or "none")


def _new_manager() -> pluggy.PluginManager:
    import importlib

    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    disabled, modules = settings.TNT_DISABLE_PLUGINS.read(), settings.TNT_PLUGINS.read()
    _warn_unknown_disabled(disabled, modules)
    for name in disabled:
        pm.set_blocked(name)
    if not settings.TNT_DISABLE_PLUGIN_AUTOLOAD.read():
        _load_entry_points(pm)
    for module_name in modules:
        if pm.has_plugin(module_name) or pm.is_blocked(module_name):
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # one line when uncaught (bad_input); the cause is kept
            raise bad_input(PluginError(
                f"cannot import plugin module {module_name!r} named in TNT_PLUGINS: {exc}"
            )) from exc
        pm.register(module, name=module_name)
    for module_name in BUILTIN_PLUGINS:
        if not pm.has_plugin(module_name):
            pm.register(importlib.import_module(module_name), name=module_name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a tnt plugin implements an unknown hook: {exc}") from exc
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = _new_manager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the manager so the next call reloads plugins (for tests and notebooks)."""
    global _manager
    with _lock:
        _manager = None
