"""Horovod's process functions on tarantella's runtime (started when tarantella is imported)."""

from __future__ import annotations

from typing import Any

import tnt_core

from ..errors import NotSupportedError

__all__ = ["init", "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size"]


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start the job's runtime if it is not running (``tnt run`` gave the ranks their places;
    importing tarantella started it already, so this is usually a no-op). In an elastic job
    (``tnt run --min-np``), training goes on after ranks leave inside ``hvd.elastic.run``;
    elsewhere a collective that loses a rank fails."""
    if comm is not None or process_sets is not None:
        raise NotSupportedError(
            "hvd.init(comm=..., process_sets=...): the ranks and their communicator come from "
            "`tnt run`; call hvd.init() without arguments (groups of ranks: tnt.Group(ranks))"
        )
    tnt_core.init()


def shutdown() -> None:
    """Stop the runtime (it also stops at exit)."""
    tnt_core.shutdown()


def is_initialized() -> bool:
    """Whether the runtime runs."""
    return tnt_core.is_initialized()


def rank() -> int:
    """This process's rank in the job."""
    return tnt_core.init().rank


def size() -> int:
    """The number of ranks in the job."""
    return tnt_core.init().size


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return tnt_core.init().local_rank


def local_size() -> int:
    """The number of ranks on this host."""
    return tnt_core.init().local_size
