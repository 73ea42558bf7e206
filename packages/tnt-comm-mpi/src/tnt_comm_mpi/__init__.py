"""tnt-comm-mpi: the MPI communication backend of Tarantella-NT, over mpi4py.

Installed, it registers the ``mpi`` backend through the ``tnt`` entry-point group
(:mod:`tnt_comm_mpi.plugin`); programs use it through ``tnt_core.init()``. Public names:
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .backend import NOT_UNDER_MPI, MpiBackend
from .buffers import Staged, prepare
from .launch_env import MpiLaunch, detect_mpi_launch
from .library import cuda_support
from .plugin import PRIORITY
from .progress import Poller, PollSettings

try:
    __version__ = version("tnt-comm-mpi")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "NOT_UNDER_MPI",
    "PRIORITY",
    "MpiBackend",
    "MpiLaunch",
    "PollSettings",
    "Poller",
    "Staged",
    "cuda_support",
    "detect_mpi_launch",
    "prepare",
    "__version__",
]
