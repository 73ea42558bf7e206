"""The ``gloo`` backend: the policy around the native Gloo communicator.

The native module (:mod:`tnt_comm_gloo._gloo`) moves bytes: a C++ worker thread runs
the collectives in submission order without the GIL, and ``Handle.wait`` blocks on a
condition variable with the GIL released. Sends and receives
(:meth:`GlooBackend.send_async`, :meth:`GlooBackend.recv_async`) do not go through that
worker: they are posted to Gloo's unbound buffers from the caller's thread and completed by
native threads of their own (one per peer and direction), so a message never waits behind
a collective, nor a collective behind a message (a pipeline stage receives activations
while its data-parallel group allreduces; a send queued behind an allreduce whose peer
first waits for that send would deadlock). This module decides everything else: where to
listen, how to meet the other ranks, which allreduce algorithm a buffer gets, how long to
wait, and how a native failure reads as :class:`tnt_core.CommError`.

Environment (besides the launcher's ``TNT_*`` contract; declared in
:mod:`tnt_comm_gloo.settings`):

``TNT_GLOO_IFACE``
    network interface to listen on (e.g. ``eth0``, ``ib0``); wins over the host name.
``TNT_GLOO_HOSTNAME``
    address or host name to listen on. Default: ``127.0.0.1`` when every rank runs on
    this node, else this host's name; if that resolves only to a loopback address (as
    Debian's ``127.0.1.1`` entry does) or not at all, the address of the interface that
    routes to the rendezvous host (logged).
``TNT_GLOO_ALGORITHM``
    ``auto`` (default), ``ring``, ``bcube`` or ``doubling``: the allreduce algorithm.
``TNT_GLOO_BCUBE_MAX_BYTES``
    with ``auto``, buffers up to this size are "small" (bcube or recursive doubling),
    larger ones take the ring (default :data:`DEFAULT_BCUBE_MAX_BYTES`, chosen by measurement:
    the package README).
``TNT_GLOO_DOUBLING_MAX_BYTES``
    with ``auto`` on a power-of-two number of ranks, small buffers up to this size use
    recursive doubling instead of bcube (default :data:`DEFAULT_DOUBLING_MAX_BYTES`;
    with 2 ranks doubling is used for every small buffer, see ``algorithm_for``).
``TNT_GLOO_SHM``
    ``auto`` (default): allreduce through shared memory when every rank runs on this
    host, else Gloo over TCP; ``0``: always Gloo over TCP; ``1``: shared memory or a
    :class:`tnt_core.ConfigError` saying why not. Broadcast, allgather and barrier always
    use TCP.
``TNT_GLOO_HIERARCHY``
    ``auto`` (default): when the ranks are on several hosts and every host holds as many
    of them, at least 2, allreduce hierarchically: reduce-scatter through shared memory
    within each host (local rank l keeps slice l), allreduce of each slice over TCP
    among the ranks with the same local rank on every host (all of a host's ranks on
    the network at once), allgather through shared memory. ``0``: the flat TCP
    algorithms; ``1``: shared memory (hierarchical across hosts) or a
    :class:`tnt_core.ConfigError` saying why not. Needs ``TNT_GLOO_SHM`` not ``0``.
``TNT_GLOO_SHM_CHUNK_BYTES``
    bytes per shared-memory slot (default :data:`DEFAULT_SHM_CHUNK_BYTES`); each rank's
    segment holds two slots. The same on every rank.
``TNT_GLOO_SHM_COPY``
    how a rank copies its data into its shared-memory slots: ``stream`` (non-temporal
    stores, past the caches), ``cache`` (memcpy) or ``auto`` (default: each rank times
    both on its first large copies and keeps the faster; which is faster depends on the
    host). The bits are the same either way.
``TNT_GLOO_SHM_SPIN_US``
    microseconds a rank waiting for a peer spins (yielding the CPU every few µs) before it
    sleeps on a futex (default 50).
``TNT_GLOO_SHM_HOST_ID``
    overrides this rank's host identity (default: host name and kernel boot id), e.g. for
    containers on one host that share ``/dev/shm`` under different host names.
``TNT_GLOO_CUDART``
    the CUDA runtime library GPU buffers are staged with (read by the native module;
    default: ``libcudart.so`` and its versioned names).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import numpy as np

from tnt_core import (
    CommBackend,
    CommError,
    Config,
    ConfigError,
    Handle,
    LocalBackend,
    check_buffer,
    check_op,
    check_peer,
    check_split_ranks,
    check_timeout,
    connect_store,
    reachable_address,
)

from . import _gloo
from . import settings as gloo_settings

__all__ = [
    "DEFAULT_BCUBE_MAX_BYTES",
    "DEFAULT_DOUBLING_MAX_BYTES",
    "DEFAULT_SHM_CHUNK_BYTES",
    "GlooBackend",
    "GlooHandle",
    "GlooSettings",
]

log = logging.getLogger("tnt.gloo")

#: Largest allreduce (bytes) that ``auto`` treats as small (bcube or recursive
#: doubling); bigger ones take the ring. Measured on 2 ranks over loopback (README).
DEFAULT_BCUBE_MAX_BYTES: int = gloo_settings.TNT_GLOO_BCUBE_MAX_BYTES.default
#: Largest allreduce that ``auto`` gives to recursive doubling on more than 2 ranks
#: (it sends log2(p) whole buffers, against bcube's two; see the README's cost model).
DEFAULT_DOUBLING_MAX_BYTES: int = gloo_settings.TNT_GLOO_DOUBLING_MAX_BYTES.default
ALGORITHMS = tuple(c for c, _ in gloo_settings.TNT_GLOO_ALGORITHM.choices)
#: ``TNT_GLOO_SHM`` values: use shared memory when possible, never, always (or fail).
SHM_MODES = tuple(c for c, _ in gloo_settings.TNT_GLOO_SHM.choices)
#: Bytes per shared-memory slot: two per rank, so 4 ranks keep 2 MiB in /dev/shm (Docker's
#: default /dev/shm is 64 MiB); large enough that the per-chunk synchronisation is noise,
#: small enough that a chunk's copy, reads and result stay in a core's cache.
DEFAULT_SHM_CHUNK_BYTES: int = gloo_settings.TNT_GLOO_SHM_CHUNK_BYTES.default

_KDL_CPU = 1  # DLPack device type of host memory
_UNBOUNDED = 2**63 - 1  # the last step of an algorithm plan: every buffer fits
#: the largest tag of a send or receive (the native side puts it in a Gloo slot)
MAX_TAG = 2**31 - 1
_generation = itertools.count()  # one store prefix per communicator made by this process
#: in-flight buffers of communicators whose worker could not be stopped: never freed
_abandoned: list[object] = []


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class GlooSettings:
    """The ``TNT_GLOO_*`` variables, validated (declared in :mod:`tnt_comm_gloo.settings`)."""

    iface: str | None = None
    hostname: str | None = None
    algorithm: str = "auto"
    bcube_max_bytes: int = DEFAULT_BCUBE_MAX_BYTES
    doubling_max_bytes: int = DEFAULT_DOUBLING_MAX_BYTES
    shm: str = "auto"
    hierarchy: str = "auto"
    shm_chunk_bytes: int = DEFAULT_SHM_CHUNK_BYTES
    shm_spin_us: int | None = None  # None: the native default
    shm_copy: str = "auto"
    shm_host_id: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GlooSettings:
        env = os.environ if environ is None else environ
        return cls(
            iface=gloo_settings.TNT_GLOO_IFACE.read(env),
            hostname=gloo_settings.TNT_GLOO_HOSTNAME.read(env),
            algorithm=gloo_settings.TNT_GLOO_ALGORITHM.read(env),
            bcube_max_bytes=gloo_settings.TNT_GLOO_BCUBE_MAX_BYTES.read(env),
            doubling_max_bytes=gloo_settings.TNT_GLOO_DOUBLING_MAX_BYTES.read(env),
            shm=gloo_settings.TNT_GLOO_SHM.read(env),
            hierarchy=gloo_settings.TNT_GLOO_HIERARCHY.read(env),
            # its rule (a multiple of 64 in [4096, 64 MiB]) is declared, so tnt run checks it
            shm_chunk_bytes=gloo_settings.TNT_GLOO_SHM_CHUNK_BYTES.read(env),
            shm_spin_us=gloo_settings.TNT_GLOO_SHM_SPIN_US.read(env),
            shm_copy=gloo_settings.TNT_GLOO_SHM_COPY.read(env),
            shm_host_id=gloo_settings.TNT_GLOO_SHM_HOST_ID.read(env),
        )

    def listen_address(self, config: Config) -> tuple[str, str]:
        """``(hostname, iface)`` for Gloo's TCP device; exactly one is non-empty.

        An interface that is not this host's, or a host name that is not an address of this
        host, fails here with a :class:`ConfigError` naming the variable (the rule
        ``tnt run`` checks for the ranks on its own host), not inside Gloo's connect.
        """
        if self.iface:
            gloo_settings.TNT_GLOO_IFACE.check_host(self.iface)
            return "", self.iface
        if self.hostname:
            gloo_settings.TNT_GLOO_HOSTNAME.check_host(self.hostname)
            return self.hostname, ""
        if config.local_size == config.size:
            return "127.0.0.1", ""  # one node: loopback is fastest and needs no DNS
        # the launcher's rendezvous host tells which interface routes to the other nodes
        host = None
        if config.rendezvous and _file_store_dir(config.rendezvous) is None:
            host = config.rendezvous_address()[0]
        return reachable_address(host, hint=(
            "set TNT_GLOO_IFACE to the interface the ranks reach each other on (e.g. eth0), "
            "or TNT_GLOO_HOSTNAME to this node's address")), ""

    def algorithm_for(self, nbytes: int, size: int, per_host: int = 1) -> str:
        """The TCP allreduce algorithm for a buffer of ``nbytes`` on ``size`` ranks
        (ignored when the allreduce runs over shared memory). In the hierarchical
        allreduce ``size`` is the number of hosts and ``per_host`` the ranks on each: the
        algorithm runs between the hosts on one slice, ``nbytes // per_host``.

        Large buffers take Gloo's ring (bandwidth-optimal, pipelined). Small ones need few
        steps: recursive doubling (log2 p exchanges of the whole buffer) on a power-of-two
        group, else Gloo's bcube (2 log2 p exchanges of shrinking pieces). On 2 ranks
        doubling sends no more bytes than bcube in half the steps, so it takes every
        small buffer; on more ranks it sends log2(p)/2 times the bytes, so only the
        smallest.
        """
        if self.algorithm != "auto":
            return self.algorithm
        nbytes //= per_host
        if nbytes > self.bcube_max_bytes:
            return "ring"
        if _is_power_of_two(size) and (size == 2 or nbytes <= self.doubling_max_bytes):
            return "doubling"
        return "bcube"

    def algorithm_plan(self, size: int, per_host: int = 1) -> list[tuple[int, str]]:
        """:meth:`algorithm_for` on ``size`` ranks (``per_host`` as there) as steps
        ``(max_bytes, algorithm)``: a buffer takes the first step it fits in (the last
        step fits every buffer). The native hand-off's table is given this, so its
        allreduces choose as the Python path does."""
        if self.algorithm != "auto":
            return [(_UNBOUNDED, self.algorithm)]
        steps = []
        if _is_power_of_two(size):
            limit = self.bcube_max_bytes if size == 2 else min(self.doubling_max_bytes,
                                                               self.bcube_max_bytes)
            steps.append((limit, "doubling"))
        steps.append((self.bcube_max_bytes, "bcube"))
        # a slice of nbytes // per_host bytes fits `limit` up to (limit + 1) * per_host - 1
        return [*((min((limit + 1) * per_host - 1, _UNBOUNDED), algorithm)
                  for limit, algorithm in steps), (_UNBOUNDED, "ring")]


def _file_store_dir(rendezvous: str) -> str | None:
    """The directory of a ``file:///dir`` rendezvous, None for ``host:port``."""
    if not rendezvous.startswith("file:"):
        return None
    parsed = urlparse(rendezvous)
    if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise ConfigError(
            f"TNT_RENDEZVOUS={rendezvous!r}: a file store is file:///absolute/dir on a file "
            "system every rank shares"
        )
    return parsed.path


