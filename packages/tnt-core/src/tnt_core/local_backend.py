"""The built-in ``local`` backend: one rank, every collective a copy or a no-op.

It is what a plain ``python script.py`` gets, so a Tarantella-NT script runs unchanged
without a launcher.
"""

from __future__ import annotations

import numpy as np

from ._markers import hookimpl
from .backend import BackendSpec, CommBackend, CompletedHandle, Handle, check_buffer, check_op
from .config import Config
from .errors import ConfigError

__all__ = ["LocalBackend"]


class LocalBackend(CommBackend):
    """A communicator of size 1."""

    name = "local"

    def __init__(self, config: Config | None = None) -> None:
        config = config or Config()
        if config.size != 1:
            raise ConfigError(
                f"the 'local' backend runs a single rank but TNT_SIZE={config.size}; "
                "install a communication backend (pip install tnt-comm-gloo) or pick one "
                "with TNT_BACKEND / `tnt run --backend`"
            )
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1
        self._closed = False

    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> Handle:
        check_op(op)
        return CompletedHandle(check_buffer(buf, "allreduce"))

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        if root != 0:
            raise ValueError(f"broadcast root {root} is not a rank of a size-1 job")
        return check_buffer(buf, "broadcast")

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        return np.copy(check_buffer(buf, "allgather", writeable=False))[np.newaxis]

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        self._closed = True


@hookimpl
def tnt_comm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="local",
            factory=LocalBackend,
            priority=0,
            available=lambda config: config.size == 1,
            description="single process, no communication",
        )
    ]
