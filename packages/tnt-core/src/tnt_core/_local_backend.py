"""The built-in ``local`` backend: one rank, every collective a copy or a no-op.

It is what a plain ``python script.py`` gets, so a Tarantella-NT script runs unchanged
without a launcher.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from ._backend import (
    BackendSpec,
    CommBackend,
    CompletedHandle,
    Handle,
    check_buffer,
    check_op,
    check_peer,
    check_split_ranks,
    check_timeout,
)
from ._config import Config
from ._errors import CommError, ConfigError
from ._markers import hookimpl

__all__ = ["LocalBackend"]


class LocalBackend(CommBackend):
    """A communicator of size 1."""

    name = "local"
    capabilities = frozenset({"p2p", "groups"})

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
        self._messages: dict[int, deque[bytes]] = {}

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

    def send_async(self, buf: np.ndarray, dest: int, tag: int = 0) -> Handle:
        """A message to itself, kept until received (rank 0 is the only peer)."""
        check_buffer(buf, "send", writeable=False)
        _, tag = check_peer(dest, 1, "send", tag)
        self._messages.setdefault(tag, deque()).append(np.ascontiguousarray(buf).tobytes())
        return CompletedHandle(buf)

    def recv_async(self, buf: np.ndarray, src: int, tag: int = 0) -> Handle:
        check_buffer(buf, "recv")
        _, tag = check_peer(src, 1, "recv", tag)
        return _LocalRecv(self._messages.setdefault(tag, deque()), buf, tag)

    def split(self, ranks: Sequence[int]) -> CommBackend | None:
        check_split_ranks(ranks, 1)
        return LocalBackend()

    def close(self) -> None:
        self._closed = True


class _LocalRecv(Handle):
    """Completes when a send to itself with the tag was posted (before or after it): one
    thread can only send it before waiting, so a wait finding none fails at once."""

    def __init__(self, queue: deque[bytes], buf: np.ndarray, tag: int) -> None:
        self._queue, self._buf, self._tag = queue, buf, tag
        self._done = False

    def done(self) -> bool:
        return self._done or bool(self._queue)

    def wait(self, timeout: float | None = None) -> np.ndarray:
        check_timeout(timeout)
        if self._done:
            return self._buf
        if not self._queue:
            raise CommError(f"no message with tag {self._tag} was sent to this rank",
                            rank=0, operation=f"recv from 0 tag {self._tag}")
        data = self._queue.popleft()
        self._done = True
        if len(data) != self._buf.nbytes:
            raise CommError(f"message of {len(data)} bytes does not fit the receive buffer of "
                            f"{self._buf.nbytes} bytes", rank=0, operation=f"recv tag {self._tag}")
        self._buf.reshape(-1)[...] = np.frombuffer(data, dtype=self._buf.dtype)
        return self._buf


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
