"""Hook specifications of the ``tnt`` plugin project. Specs only: no behaviour here.

Implementations live next to the behaviour they add (``tnt_core.local_backend``,
``tnt_comm_gloo.plugin``, ``tnt_comm_mpi.plugin``, ``tarantella_plugin``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._markers import hookspec

if TYPE_CHECKING:
    from .backend import BackendSpec
    from .runtime import Runtime
    from .sharding import ShardContext

__all__ = [
    "tnt_comm_backends",
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
