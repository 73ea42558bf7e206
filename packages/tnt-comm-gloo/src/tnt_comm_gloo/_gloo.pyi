"""Private native layer of tnt_comm_gloo: Gloo collectives on a worker thread.

Every operation is queued on one C++ worker thread and runs in submission order without
the GIL. Buffers must stay alive until their Work is done (backend.py keeps them).
Input errors raise ValueError/TypeError; everything the transport does raises GlooError.
"""

from typing import Any, Protocol

import numpy as np

class GlooError(Exception):
    """A Gloo operation failed (transport error, timeout, dead peer, store failure)."""

class _StoreClient(Protocol):
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, timeout: float | None = ...) -> bytes: ...
    def wait(self, keys: list[str], timeout: float | None = ...) -> None: ...

class Work:
    """An operation queued on the worker thread."""

    @property
    def name(self) -> str: ...
    def done(self) -> bool:
        """True once the operation has finished, successfully or not."""
    def completion_time(self) -> float:
        """time.perf_counter() seconds at completion, or -1 while not done."""

class Communicator:
    """A full-mesh TCP Gloo context."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def failure(self) -> str:
        """The first failure ('' while healthy)."""
    @property
    def allreduce_transport(self) -> str:
        """'shm' (every rank on this host, shared memory) or 'tcp' (Gloo's algorithms)."""
    @property
    def shm_reason(self) -> str:
        """Why the allreduce does not use shared memory ('' when it does)."""
    @property
    def shm_segment_name(self) -> str:
        """This rank's shared-memory segment name (unlinked once all ranks mapped it)."""
    def allreduce(self, buf: np.ndarray, op: str, algorithm: str, name: str) -> Work:
        """Queue an in-place allreduce of a host array (op: sum/min/max/product;
        algorithm, when over TCP: ring/bcube (Gloo's) or doubling (recursive doubling,
        power-of-two groups))."""
    def allreduce_dlpack(self, capsule: Any, op: str, algorithm: str, name: str) -> Work:
        """Queue an in-place allreduce of a DLPack tensor (CUDA: staged through pinned
        host memory)."""
    def broadcast(self, buf: np.ndarray, root: int, name: str) -> Work:
        """Queue an in-place broadcast from root."""
    def allgather(self, src: np.ndarray, dst: np.ndarray, name: str) -> Work:
        """Queue gathering every rank's src into dst (size * src bytes)."""
    def barrier(self, name: str) -> Work:
        """Queue a barrier."""
    def wait(self, work: Work, timeout_s: float) -> bool:
        """Block (GIL released) up to timeout_s for work; True once done, False if still
        running. Raises GlooError if it failed. If work is next in line and the worker
        idle, runs it on this thread."""
    def time_direct_allreduce(self, buf: np.ndarray, algorithm: str, iters: int) -> list[float]:
        """Benchmark baseline: the allreduce algorithm (sum; ring, bcube, doubling over
        TCP, or shm) called directly iters times on this thread, bypassing the queue;
        seconds per call."""
    def abort(self, reason: str) -> None:
        """Fail this and every later operation; close the connections."""
    def close(self, grace_s: float) -> bool:
        """Finish queued operations (up to grace_s), stop the worker, close connections.
        False if the worker had to be abandoned."""

def dlpack_nbytes(capsule: Any) -> int:
    """Bytes of the tensor in an unconsumed DLPack capsule (checks it too)."""

def connect(rank: int, size: int, store: _StoreClient | None, file_store: str, prefix: str,
            hostname: str, iface: str, timeout_s: float, shm: str = "auto",
            shm_prefix: str = "tnt-gloo-", shm_host_id: str = "",
            shm_chunk_bytes: int = 1048576, shm_spin_us: int = -1) -> Communicator:
    """Build the full TCP mesh (blocking, GIL released) through the store client or the
    file store directory; then, collectively, the shared-memory allreduce when every rank
    is on this host (shm: 'auto', '0' off, '1' try even so; the caller decides what a
    failure means)."""
