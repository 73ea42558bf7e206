"""Was this process started by an MPI launcher? Decided from the environment alone.

The decision must be cheap and must not initialise MPI: it runs while the runtime picks a
backend, also in processes that end up using Gloo. Every launcher leaves its own marks:

==============================  ==========================================
launcher                        variables read (rank, size)
==============================  ==========================================
MPICH Hydra, Intel MPI          ``PMI_RANK``, ``PMI_SIZE``
Open MPI ``mpirun``/``prterun`` ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``
PMIx (Open MPI 5, ``srun``)     ``PMIX_RANK`` (size from ``SLURM_NTASKS`` or MPI)
Slurm ``srun`` (a job step)     ``SLURM_PROCID``, ``SLURM_NTASKS`` with ``SLURM_STEP_ID``
==============================  ==========================================

A Slurm *batch script* also has ``SLURM_PROCID`` but is not an MPI rank; it is told apart
by its step id (``batch``/``extern``) or the absence of one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["MpiLaunch", "detect_mpi_launch"]

_NOT_A_STEP = {"", "batch", "extern", "interactive"}


@dataclass(frozen=True)
class MpiLaunch:
    """What the environment says about the MPI job this process belongs to.

    :param launcher: a short name for messages (``hydra``, ``openmpi``, ``pmix``, ``slurm``).
    :param rank: the rank the launcher gave this process.
    :param size: the job size if the launcher says it, else None (MPI will tell).
    """

    launcher: str
    rank: int
    size: int | None


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = (env.get(name) or "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def detect_mpi_launch(environ: Mapping[str, str] | None = None) -> MpiLaunch | None:
    """The MPI launch this process is part of, or None when no MPI launcher started it."""
    env = os.environ if environ is None else environ
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    if rank is not None:
        return MpiLaunch("openmpi", rank, _int(env, "OMPI_COMM_WORLD_SIZE"))
    rank = _int(env, "PMI_RANK")
    if rank is not None:
        return MpiLaunch("hydra", rank, _int(env, "PMI_SIZE"))
    rank = _int(env, "PMIX_RANK")
    if rank is not None:
        return MpiLaunch("pmix", rank, _int(env, "SLURM_NTASKS"))
    step = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip().lower()
    rank = _int(env, "SLURM_PROCID")
    if rank is not None and step not in _NOT_A_STEP:
        size = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        return MpiLaunch("slurm", rank, size)
    return None
