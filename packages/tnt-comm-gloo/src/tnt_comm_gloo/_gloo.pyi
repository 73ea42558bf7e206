"""
Private native layer of tnt_comm_gloo: Gloo collectives on a worker thread, sends and receives beside it.
"""

from collections.abc import Sequence
from typing import Annotated

from numpy.typing import NDArray
from typing_extensions import CapsuleType


class GlooError(Exception):
    pass

class Work:
    """An operation queued on the worker thread."""

    def done(self) -> bool:
        """True once the operation has finished, successfully or not."""

    def completion_time(self) -> float:
        """time.perf_counter() seconds at completion, or -1 while not done."""

    @property
    def name(self) -> str: ...

class Communicator:
    """A full-mesh TCP Gloo context."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def failure(self) -> str: ...

    @property
    def allreduce_transport(self) -> str: ...

    @property
    def shm_reason(self) -> str: ...

    @property
    def shm_segment_name(self) -> str: ...

    @property
    def shm_copy(self) -> str:
        """
        How this rank copies into its shared-memory slots: 'stream' (non-temporal stores), 'cache' (memcpy), 'auto' while it still times both; '' without shared memory.
        """

    def p2p_transport(self, peer: int) -> str:
        """
        What messages to and from `peer` go over: 'shm' (a ring in shared memory: the peer is on this host), 'self' or 'tcp'.
        """

    @property
    def host_layout(self) -> tuple[int, int]:
        """
        (hosts, ranks per host) of the hierarchical allreduce; (1, size) without it.
        """

    def allreduce(self, buf: Annotated[NDArray, dict(order='C', device='cpu')], op: str, algorithm: str, name: str) -> Work:
        """Queue an in-place allreduce of a host array."""

    def allreduce_dlpack(self, capsule: object, op: str, algorithm: str, name: str) -> Work:
        """
        Queue an in-place allreduce of a DLPack tensor (CUDA: staged through pinned host memory).
        """

    def broadcast(self, buf: Annotated[NDArray, dict(order='C', device='cpu')], root: int, name: str) -> Work:
        """Queue an in-place broadcast from root."""

    def allgather(self, src: Annotated[NDArray, dict(order='C', device='cpu', writable=False)], dst: Annotated[NDArray, dict(order='C', device='cpu')], name: str) -> Work:
        """Queue gathering every rank's src into dst (size * src bytes)."""

    def barrier(self, name: str) -> Work:
        """Queue a barrier."""

    def send(self, buf: Annotated[NDArray, dict(order='C', device='cpu', writable=False)], dest: int, tag: int, name: str) -> Work:
        """
        Start sending buf to rank dest (not queued behind collectives); the bytes are read until the Work is done.
        """

    def recv(self, buf: Annotated[NDArray, dict(order='C', device='cpu')], src: int, tag: int, name: str) -> Work:
        """
        Start receiving the next message from rank src with tag into buf; a message of another byte size fails the Work.
        """

    def wait(self, work: Work, timeout_s: float) -> bool:
        """
        Block (GIL released) up to timeout_s for work; True once done, False if still running. Raises GlooError if it failed. If work is next in line and the worker idle, runs it on this thread.
        """

    def time_direct_allreduce(self, buf: Annotated[NDArray, dict(order='C', device='cpu')], algorithm: str, iters: int) -> list[float]:
        """
        Benchmark baseline: the allreduce algorithm (sum; ring, bcube, doubling over TCP, or shm) called directly iters times on this thread, bypassing the queue; seconds per call.
        """

    def native_comm(self, plan: Sequence[tuple[int, str]]) -> CapsuleType:
        """
        The native hand-off: a capsule named 'tnt_native_comm' holding the C table of tnt_native_comm.h, whose allreduce_async queues behind this communicator's collectives; plan is [(max_bytes, algorithm), ...] (the first step a buffer fits in, else the last). The table refuses once the communicator is closed.
        """

    def abort(self, reason: str) -> None:
        """Fail this and every later operation; close the connections."""

    def close(self, grace_s: float) -> bool:
        """
        Finish queued operations (up to grace_s), stop the worker, close connections. False if the worker had to be abandoned.
        """

def dlpack_nbytes(capsule: object) -> int:
    """Bytes of the tensor in an unconsumed DLPack capsule (checks it too)."""

def connect(rank: int, size: int, store: object | None, file_store: str, prefix: str, hostname: str, iface: str, timeout_s: float, shm: str = 'auto', shm_prefix: str = 'tnt-gloo-', shm_host_id: str = '', shm_chunk_bytes: int = 262144, shm_spin_us: int = -1, hierarchy: str = 'auto', shm_copy: str = 'auto') -> Communicator:
    """
    Build the full TCP mesh (blocking, GIL released) through the store client or the file store directory; then, collectively, the shared-memory allreduce when every rank is on this host (shm: 'auto', '0' off, '1' try even so; the caller decides what a failure means), or the hierarchical one when the ranks are on several hosts holding as many (>= 2) each (hierarchy: 'auto', '0' off, '1' as auto). shm_copy: how a rank copies into its slots ('stream', 'cache', or 'auto': the faster of the two on its first large copies).
    """
