"""The ``tnt`` entry point of tnt-comm-mpi: declares the ``mpi`` backend and its
``TNT_MPI_*`` settings.

``[project.entry-points.tnt] mpi = "tnt_comm_mpi.plugin"``

Selection (tnt-core picks ``TNT_BACKEND`` if set, else the available backend of highest
priority):

* started by an MPI launcher (``mpiexec``, ``mpirun``, ``srun``): available, priority 200,
  above Gloo's 100, so ``mpiexec -n 4 python train.py`` uses MPI without any flag and the
  ranks are the ones MPI assigned;
* started otherwise (``tnt run``'s own launcher, plain ``python``): available only when
  asked for by name (``TNT_BACKEND=mpi`` / ``tnt run --backend mpi``), so ``tnt run``
  keeps Gloo by default. Asked for, the ranks of ``tnt run`` join one MPI job through
  rank 0's PMI server (:mod:`tnt_comm_mpi.pmi_server`), and what cannot work fails with
  a ``ConfigError`` saying what to do instead of tnt-core's generic "cannot serve this job".

Whether an MPI launcher started the process is read from the environment only
(:func:`tnt_core.detect_mpi_launch`); nothing initialises MPI before the backend is
chosen.
"""

from __future__ import annotations

import importlib.util

from tnt_core import BackendSpec, Config, SettingsRegistry, detect_mpi_launch, hookimpl

from .settings import MPI

__all__ = ["PRIORITY", "tnt_comm_backends", "tnt_register_settings"]

#: above tnt-comm-gloo's 100: under an MPI launcher MPI's rank assignment is the truth
PRIORITY = 200


def _available(config: Config) -> bool:
    if importlib.util.find_spec("mpi4py") is None:
        return False
    return detect_mpi_launch() is not None or config.backend == "mpi"


def _create(config: Config):
    from .backend import MpiBackend  # imported late: loading the plugin must stay cheap

    return MpiBackend(config)


@hookimpl
def tnt_comm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="mpi",
            factory=_create,
            priority=PRIORITY,
            available=_available,
            description="MPI over mpi4py (mpiexec/srun); non-blocking collectives on a comm thread",
        )
    ]


@hookimpl
def tnt_register_settings(registry: SettingsRegistry) -> None:
    registry.add(MPI)
