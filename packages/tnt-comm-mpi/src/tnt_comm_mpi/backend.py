"""The MPI backend: tnt-core's ``CommBackend`` over mpi4py.

Every MPI call of the backend runs on one communication thread, in submission order
(``tnt_core.CommThread``): the ranks' collectives match because every rank issues them in
the same order, MPI progresses the non-blocking collective the thread is waiting on, and
the caller's thread (backprop) keeps running meanwhile. The one exception keeps both
properties: a caller blocked in ``Handle.wait`` on an operation the thread has not started
runs the queued operations up to its own itself, one at a time and in order, instead of
paying two thread wake-ups (``MPI_THREAD_SERIALIZED`` is all that needs). The thread waits with
:class:`~tnt_comm_mpi.progress.Poller` (spin briefly, then sleep with back-off), never
with MPICH's busy-polling ``MPI_Wait``.

Blocking collectives (``allreduce``, ``broadcast``, ``allgather``, ``barrier``) go through
``CommThread.call``: with nothing queued, the caller's thread runs them itself and the
communication thread is not woken at all.

MPI errors become :class:`tnt_core.CommError` in :meth:`MpiBackend._guarded` (and, on the
short path of host arrays, in the allreduce itself).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tnt_core import (
    SUPPORTED_DTYPES,
    CommBackend,
    CommError,
    CommThread,
    Config,
    ConfigError,
    Handle,
    MpiLaunch,
    check_buffer,
    check_op,
    check_peer,
    check_split_ranks,
    check_timeout,
    connect_store,
    detect_mpi_launch,
    reachable_address,
)

from . import library
from .buffers import Staged, prepare
from .library import (
    cuda_support,
    ending_with_an_error,
    host_pmi_server,
    load_mpi,
    mark_failed,
    register_backend,
)
from .pmi_server import connect_authenticated, start_helper
from .progress import Poller, PollSettings

__all__ = ["MpiBackend", "NOT_UNDER_MPI", "MPI_IMPORTED_TOO_EARLY", "NOT_JOINED", "PMI_FD_CLOSED"]

log = logging.getLogger("tnt.mpi")

NOT_UNDER_MPI = (
    "the mpi backend needs its {size} ranks started by an MPI launcher or by `tnt run`, "
    "but this process has neither an MPI launcher's variables (PMI_RANK, "
    "OMPI_COMM_WORLD_RANK, PMIX_RANK, a Slurm step's SLURM_PROCID) nor TNT_RENDEZVOUS. "
    "Start the job with `mpiexec -n {size} python SCRIPT` (or `srun`), or "
    "`tnt run -n {size} --backend mpi -- SCRIPT`."
)
MPI_IMPORTED_TOO_EARLY = (
    "mpi4py.MPI was imported before the mpi backend started, so MPI already runs as a "
    "single-process job and cannot join the other {size} ranks that tnt run started. Let "
    "tnt start MPI (call tnt_core.init() before importing mpi4py.MPI, or set "
    "mpi4py.rc.initialize = False), or start the job with mpiexec."
)
NOT_JOINED = (
    "TNT_SIZE={size} but MPI started as a job of {mpi_size}: this MPI library ({library}) did "
    "not use tnt's PMI server. Ranks started by `tnt run` can form an MPI job only with an "
    "MPICH-family MPI (MPICH, Intel MPI, MVAPICH); with Open MPI start the job with mpirun "
    "(`tnt run --launcher mpirun`)."
)

PMI_FD_CLOSED = (
    "PMI_FD={fd} is set but file descriptor {fd} is not open in this process: a process "
    "between mpiexec and Python closed it, so MPI cannot reach its process manager "
    "(MPI_Init would abort with 'PMI_Init returned -1'). A wrapper that starts the script "
    "as a child must keep the descriptor open (subprocess.Popen(..., pass_fds=[{fd}])); "
    "or start the script directly: mpiexec -n N python SCRIPT."
)

_OP_NAMES = {"sum": "SUM", "min": "MIN", "max": "MAX", "product": "PROD"}


class MpiBackend(CommBackend):
    """A communicator over all ranks of an MPI job (a duplicate of ``MPI_COMM_WORLD``).

    :param config: the launcher environment; under ``mpiexec`` rank and size come from
        MPI, and ``TNT_SIZE``, when set, must agree with MPI's size.
    :param environ: the environment to read launcher and ``TNT_MPI_*`` settings from
        (default ``os.environ``).
    """

    name = "mpi"
    capabilities = frozenset({"p2p", "groups"})

    def __init__(self, config: Config, *, environ: Mapping[str, str] | None = None) -> None:
        self._closed = False
        launch = detect_mpi_launch(environ)
        self.launch: MpiLaunch | None = launch
        self.joined_through_tnt = False
        if launch is None and config.size > 1 and not library.loaded():
            _join_through_rendezvous(config)
            self.joined_through_tnt = True
        elif launch is None and config.size > 1:  # a later runtime: MPI already joined
            self.joined_through_tnt = True
        else:
            _check_pmi_fd(os.environ if environ is None else environ)
        MPI = load_mpi()
        self._MPI = MPI
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise ConfigError(
                "MPI was initialised with a thread level below MPI_THREAD_SERIALIZED; the mpi "
                "backend calls MPI from its communication thread. Do not lower "
                "mpi4py.rc.thread_level (default 'multiple') before importing tnt"
            )
        self._timeout = config.timeout_s
        rank = launch.rank if launch else config.rank
        self.rank, self.size, self.local_rank, self.local_size = rank, 0, 0, 0
        # MPI allows calls from any thread, one at a time (checked above), so a caller
        # blocked on an operation nobody started yet runs it itself: two thread hand-offs
        # fewer (see tnt_core.CommThread)
        self._thread = CommThread("tnt-mpi-comm", rank, config.timeout_s, run_in_waiter=True)
        self._poller = Poller(PollSettings.from_env(environ), rank, self._abort_reason,
                              waited=lambda: self._thread.has_waiters)
        self._seq = itertools.count(1)
        self._ops = {name: getattr(MPI, mpi_name) for name, mpi_name in _OP_NAMES.items()}
        self._half_as_single = False
        self._native_dtypes: frozenset[np.dtype] = frozenset()
        self._cuda_aware, self.cuda_reason = False, ""
        self._library = ""
        self._comm: Any = None
        try:
            self._submit(self._setup, "init").wait()
        except CommError:
            self._thread.close(timeout=1.0)
            mark_failed()
            raise
        self._thread.rank = self._poller.rank = self.rank
        if self.joined_through_tnt and config.size != self.size:
            self.close()
            raise ConfigError(NOT_JOINED.format(size=config.size, mpi_size=self.size,
                                                library=self._library))
        if config.launched and config.size != self.size:
            self.close()
            raise ConfigError(
                f"TNT_SIZE={config.size} but MPI started {self.size} ranks; start as many "
                f"ranks as TNT_SIZE says (mpiexec -n {config.size}) or unset TNT_SIZE"
            )
        register_backend(self)
        log.info(
            "mpi backend: %d ranks (%d on this node) via %s; %s; thread level %s; "
            "device buffers: %s (%s)",
            self.size, self.local_size,
            launch.launcher if launch else "tnt run (PMI helper of rank 0)"
            if self.joined_through_tnt else "singleton",
            self._library,
            _thread_level_name(MPI),
            "passed to CUDA-aware MPI" if self._cuda_aware else "staged through host memory",
            self.cuda_reason,
        )

    # -- on the communication thread -------------------------------------------------

    def _setup(self) -> None:
        """Everything MPI tells the backend, asked on the communication thread."""
        MPI = self._MPI
        self._library = " ".join(MPI.Get_library_version().split()[:3])
        self._half_as_single = not _has_mpi_type(np.dtype("float16"))
        self._native_dtypes = frozenset(
            d for d in SUPPORTED_DTYPES if not (self._half_as_single and d == np.float16))
        self._cuda_aware, self.cuda_reason = cuda_support()
        comm, request = MPI.COMM_WORLD.Idup()
        self._poller.wait(request, "init (MPI_Comm_idup)", 0, self._timeout)
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()

    def _abort_reason(self) -> BaseException | None:
        failure = self._thread.failure
        if failure is None:
            return None
        return CommError(f"given up after an earlier failure: {failure}", rank=self.rank)

    def _run(self, staged: Staged, start: Callable[[Any], Any], operation: str) -> Any:
        """Start one non-blocking MPI operation on ``staged`` and wait for it."""
        if staged.load is not None:
            staged.load()
        data = staged.host
        if self._half_as_single and staged.dtype == np.float16 and isinstance(data, np.ndarray):
            data = data.astype(np.float32)
        request = start(data)
        self._poller.wait(request, operation, staged.nbytes, self._timeout)
        if data is not staged.host:
            staged.host[...] = data
        if staged.finish is not None:
            staged.finish()
        return staged.host

    # -- on the caller's thread --------------------------------------------------------

    def _submit(self, fn: Callable[[], Any], operation: str, buf: Any = None) -> Handle:
        """Queue ``fn`` on the communication thread."""
        return self._thread.submit(self._guarded(fn, operation), operation, buf)

    def _call(self, fn: Callable[[], Any], operation: str, buf: Any = None) -> Any:
        """Run ``fn`` as the next operation and wait for it (``CommThread.call``: run right
        here, without waking the thread, when nothing else is queued)."""
        return self._thread.call(self._guarded(fn, operation), operation, buf)

    def _guarded(self, fn: Callable[[], Any], operation: str) -> Callable[[], Any]:
        """``fn`` with MPI errors as CommError: the one place they are translated."""
        MPI = self._MPI

        def guarded() -> Any:
            try:
                return fn()
            except MPI.Exception as exc:
                raise self._mpi_error(exc, operation) from exc
            except CommError:
                raise
            except Exception as exc:  # e.g. a failed copy back into a device buffer
                raise CommError(f"{type(exc).__name__}: {exc}", rank=self.rank,
                                operation=operation) from exc

        if self._closed:
            raise CommError("the backend is closed", rank=self.rank, operation=operation)
        return guarded

    def _mpi_error(self, exc: Any, operation: str) -> CommError:
        return CommError(f"MPI error: {exc.Get_error_string().strip()}", rank=self.rank,
                         operation=operation)

    def _prepare(self, buf: Any, operation: str, *, writeable: bool = True) -> Staged:
        staged = prepare(buf, operation, cuda_aware=self._cuda_aware, writeable=writeable)
        if staged.path != "host":
            _log_device_path_once(staged.path, self.cuda_reason)
        return staged

    def allreduce_async(self, buf: Any, op: str = "sum") -> Handle:
        """Start reducing ``buf`` over all ranks, in place (MPI_Iallreduce). Nonblocking."""
        run, name = self._allreduce_op(buf, op)
        return self._thread.submit(run, name, buf)

    def allreduce(self, buf: Any, op: str = "sum") -> Any:
        """Reduce ``buf`` over all ranks, in place, and return it; run by the caller's
        thread when the communication thread has nothing queued (no thread hand-off)."""
        return self._thread.call(*self._allreduce_op(buf, op), buf)

    def _allreduce_op(self, buf: Any, op: str) -> tuple[Callable[[], Any], str]:
        """The operation that reduces ``buf``, and its name (for errors).

        A writable C-contiguous numpy array of a dtype MPI reduces natively takes the
        shortest path this could be written as: right after a multi-megabyte allreduce has
        flushed the caches, every line of Python between the call and ``MPI_Iallreduce``
        is slow (docs/performance_results.md, "Measurements behind the code's choices").
        """
        mpi_op = self._ops.get(op)
        if mpi_op is not None and type(buf) is np.ndarray and buf.dtype in self._native_dtypes:
            flags = buf.flags
            if flags.c_contiguous and flags.writeable and not self._closed:
                name = f"allreduce #{next(self._seq)}"
                comm, poller, timeout, in_place = self._comm, self._poller, self._timeout, self._MPI.IN_PLACE
                mpi_exception = self._MPI.Exception

                def run_host() -> Any:
                    try:
                        poller.wait(comm.Iallreduce(in_place, buf, mpi_op), name, buf.nbytes, timeout)
                    except mpi_exception as exc:
                        raise self._mpi_error(exc, name) from exc
                    return buf

                return run_host, name
        check_op(op)
        staged = self._prepare(buf, "allreduce")  # bad buffers fail here, numbering nothing
        name = f"allreduce #{next(self._seq)}"
        comm, in_place = self._comm, self._MPI.IN_PLACE

        def run() -> Any:
            self._run(staged, lambda data: comm.Iallreduce(in_place, data, mpi_op), name)
            return buf

        return self._guarded(run, name), name

    def broadcast(self, buf: Any, root: int = 0) -> Any:
        """Overwrite ``buf`` with ``root``'s ``buf`` (MPI_Ibcast); return it."""
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"broadcast root {root!r} is not a rank in [0, {self.size})")
        staged = self._prepare(buf, "broadcast")
        name = f"broadcast #{next(self._seq)} from {root}"
        comm, root = self._comm, int(root)

        def run() -> Any:
            self._run(staged, lambda data: comm.Ibcast(_as_bytes(data), root=root), name)
            return buf

        return self._call(run, name, buf)

    def allgather(self, buf: Any) -> np.ndarray:
        """Every rank's ``buf`` stacked: shape ``(size, *buf.shape)`` (MPI_Iallgather)."""
        staged = self._prepare(buf, "allgather", writeable=False)
        name = f"allgather #{next(self._seq)}"
        comm, size = self._comm, self.size

        def run() -> np.ndarray:
            if staged.load is not None:
                staged.load()
            data = staged.host
            shape = tuple(data.shape)
            out = np.empty((size, *shape), dtype=staged.dtype)
            if staged.path == "device":
                request = comm.Iallgather(data, out)
            else:
                request = comm.Iallgather(_as_bytes(data), _as_bytes(out))
            self._poller.wait(request, name, out.nbytes, self._timeout)
            return out

        return self._call(run, name, buf)

    def barrier(self) -> None:
        """Return once every rank entered the barrier (MPI_Ibarrier)."""
        name = f"barrier #{next(self._seq)}"
        comm = self._comm

        def run() -> None:
            self._poller.wait(comm.Ibarrier(), name, 0, self._timeout)

        self._call(run, name)

    @property
    def failed(self) -> bool:
        """True once a collective failed; the backend then refuses further collectives."""
        return self._thread.failure is not None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    # -- point-to-point and groups -----------------------------------------------------

    def _p2p(self, buf: np.ndarray, peer: int, tag: int, operation: str, send: bool) -> Handle:
        check_buffer(buf, operation, writeable=not send)
        peer, tag = check_peer(peer, self.size, operation, tag)
        name = f"{operation} {'to' if send else 'from'} {peer} tag {tag} #{next(self._seq)}"
        comm, MPI = self._comm, self._MPI
        data = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)

        def start() -> Any:  # MPI_Isend / MPI_Irecv: returns at once, on the comm thread
            if send:
                return comm.Isend([data, MPI.BYTE], dest=peer, tag=tag)
            return comm.Irecv([data, MPI.BYTE], source=peer, tag=tag)

        request = self._call(start, name)
        return _MpiP2pHandle(request, buf, name, None if send else data.nbytes, self._MPI,
                             self._call, self.rank, self._timeout)

    def send_async(self, buf: np.ndarray, dest: int, tag: int = 0) -> Handle:
        """Start sending ``buf`` to ``dest`` (MPI_Isend); ordered per (peer, tag)."""
        return self._p2p(buf, dest, tag, "send", True)

    def recv_async(self, buf: np.ndarray, src: int, tag: int = 0) -> Handle:
        """Start receiving from ``src`` into ``buf`` (MPI_Irecv); a message of another size
        raises CommError on this rank."""
        return self._p2p(buf, src, tag, "recv", False)

    def split(self, ranks: Sequence[int]) -> CommBackend | None:
        """A communicator over ``ranks`` (MPI_Comm_split; collective over this one). The
        group shares this backend's communication thread (MPI is called from one thread)."""
        members = check_split_ranks(ranks, self.size)
        name = f"split #{next(self._seq)}"
        comm, MPI = self._comm, self._MPI
        digest = np.array([len(members), hash(members) & 0x7FFFFFFFFFFF], dtype=np.int64)
        if not (self.allgather(digest) == digest).all():
            raise ValueError(f"split: the ranks passed different lists (this rank: {list(members)})")
        member = self.rank in members

        def run() -> Any:
            color = 0 if member else MPI.UNDEFINED
            sub = comm.Split(color, members.index(self.rank) if member else 0)
            if sub != MPI.COMM_NULL:
                sub.Set_errhandler(MPI.ERRORS_RETURN)
            return sub

        sub = self._call(run, name)
        if not member:
            return None
        return _MpiGroup(self, sub)

    def close(self) -> None:
        """Finish queued collectives, free the communicator, stop the thread. Idempotent.

        After a failure nothing waits on the dead peer: the communicator is left as it is
        and ``MPI_Finalize`` is skipped at exit (see :mod:`tnt_comm_mpi.library`). So when
        the program ends with an error: ``MPI_Finalize`` is skipped then too, and
        ``MPI_Comm_free`` can wait for the peers, which wait for this rank in a collective
        (seen once: a 2-rank ``mpiexec`` job whose rank 1 raised stayed in this close,
        silent, until the test's timeout; not reproduced in 80 runs since).
        """
        if self._closed:
            return
        self._closed = True
        comm = self._comm
        if comm is not None and not self.failed and not ending_with_an_error():
            try:
                self._thread.submit(comm.Free, "close (MPI_Comm_free)").wait(self._timeout)
                self._comm = None
            except CommError as exc:
                log.debug("rank %d: closing after a failure: %s", self.rank, exc)
        self._thread.close(timeout=5.0)
        if self.failed:
            mark_failed()


