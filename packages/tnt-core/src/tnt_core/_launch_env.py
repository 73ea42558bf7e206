"""Was this process started by an MPI launcher? Decided from the environment alone.

One reading of the launchers' variables for everyone who asks: the MPI backend (should it
be picked, which rank is this) and ``tnt run``'s rank agent under ``mpirun``/``srun``
(which rank, which local rank for GPU pinning). The decision must be cheap and must not
initialise MPI: it runs while the runtime picks a backend, also in processes that end up
using Gloo. Every launcher leaves its own marks:

==============================  ===================================================
launcher                        variables read (rank, size; local rank, local size)
==============================  ===================================================
Open MPI ``mpirun``/``prterun`` ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``
MPICH Hydra, Intel MPI          ``PMI_RANK``, ``PMI_SIZE``; ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
PMIx (Open MPI 5, ``srun``)     ``PMIX_RANK``, ``PMIX_SIZE`` or Slurm's task count;
                                ``PMIX_LOCAL_RANK``, ``PMIX_LOCAL_SIZE``
Slurm ``srun`` (a job step)     ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``;
                                ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``
==============================  ===================================================

A Slurm *batch script* also has ``SLURM_PROCID`` but is not an MPI rank; it is told apart
by its step id (``batch``/``extern``) or the absence of one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["MpiLaunch", "detect_mpi_launch", "expand_tasks_per_node"]

_NOT_A_STEP = {"", "batch", "extern", "interactive"}


@dataclass(frozen=True)
class MpiLaunch:
    """What the environment says about the MPI job this process belongs to.

    :param launcher: a short name for messages (``hydra``, ``openmpi``, ``pmix``, ``slurm``).
    :param rank: the rank the launcher gave this process.
    :param size: the job size if the launcher says it, else None (MPI will tell).
    :param local_rank: the rank among this node's ranks, None when the launcher does not say.
    :param local_size: how many ranks run on this node, None when the launcher does not say.
    """

    launcher: str
    rank: int
    size: int | None
    local_rank: int | None = None
    local_size: int | None = None


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = (env.get(name) or "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's ``2(x3),1`` notation as ``[2, 2, 2, 1]``; ``[]`` when it does not parse."""
    out: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            count, _, rep = part.partition("(x")
            out.extend([int(count)] * (int(rep.rstrip(")")) if rep else 1))
    except ValueError:
        return []
    return out


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    per_node = expand_tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    node = _int(env, "SLURM_NODEID") or 0
    return per_node[node] if node < len(per_node) else None


def _slurm_size(env: Mapping[str, str]) -> int | None:
    return _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")


def detect_mpi_launch(environ: Mapping[str, str] | None = None) -> MpiLaunch | None:
    """The MPI launch this process is part of, or None when no MPI launcher started it."""
    env = os.environ if environ is None else environ
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    if rank is not None:
        return MpiLaunch("openmpi", rank, _int(env, "OMPI_COMM_WORLD_SIZE"),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))
    rank = _int(env, "PMI_RANK")
    if rank is not None:
        return MpiLaunch("hydra", rank, _int(env, "PMI_SIZE"),
                         _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"))
    rank = _int(env, "PMIX_RANK")
    if rank is not None:
        size = _int(env, "PMIX_SIZE") or _slurm_size(env)
        local_rank = _int(env, "PMIX_LOCAL_RANK")
        local_size = _int(env, "PMIX_LOCAL_SIZE")
        if local_rank is None:
            local_rank = _int(env, "SLURM_LOCALID")
        if local_size is None and "SLURM_LOCALID" in env:
            local_size = _slurm_local_size(env)
        return MpiLaunch("pmix", rank, size, local_rank, local_size)
    step = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip().lower()
    rank = _int(env, "SLURM_PROCID")
    if rank is not None and step not in _NOT_A_STEP:
        return MpiLaunch("slurm", rank, _slurm_size(env), _int(env, "SLURM_LOCALID"),
                         _slurm_local_size(env))
    return None