class GlooHandle(Handle):
    """An operation in flight (a collective on the worker thread, or a send or receive);
    owns its buffer until done."""

    __slots__ = ("_backend", "_keep", "_operation", "_peer", "_result", "_work")

    def __init__(self, backend: GlooBackend, work: _gloo.Work, operation: str,
                 result: Any, keep: tuple[object, ...] = (), *, peer: int | None = None) -> None:
        self._backend = backend
        self._work = work
        self._operation = operation
        self._result = result
        self._keep = keep  # e.g. the DLPack capsule a staged copy reads from
        self._peer = peer  # the other rank of a send or receive

    def wait(self, timeout: float | None = None) -> Any:
        self._backend._wait(self._work, self._operation, timeout, self._peer)
        return self._result

    def done(self) -> bool:
        return self._work.done()

    def completion_time(self) -> float | None:
        t = self._work.completion_time()
        return t if t >= 0 else None

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<GlooHandle {self._operation} {state}>"


def _job_token(config: Config) -> str:
    """A short token naming this job in shared-memory segment names."""
    text = f"{config.rendezvous}|{config.rendezvous_key or ''}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class GlooBackend(CommBackend):
    """A communicator over all ranks through Gloo's full-mesh TCP transport, with the
    allreduce over shared memory when every rank runs on one host, or hierarchical
    (shared memory within each host, TCP between hosts) on several hosts holding as many
    ranks each."""

    name = "gloo"
    #: point-to-point over Gloo's unbound buffers, groups as new Gloo contexts
    capabilities = frozenset({"p2p", "groups"})

    def __init__(self, config: Config, settings: GlooSettings | None = None, *,
                 _group: str | None = None) -> None:
        if config.size < 2:
            raise ConfigError(
                "the gloo backend needs TNT_SIZE >= 2; a single process uses the 'local' "
                "backend (leave TNT_BACKEND unset)"
            )
        if not config.rendezvous:
            raise ConfigError(
                "the gloo backend needs TNT_RENDEZVOUS (host:port of the launcher's store, "
                "or file:///shared/dir); start the script with `tnt run -n N -- script.py`"
            )
        self.rank, self.size = config.rank, config.size
        self.local_rank, self.local_size = config.local_rank, config.local_size
        self._settings = settings or GlooSettings.from_env()
        if self._settings.algorithm == "doubling" and not _is_power_of_two(config.size):
            raise ConfigError(
                f"TNT_GLOO_ALGORITHM=doubling needs a power-of-two number of ranks, not "
                f"{config.size}; use auto, bcube or ring"
            )
        self._timeout = config.timeout_s
        self._seq = 0
        self._inflight: collections.deque[GlooHandle] = collections.deque()
        # sends and receives complete out of order (a receive may wait for long): kept apart
        self._p2p_inflight: list[GlooHandle] = []
        self._closed = False
        self._native: Any = None  # the native hand-off's capsule, made on first request
        self._config, self._splits = config, 0
        hostname, iface = self._settings.listen_address(config)
        # a group's name (from split) is the same on its members, whatever else they made
        # an elastic job's later membership generations: one name on every member,
        # whatever each process made before (a replacement made nothing)
        generation: int | str = (_group if _group is not None else
                                 f"e{config.generation}" if config.generation else
                                 next(_generation))
        self._group_name = f"{generation}-"
        file_dir = _file_store_dir(config.rendezvous)
        store = None
        try:
            if file_dir is None:
                store = connect_store(config)
                prefix = f"tnt/gloo/{generation}"
            else:
                os.makedirs(file_dir, exist_ok=True)
                # Files outlive the job: when the launcher gave a job key, keys of this
                # job cannot be mistaken for those a previous job left in the directory.
                job = (hashlib.sha256(config.rendezvous_key.encode()).hexdigest()[:16]
                       if config.rendezvous_key else "nokey")
                prefix = f"tnt_gloo_{job}_{generation}"
            settings = self._settings
            spin_us = -1 if settings.shm_spin_us is None else settings.shm_spin_us
            with self._translate("connect"):
                self._comm = _gloo.connect(
                    self.rank, self.size, store, file_dir or "", prefix, hostname, iface,
                    self._timeout, shm=settings.shm,
                    shm_prefix=f"tnt-gloo-{_job_token(config)}-{generation}-",
                    shm_host_id=settings.shm_host_id or "",
                    shm_chunk_bytes=settings.shm_chunk_bytes, shm_spin_us=spin_us,
                    hierarchy=settings.hierarchy, shm_copy=settings.shm_copy,
                )
        finally:
            if store is not None:
                store.close()
        self._check_transport(config)
        # the TCP algorithm runs among these ranks, on slices of nbytes // per host
        hosts, per_host = self._comm.host_layout
        self._tcp_layout = ((hosts, per_host) if self.allreduce_transport == "hierarchical"
                            else (self.size, 1))
        log.debug("rank %d/%d connected (listening on %s; allreduce over %s)", self.rank,
                  self.size, iface or hostname, self.allreduce_transport)

    def _check_transport(self, config: Config) -> None:
        # Every rank got the same decision and the same reason from the native set-up, so
        # every rank raises alike and rank 0 alone explains a fallback.
        transport = self.allreduce_transport
        if transport == "shm":
            return
        reason = self._comm.shm_reason
        if transport == "tcp" and "1" in (self._settings.shm, self._settings.hierarchy):
            self._comm.close(5.0)
            self._closed = True
            variable = "TNT_GLOO_SHM" if self._settings.shm == "1" else "TNT_GLOO_HIERARCHY"
            what = "shared-memory" if variable == "TNT_GLOO_SHM" else "hierarchical"
            raise ConfigError(
                f"{variable}=1 but the {what} allreduce cannot be used: {reason}; "
                "unset it (or set auto) to fall back to TCP"
            )
        if self.rank != 0:
            return
        if transport == "hierarchical":
            hosts, per_host = self._comm.host_layout
            log.info("allreduce hierarchical: %d hosts x %d ranks, shared memory within a "
                     "host, TCP between the hosts (one connection set per local rank)",
                     hosts, per_host)
        elif self._settings.shm == "auto":
            # one node by the launcher's account: shared memory was expected to work
            level = logging.WARNING if config.local_size == config.size else logging.INFO
            log.log(level, "allreduce over TCP, not shared memory: %s", reason)

    def allreduce_algorithm(self, nbytes: int) -> str:
        """The TCP algorithm an allreduce of ``nbytes`` takes (:meth:`GlooSettings.algorithm_for`):
        over all ranks, or in the hierarchical allreduce between the hosts on this
        rank's slice; unused over shared memory alone."""
        ranks, per_host = self._tcp_layout
        return self._settings.algorithm_for(nbytes, ranks, per_host)

    @property
    def allreduce_transport(self) -> str:
        """``"shm"`` (shared memory, all ranks on this host), ``"hierarchical"`` (shared
        memory within each host, TCP between hosts) or ``"tcp"`` (Gloo's algorithms
        across all ranks): what :meth:`allreduce_async` runs over; the same on every
        rank."""
        return self._comm.allreduce_transport

    def p2p_transport(self, peer: int) -> str:
        """``"shm"`` (a ring in the shared-memory segments: ``peer`` is on this host and
        the allreduce's segments exist), ``"self"`` or ``"tcp"``: what
        :meth:`send_async` and :meth:`recv_async` with ``peer`` go over."""
        return self._comm.p2p_transport(peer)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.name!r} rank {self.rank}/{self.size}, "
                f"allreduce over {self.allreduce_transport}>")

    # -- the one place a native failure becomes CommError
    def _comm_error(self, exc: _gloo.GlooError, operation: str,
                    peer: int | None = None) -> CommError:
        return CommError(str(exc), rank=self.rank, operation=operation, peer=peer)

    @contextlib.contextmanager
    def _translate(self, operation: str) -> Iterator[None]:
        try:
            yield
        except _gloo.GlooError as exc:
            raise self._comm_error(exc, operation) from None

    def _name(self, what: str) -> str:
        self._seq += 1
        return f"{what} #{self._seq}"

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise CommError("the backend is closed", rank=self.rank, operation=operation)

    def _wait(self, work: _gloo.Work, operation: str, timeout: float | None,
              peer: int | None = None) -> None:
        checked = check_timeout(timeout)
        timeout = self._timeout if checked is None else checked
        try:
            done = self._comm.wait(work, timeout)
        except _gloo.GlooError as exc:  # not _translate: this is the hot path
            raise self._comm_error(exc, operation, peer) from None
        if not done:
            who = "a peer" if peer is None else f"rank {peer}"
            error = CommError(
                f"did not complete within {timeout:g}s (TNT_TIMEOUT_S); {who} may be hung "
                "or dead" + ("" if peer is None else ", or never matched it"),
                rank=self.rank, operation=operation, peer=peer,
            )
            # The ranks' collectives can no longer be matched (and a receive given up on
            # would take a later message): fail everything after it.
            self._comm.abort(str(error))
            raise error

    def _track(self, handle: GlooHandle) -> GlooHandle:
        # Buffers stay referenced until their operation is done, even if the caller
        # drops the handle: the worker thread writes into them.
        inflight = self._inflight
        while inflight and inflight[0].done():
            inflight.popleft()
        inflight.append(handle)
        return handle

    # -- collectives
    def allreduce_async(self, buf: Any, op: str = "sum") -> Handle:
        """Start reducing ``buf`` over all ranks, in place. Nonblocking.

        ``buf`` is a C-contiguous numpy array, or any tensor exposing DLPack: host
        tensors are reduced in place through their data pointer, CUDA tensors are staged
        through pinned host memory. ``wait()`` returns ``buf`` itself.
        """
        check_op(op)
        if not isinstance(buf, np.ndarray) and hasattr(buf, "__dlpack_device__"):
            return self._allreduce_dlpack(buf, op)
        array = check_buffer(buf, "allreduce")
        self._check_open("allreduce")
        name = self._name("allreduce")
        algorithm = self.allreduce_algorithm(array.nbytes)
        try:
            work = self._comm.allreduce(array, op, algorithm, name)
        except _gloo.GlooError as exc:  # not _translate: this is the hot path
            raise self._comm_error(exc, name) from None
        return self._track(GlooHandle(self, work, name, array))

    def _allreduce_dlpack(self, tensor: Any, op: str) -> Handle:
        # The native side reads the capsule: host memory (CPU, CUDA-pinned) is reduced
        # in place through its pointer, CUDA memory is staged through pinned host memory.
        # The capsule is borrowed, not consumed: the handle keeps it (and so the tensor's
        # memory) alive until the operation is done, then the producer's deleter runs.
        device_type, _ = tensor.__dlpack_device__()
        self._check_open("allreduce")
        if device_type == _KDL_CPU:
            capsule = tensor.__dlpack__()
        else:
            try:
                capsule = tensor.__dlpack__(stream=1)  # CUDA: after the legacy stream
            except TypeError:
                capsule = tensor.__dlpack__()
        name = self._name("allreduce" if device_type == _KDL_CPU else "allreduce (device)")
        algorithm = self.allreduce_algorithm(_gloo.dlpack_nbytes(capsule))
        with self._translate(name):
            work = self._comm.allreduce_dlpack(capsule, op, algorithm, name)
        return self._track(GlooHandle(self, work, name, tensor, (capsule,)))

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``buf`` on every rank with the ``root`` rank's ``buf``; return it."""
        check_buffer(buf, "broadcast")
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) \
                or not 0 <= root < self.size:
            raise ValueError(f"broadcast root {root!r} is not a rank in [0, {self.size})")
        self._check_open("broadcast")
        name = self._name(f"broadcast from {root}")
        with self._translate(name):
            work = self._comm.broadcast(buf, int(root), name)
        self._wait(work, name, None)
        return buf

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        """Return an array of shape ``(size, *buf.shape)`` holding every rank's ``buf``."""
        check_buffer(buf, "allgather", writeable=False)
        self._check_open("allgather")
        out = np.empty((self.size, *buf.shape), dtype=buf.dtype)
        name = self._name("allgather")
        with self._translate(name):
            work = self._comm.allgather(buf, out, name)
        self._wait(work, name, None)
        return out

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._check_open("barrier")
        name = self._name("barrier")
        with self._translate(name):
            work = self._comm.barrier(name)
        self._wait(work, name, None)

    # -- the native hand-off
    def native_comm(self) -> Any:
        """The C function table of ``tnt_native_comm.h`` in a PyCapsule (one per backend).
        Its ``allreduce_async`` goes into the same worker queue as :meth:`allreduce_async`
        (shared memory or the TCP algorithm :meth:`allreduce_algorithm` picks), so
        both paths' collectives run in the order they were issued; it calls no Python and
        takes no GIL. The capsule keeps what the table needs alive; once the backend is
        closed the table refuses. Failures read ``[rank R: native allreduce #N] ...``."""
        self._check_open("native_comm")
        if self._native is None:
            with self._translate("native_comm"):
                self._native = self._comm.native_comm(
                    self._settings.algorithm_plan(*self._tcp_layout))
        return self._native

    # -- point-to-point
    def _p2p(self, buf: np.ndarray, peer: Any, tag: Any, operation: str) -> Handle:
        send = operation == "send"
        check_buffer(buf, operation, writeable=not send)
        peer, tag = check_peer(peer, self.size, operation, tag)
        if tag > MAX_TAG:
            raise ValueError(f"{operation}: tag must be <= {MAX_TAG} on the gloo backend, got {tag}")
        self._check_open(operation)
        name = self._name(f"{operation} {'to' if send else 'from'} {peer} tag {tag}")
        try:
            if send:
                work = self._comm.send(buf, peer, tag, name)
            else:
                work = self._comm.recv(buf, peer, tag, name)
        except _gloo.GlooError as exc:
            raise self._comm_error(exc, name, peer) from None
        handle = GlooHandle(self, work, name, buf, peer=peer)
        # Gloo reads or writes the buffer until the operation is done, even if the caller
        # drops the handle: keep it referenced until then.
        self._p2p_inflight = [h for h in self._p2p_inflight if not h.done()]
        self._p2p_inflight.append(handle)
        return handle

    def send_async(self, buf: np.ndarray, dest: int, tag: int = 0) -> Handle:
        """Start sending ``buf`` to rank ``dest``; messages to one (peer, tag) arrive in the
        order sent. Not queued behind collectives. ``buf`` must not change until the
        handle's ``wait`` returns."""
        return self._p2p(buf, dest, tag, "send")

    def recv_async(self, buf: np.ndarray, src: int, tag: int = 0) -> Handle:
        """Start receiving the next message from rank ``src`` with ``tag`` into ``buf``. A
        message of another byte size fails this receive with CommError (the sender and the
        communicator are unaffected). A message that arrives before its receive is posted
        is held in memory of its own and copied into ``buf``."""
        return self._p2p(buf, src, tag, "recv")

    def split(self, ranks: Sequence[int]) -> CommBackend | None:
        """A communicator over ``ranks``: a new Gloo context over them on the same
        rendezvous store under a key prefix of its own (collective over this one). A group
        of one rank is a ``local`` backend."""
        members = check_split_ranks(ranks, self.size)
        self._splits += 1
        digest = np.array([len(members), hash(members) & 0x7FFFFFFFFFFF], dtype=np.int64)
        if not (self.allgather(digest) == digest).all():
            raise ValueError(f"split: the ranks passed different lists (this rank: {list(members)})")
        if self.rank not in members:
            return None
        config = dataclasses.replace(self._config, rank=members.index(self.rank),
                                     size=len(members))
        if len(members) == 1:
            return LocalBackend(dataclasses.replace(config, local_rank=0, local_size=1))
        return GlooBackend(config, self._settings, _group=f"{self._group_name}g{self._splits}")

    def abort(self, reason: str) -> None:
        """Fail what is in flight and everything later with ``reason``; close the
        connections (the peers' operations with this rank fail too)."""
        if not self._closed:
            self._comm.abort(reason)

    def close(self) -> None:
        """Finish queued collectives, stop the worker, close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # A failed communicator fails its queue at once; a healthy one gets the
        # collective timeout to finish what was queued and not waited for.
        grace = 5.0 if self._comm.failure else self._timeout
        if not self._comm.close(grace):
            log.warning("rank %d: the gloo worker thread did not stop; abandoning it",
                        self.rank)
            _abandoned.extend(self._inflight)
            _abandoned.extend(self._p2p_inflight)
        self._inflight.clear()
        self._p2p_inflight.clear()
        self._native = None  # holders of the capsule keep it: its table refuses from now on