class _MpiGroup(MpiBackend):
    """A sub-communicator: the parent's thread and poller, a communicator of its own."""

    def __init__(self, parent: MpiBackend, comm: Any) -> None:
        self.__dict__.update(vars(parent))  # thread, poller, MPI module, dtype facts
        self._parent = parent
        self._closed = False
        self._seq = itertools.count(1)
        self._comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def close(self) -> None:
        """Free the group's communicator; the parent (and the shared thread) stay open."""
        if self._closed:
            return
        self._closed = True
        comm, self._comm = self._comm, None
        if comm is not None and not self.failed and not self._parent.closed \
                and not ending_with_an_error():
            try:
                self._thread.submit(comm.Free, "close group (MPI_Comm_free)").wait(self._timeout)
            except CommError as exc:
                log.debug("rank %d: closing a group: %s", self.rank, exc)


class _MpiP2pHandle(Handle):
    """A send or receive in flight: tested on the communication thread, slept on here."""

    def __init__(self, request: Any, buf: np.ndarray, name: str, expect: int | None, MPI: Any,
                 call: Callable[[Callable[[], Any], str], Any], rank: int, timeout: float) -> None:
        self._request, self._buf, self._name = request, buf, name
        self._expect = expect  # bytes a receive must get
        self._MPI, self._call, self._rank, self._timeout = MPI, call, rank, timeout
        self._done = False
        self._error: CommError | None = None
        self._t: float | None = None

    def completion_time(self) -> float | None:
        return self._t

    def _test(self) -> bool:
        if self._done:
            return True
        MPI, request, expect = self._MPI, self._request, self._expect

        def test() -> Any:  # errors come back as values: a size mismatch fails only this
            status = MPI.Status()
            try:
                if not request.Test(status):
                    return None
            except MPI.Exception as exc:
                return f"MPI error: {exc.Get_error_string().strip()}"
            got = status.Get_count(MPI.BYTE)
            if expect is not None and got != expect:
                return f"message of {got} bytes does not fit the receive buffer of {expect} bytes"
            return True

        result = self._call(test, self._name)
        if result is None:
            return False
        self._done, self._t = True, time.perf_counter()
        if result is not True:
            self._error = CommError(str(result), rank=self._rank, operation=self._name)
        return True

    def done(self) -> bool:
        return self._test()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        limit = check_timeout(timeout) or self._timeout
        deadline, pause = time.monotonic() + limit, 0.00005
        while not self._test():
            if time.monotonic() >= deadline:
                raise CommError(f"not complete within {limit:g}s: peer dead, hung or never "
                                "matched it", rank=self._rank, operation=self._name)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        if self._error is not None:
            raise self._error
        return self._buf


