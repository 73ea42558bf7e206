"""Hook specifications of the ``tnt`` plugin project. Specs only: no behaviour here.

Implementations live next to the behaviour they add (``tnt_core._local_backend``,
``tnt_comm_gloo.plugin``, ``tnt_comm_mpi.plugin``, ``tarantella_plugin``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._markers import hookspec

if TYPE_CHECKING:
    from ._backend import BackendSpec
    from ._runtime import Runtime
    from ._setting_registry import SettingsRegistry
    from ._sharding import ShardContext

__all__ = [
    "tnt_comm_backends",
    "tnt_register_settings",
    "tnt_shard_data",
    "tnt_wrap_callback",
    "tnt_runtime_started",
    "tnt_runtime_stopping",
]

# -- communication backends -------------------------------------------------------------


@hookspec
def tnt_comm_backends() -> list[BackendSpec]:
    """Declare the communication backends this plugin provides.

    Called once, when the runtime starts, to choose a backend: ``TNT_BACKEND`` if set,
    else the available backend of highest priority, else the built-in ``local`` backend.

    :return: a list of :class:`tnt_core.BackendSpec`; results of all plugins are joined.
    """


# -- settings ---------------------------------------------------------------------------


@hookspec
def tnt_register_settings(registry: SettingsRegistry) -> None:
    """Declare this plugin's ``TNT_*`` variables: ``registry.add(group)`` for each
    :class:`tnt_core.SettingGroup` it made (usually one), whose names all start with the
    group's prefix (``TNT_GLOO_``), each with its kind, default, rule and one-line doc.

    Called once per plugin, one plugin after the other, whenever every setting is needed:
    by ``tnt run`` to check the exported and ``-x`` values before it starts a rank, by
    ``tnt settings``, by the docs' tables, and by :func:`tnt_core.read_setting` for a
    name that is not tnt-core's. The plugin's own code reads its values through the
    :class:`tnt_core.Variable` objects ``group.declare`` returned. A group without a
    prefix, or a prefix or group name that tnt-core or another plugin has, is a
    :class:`tnt_core.PluginError` naming both.

    :param registry: the registry of this plugin; ``registry.add(group)`` adds a group.
    """


# -- data -------------------------------------------------------------------------------


@hookspec(firstresult=True)
def tnt_shard_data(data: Any, context: ShardContext) -> Any | None:
    """Return this rank's view of ``data`` (e.g. a dataset batched with the global batch).

    Stops at first non-None result.

    :param data: what the user passed to ``fit``/``evaluate``/``predict``.
    :param context: rank, size, global and micro batch size of the job.
    :return: the per-rank view, or None when this plugin does not know the type.
    """


# -- callbacks --------------------------------------------------------------------------


@hookspec(firstresult=True)
def tnt_wrap_callback(callback: Any, context: dict[str, Any]) -> Any | None:
    """Return how a framework callback runs distributed (on all ranks or the master only,
    with logs aggregated or local).

    Stops at first non-None result.

    :param callback: the user's callback object.
    :param context: ``rank``, ``size`` and framework-specific entries.
    :return: the callback to use instead, or None when this plugin does not know it.
    """


# -- runtime lifecycle ------------------------------------------------------------------


@hookspec
def tnt_runtime_started(runtime: Runtime) -> None:
    """Called once after the backend is up, on every rank.

    :param runtime: the started :class:`tnt_core.Runtime`.
    """


@hookspec
def tnt_runtime_stopping(runtime: Runtime) -> None:
    """Called once before the backend is closed (at exit or on ``shutdown()``).

    :param runtime: the :class:`tnt_core.Runtime` about to stop.
    """
