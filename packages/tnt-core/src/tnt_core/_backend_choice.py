"""Which backend a job runs on: a hook, never an if/elif over names.

Every installed plugin declares its backends through ``tnt_comm_backends``; the choice is
the one named (``TNT_BACKEND``, ``--backend``) or the available one of highest priority.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Sequence

import pluggy

from ._backend import BackendSpec, CommBackend
from ._config import Config
from ._errors import PluginError
from ._launch_env import detect_mpi_launch
from ._log import logger
from ._plugins import get_plugin_manager
from ._watched_backend import WatchedBackend

__all__ = ["list_backends", "select_backend", "start_backend", "unknown_backend_hint"]


def list_backends(pm: pluggy.PluginManager | None = None) -> list[BackendSpec]:
    """Every backend declared by installed plugins, highest priority first."""
    pm = pm or get_plugin_manager()
    specs: dict[str, BackendSpec] = {}
    for result in pm.hook.tnt_comm_backends():
        for spec in result or ():
            if not isinstance(spec, BackendSpec):
                raise PluginError(
                    f"a tnt plugin returned {spec!r} from tnt_comm_backends; "
                    "it must return a list of tnt_core.BackendSpec"
                )
            if spec.name in specs and specs[spec.name] is not spec:
                raise PluginError(
                    f"two installed plugins declare a backend named {spec.name!r}; "
                    "uninstall one, or block it with TNT_DISABLE_PLUGINS"
                )
            specs[spec.name] = spec
    return sorted(specs.values(), key=lambda s: (-s.priority, s.name))


def _names(specs: Iterable[BackendSpec]) -> str:
    return ", ".join(s.name for s in specs) or "none"


def unknown_backend_hint(name: str, installed: Sequence[str]) -> str:
    """What to say after "unknown backend NAME": the installed backend it likely means (the
    same name in other case, or a close spelling: ``Gloo``, ``glo``), else what to install."""
    listing = ", ".join(installed) or "none"
    by_case = {n.lower(): n for n in installed}
    close = difflib.get_close_matches(name.lower(), list(by_case), n=1, cutoff=0.6)
    if close:
        return f"did you mean {by_case[close[0]]}? installed: {listing}"
    return (f"installed: {listing}. Install the package that provides it, e.g. "
            f"pip install tnt-comm-{name.lower()}")


def _script() -> str:
    """The script this process runs, as its command line named it (for a message)."""
    arg = sys.argv[0] if sys.argv else ""
    return arg if arg.endswith(".py") else "script.py"


def select_backend(config: Config, name: str | None = None,
                   pm: pluggy.PluginManager | None = None) -> BackendSpec:
    """``name`` (or ``TNT_BACKEND``) if given, else the available backend of highest priority."""
    specs = list_backends(pm)
    name = name or config.backend
    if name:
        config = config.with_overrides(backend=name)
        for spec in specs:
            if spec.name == name:
                if not spec.is_available(config):
                    available = _names(s for s in specs if s.is_available(config))
                    launch = detect_mpi_launch()
                    if launch is not None and not config.launched and (launch.size or 0) != 1:
                        # under mpiexec/srun without tnt run: no TNT_SIZE, no store
                        raise PluginError(
                            f"backend {name!r} needs `tnt run` to start the job; this process "
                            f"was started by an MPI launcher ({launch.launcher}), which only the "
                            f"mpi backend can join. Run `tnt run -n N --backend {name} -- "
                            f"script.py`, or use TNT_BACKEND=mpi (available: {available})"
                        )
                    raise PluginError(
                        f"backend {name!r} is installed but cannot serve this job "
                        f"(rank {config.rank} of {config.size}); available: {available}"
                    )
                return spec
        raise PluginError(f"unknown backend {name!r} (TNT_BACKEND / --backend); "
                          + unknown_backend_hint(name, [s.name for s in specs]))
    for spec in specs:
        if spec.is_available(config):
            return spec
    if config.size > 1 and not config.rendezvous and detect_mpi_launch() is None:
        # TNT_SIZE set by hand (or left over): the backends decline for want of a store
        raise PluginError(
            f"TNT_SIZE={config.size} asks for a job of {config.size} ranks, but this process "
            "was not started by a launcher (no rendezvous store: TNT_RENDEZVOUS is not set); "
            f"start it with `tnt run -n {config.size} -- {_script()}`"
        )
    raise PluginError(
        f"no communication backend can run a job of {config.size} ranks; installed: "
        f"{_names(specs)}. Install one: pip install tnt-comm-gloo (or tnt-comm-mpi)"
    )


def start_backend(config: Config, name: str | None,
                  pm: pluggy.PluginManager) -> tuple[CommBackend, BackendSpec]:
    """The chosen backend's communicator for ``config``, wrapped for the stall inspector
    in a multi-rank job."""
    spec = select_backend(config, name, pm)
    logger.debug("starting backend %r for rank %d of %d", spec.name, config.rank, config.size)
    comm = spec.factory(config)
    if not isinstance(comm, CommBackend):
        raise PluginError(
            f"backend {spec.name!r} factory returned {type(comm).__name__}, "
            "not a tnt_core.CommBackend"
        )
    if comm.size > 1:
        comm = WatchedBackend(comm)
    return comm, spec