def _join_through_rendezvous(config: Config) -> None:
    """Ranks started by ``tnt run``: rank 0 serves PMI, every rank's MPI_Init talks to it.

    Each rank connects to the server and proves it knows the job key
    (:func:`~tnt_comm_mpi.pmi_server.connect_authenticated`), then sets
    ``PMI_FD``/``PMI_RANK``/``PMI_SIZE`` in this process's environment, where MPICH's PMI
    client reads them during ``MPI_Init`` (see :mod:`tnt_comm_mpi.pmi_server`).
    """
    if not config.rendezvous:
        raise ConfigError(NOT_UNDER_MPI.format(size=config.size))
    if "mpi4py.MPI" in sys.modules:
        raise ConfigError(MPI_IMPORTED_TOO_EARLY.format(size=config.size))
    host, _ = config.rendezvous_address()
    keys = [f"tnt/mpi/host/{r}" for r in range(config.size)]
    with connect_store(config) as store:  # raises ConfigError without TNT_RENDEZVOUS_KEY
        job_key = str(config.rendezvous_key)
        store.set(keys[config.rank], socket.gethostname().encode())
        if config.rank == 0:
            store.wait(keys, config.timeout_s)
            hosts = [store.get(k, config.timeout_s).decode() for k in keys]
            address = reachable_address(host, hint=(
                "make this host's name resolve to its network address (/etc/hosts, DNS), "
                "or start the job with mpiexec"))
            try:
                helper, port = start_helper(config.size, hosts, address, config.timeout_s,
                                            key=job_key)
            except (OSError, RuntimeError) as exc:
                raise CommError(f"cannot start the PMI server: {exc}", rank=0, operation="init") from exc
            host_pmi_server(helper)
            store.set("tnt/mpi/pmi-port", f"{address}:{port}".encode())
        try:
            pmi_port = store.get("tnt/mpi/pmi-port", config.timeout_s).decode()
        except CommError as exc:
            raise CommError(f"rank 0 did not publish its PMI server within {config.timeout_s:g}s "
                            f"(TNT_TIMEOUT_S): {exc}", rank=config.rank, operation="init") from exc
    pmi_host, _, pmi_port_number = pmi_port.rpartition(":")
    try:
        sock = connect_authenticated(pmi_host, int(pmi_port_number), job_key, config.rank,
                                     timeout=min(config.timeout_s, 60.0))
    except (OSError, ConnectionError) as exc:
        raise CommError(f"cannot join the job's PMI server at {pmi_port}: {exc}",
                        rank=config.rank, operation="init") from exc
    for name in ("PMI_FD", "PMI_RANK", "PMI_SIZE", "PMI_PORT", "PMI_ID"):
        os.environ.pop(name, None)
    # detach: the descriptor now belongs to MPICH's PMI client for the life of the process
    os.environ.update(PMI_FD=str(sock.detach()), PMI_RANK=str(config.rank),
                      PMI_SIZE=str(config.size))


