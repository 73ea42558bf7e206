"""tnt-comm-mpi: the MPI communication backend of Tarantella-NT, over mpi4py.

Installed, it registers the ``mpi`` backend through the ``tnt`` entry-point group
(:mod:`tnt_comm_mpi.plugin`); programs use it through ``tnt_core.init()``. Loading the
plugin must stay cheap (every process loads it, also those that end up on Gloo), so the
names below are imported on first use, not when the package is. Public names:
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from .plugin import PRIORITY

if TYPE_CHECKING:
    from .backend import NOT_UNDER_MPI, MpiBackend
    from .buffers import Staged, prepare
    from .library import cuda_support
    from .progress import Poller, PollSettings

try:
    __version__ = version("tnt-comm-mpi")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

#: public name -> the submodule that defines it
_LAZY = {
    "NOT_UNDER_MPI": "backend",
    "MpiBackend": "backend",
    "Staged": "buffers",
    "prepare": "buffers",
    "cuda_support": "library",
    "Poller": "progress",
    "PollSettings": "progress",
}

__all__ = [
    "NOT_UNDER_MPI",
    "PRIORITY",
    "MpiBackend",
    "PollSettings",
    "Poller",
    "Staged",
    "cuda_support",
    "prepare",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