def _check_pmi_fd(env: Mapping[str, str]) -> None:
    """Fail clearly, before MPI_Init aborts the process, if Hydra's PMI socket is gone."""
    raw = (env.get("PMI_FD") or "").strip()
    if not raw.isdigit() or "mpi4py.MPI" in sys.modules:
        return
    try:
        os.fstat(int(raw))
    except OSError:
        raise ConfigError(PMI_FD_CLOSED.format(fd=int(raw))) from None


def _thread_level_name(MPI: Any) -> str:
    level = MPI.Query_thread()
    for name in ("multiple", "serialized", "funneled", "single"):
        if level == getattr(MPI, f"THREAD_{name.upper()}"):
            return name
    return str(level)


def _has_mpi_type(dtype: np.dtype) -> bool:
    """Whether this MPI has a datatype for ``dtype`` (float16 is an MPICH extension)."""
    from mpi4py.util import dtlib

    try:
        dtlib.from_numpy_dtype(dtype)
    except (ValueError, KeyError, TypeError):
        return False
    return True


def _as_bytes(data: Any) -> Any:
    """A byte view of a host array (type-agnostic transfers); device objects pass unchanged."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return data


_logged_paths: set[str] = set()


def _log_device_path_once(path: str, reason: str) -> None:
    if path in _logged_paths:
        return
    _logged_paths.add(path)
    if path == "device":
        log.info("device buffers go to MPI directly: the MPI library is CUDA-aware (%s)", reason)
    else:
        log.info("device buffers are staged through host memory: the MPI library is not "
                 "CUDA-aware (%s); set TNT_MPI_CUDA_AWARE=1 if it is", reason)
