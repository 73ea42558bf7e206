"""The reference ``store`` backend: collectives through the rendezvous store.

Slow (every byte goes through one Python server) but obviously correct, dependency-free
and multi-process for real. It proves the conformance suite itself and lets tnt-core test
tensor fusion across processes without a native backend. Test code: registered only in
processes that ask for it (``TNT_PLUGINS=tnt_core.testing.store_backend``, which
:func:`tnt_core.testing.enable_store_backend` sets), and even then picked only with
``TNT_BACKEND=store``.

Every rank reduces the ranks' buffers in rank order, so all ranks get bitwise-identical
results, as the real backends must.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import MutableMapping, Sequence

import numpy as np

from .._backend import (
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
from .._comm_thread import CommThread
from .._config import Config
from .._errors import CommError
from .._markers import hookimpl
from .._plugins import reset_plugin_manager
from .._rendezvous import StoreClient, connect_store

__all__ = ["STORE_PLUGIN", "StoreBackend", "enable_store_backend"]

#: the module that registers the test-only ``store`` backend when named in ``TNT_PLUGINS``
STORE_PLUGIN = "tnt_core.testing.store_backend"


def enable_store_backend(env: MutableMapping[str, str] | None = None) -> None:
    """Register the ``store`` backend in ``env`` (default: this process, and so every
    process it starts) by adding it to ``TNT_PLUGINS``.

    Through the environment rather than a call on the plugin manager, so that ranks a test
    spawns (``tnt run``, :func:`launch_ranks`) have it too. Call from a conftest.
    """
    target = os.environ if env is None else env
    names = [n.strip() for n in target.get("TNT_PLUGINS", "").split(",") if n.strip()]
    if STORE_PLUGIN not in names:
        target["TNT_PLUGINS"] = ",".join([*names, STORE_PLUGIN])
    if env is None:
        reset_plugin_manager()


_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


class _RecvHandle(Handle):
    """A receive from the store: polled with back-off (the store client's lock is never held
    across the wait, so collectives and sends go on meanwhile)."""

    def __init__(self, store: StoreClient, rank: int, timeout: float, key: str, buf: np.ndarray,
                 name: str) -> None:
        self._store, self._rank, self._timeout = store, rank, timeout
        self._key, self._buf, self._name = key, buf, name
        self._done = False
        self._t: float | None = None

    def done(self) -> bool:
        if not self._done and self._store.check([self._key]):
            self._complete()
        return self._done

    def completion_time(self) -> float | None:
        return self._t

    def _complete(self) -> None:
        store = self._store
        data = store.get(self._key)
        store.delete(self._key)
        self._done, self._t = True, time.perf_counter()
        if len(data) != self._buf.nbytes:
            raise CommError(f"message of {len(data)} bytes does not fit the receive buffer of "
                            f"{self._buf.nbytes} bytes ({self._buf.dtype} {self._buf.shape})",
                            rank=self._rank, operation=self._name)
        self._buf.reshape(-1)[...] = np.frombuffer(data, dtype=self._buf.dtype)

    def wait(self, timeout: float | None = None) -> np.ndarray:
        limit = check_timeout(timeout) or self._timeout
        deadline, pause = time.monotonic() + limit, 0.0005
        while not self._done:
            if self._store.check([self._key]):
                self._complete()
                break
            if time.monotonic() >= deadline:
                raise CommError(f"no message arrived within {limit:g}s: peer dead, hung or "
                                "never sent", rank=self._rank, operation=self._name)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return self._buf


class StoreBackend(CommBackend):
    name = "store"
    capabilities = frozenset({"p2p", "groups"})

    def __init__(self, config: Config, *, prefix: str = "tnt/store",
                 group: tuple[int, int] | None = None) -> None:
        self.rank, self.size = group or (config.rank, config.size)
        self.local_rank, self.local_size = config.local_rank, config.local_size
        self._config, self._prefix = config, prefix
        self._timeout = config.timeout_s
        self._store = connect_store(config)
        self._p2p = connect_store(config)  # sends and receives, beside the comm thread's
        self._thread = CommThread("tnt-store-comm", self.rank, config.timeout_s)
        self._seq = 0
        self._splits = 0
        self._sent: dict[tuple[int, int], int] = {}
        self._posted: dict[tuple[int, int], int] = {}
        self._p2p_lock = threading.Lock()
        self._closed = False
        # the handshake everyone must pass before the first collective: all ranks alive
        self._store.set(f"{prefix}/alive/{self.rank}", b"1")
        self._store.wait([f"{prefix}/alive/{r}" for r in range(self.size)], self._timeout)

    def _next(self, what: str) -> tuple[str, str]:
        self._seq += 1
        return f"{self._prefix}/{self._seq}", f"{what} #{self._seq}"

    # -- point-to-point: one key per message, numbered per (sender, receiver, tag) ---------

    def _p2p_key(self, src: int, dst: int, tag: int, n: int) -> str:
        return f"{self._prefix}/p2p/{src}/{dst}/{tag}/{n}"

    def send_async(self, buf: np.ndarray, dest: int, tag: int = 0) -> Handle:
        check_buffer(buf, "send", writeable=False)
        dest, tag = check_peer(dest, self.size, "send", tag)
        with self._p2p_lock:
            n = self._sent.get((dest, tag), 0)
            self._sent[(dest, tag)] = n + 1
        self._p2p.set(self._p2p_key(self.rank, dest, tag, n), np.ascontiguousarray(buf).tobytes())
        return CompletedHandle(buf)

    def recv_async(self, buf: np.ndarray, src: int, tag: int = 0) -> Handle:
        check_buffer(buf, "recv")
        src, tag = check_peer(src, self.size, "recv", tag)
        with self._p2p_lock:
            n = self._posted.get((src, tag), 0)
            self._posted[(src, tag)] = n + 1
        return _RecvHandle(self._p2p, self.rank, self._timeout, self._p2p_key(src, self.rank, tag, n), buf,
                           f"recv from {src} tag {tag} #{n}")

    # -- groups: a store backend of its own under a key prefix -----------------------------

    def split(self, ranks: Sequence[int]) -> CommBackend | None:
        members = check_split_ranks(ranks, self.size)
        self._splits += 1
        # every rank must pass the same list: compare a digest of it
        digest = np.array([len(members), hash(members) & 0x7FFFFFFFFFFF], dtype=np.int64)
        seen = self.allgather(digest)
        if not (seen == digest).all():
            raise ValueError(f"split: the ranks passed different lists (this rank: {list(members)})")
        if self.rank not in members:
            return None
        return StoreBackend(self._config, prefix=f"{self._prefix}/g{self._splits}",
                            group=(members.index(self.rank), len(members)))

    def _exchange(self, prefix: str, payload: bytes | None, op: str, senders: range) -> list[bytes]:
        """Publish ``payload`` (if any) and fetch the payloads of ``senders``, in rank order."""
        if payload is not None:
            self._store.set(f"{prefix}/{self.rank}", payload)
        try:
            self._store.wait([f"{prefix}/{r}" for r in senders], self._timeout)
        except CommError as exc:
            missing = [r for r in senders if not self._store.check([f"{prefix}/{r}"])]
            raise CommError(f"no data from rank(s) {missing} within {self._timeout:g}s: "
                            "peer dead or hung", rank=self.rank, operation=op,
                            peer=missing[0] if missing else None) from exc
        data = [self._store.get(f"{prefix}/{r}") if r != self.rank or payload is None else payload
                for r in senders]
        # the last rank to finish reading removes the keys, so the store does not grow
        if self._store.add(f"{prefix}/read", 1) == self.size:
            for r in senders:
                self._store.delete(f"{prefix}/{r}")
            self._store.delete(f"{prefix}/read")
        return data

    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> Handle:
        check_op(op)
        check_buffer(buf, "allreduce")
        prefix, name = self._next("allreduce")

        def run() -> np.ndarray:
            parts = self._exchange(prefix, buf.tobytes(), name, range(self.size))
            acc = np.frombuffer(parts[0], dtype=buf.dtype).copy()
            for part in parts[1:]:
                _REDUCE[op](acc, np.frombuffer(part, dtype=buf.dtype), out=acc)
            buf.reshape(-1)[...] = acc
            return buf

        return self._thread.submit(run, name, buf)

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        check_buffer(buf, "broadcast")
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root {root} is not a rank in [0, {self.size})")
        prefix, name = self._next(f"broadcast from {root}")

        def run() -> np.ndarray:
            payload = buf.tobytes() if self.rank == root else None
            (data,) = self._exchange(prefix, payload, name, range(root, root + 1))
            buf.reshape(-1)[...] = np.frombuffer(data, dtype=buf.dtype)
            return buf

        result: np.ndarray = self._thread.submit(run, name, buf).wait()
        return result

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        check_buffer(buf, "allgather", writeable=False)
        prefix, name = self._next("allgather")

        def run() -> np.ndarray:
            parts = self._exchange(prefix, np.ascontiguousarray(buf).tobytes(), name, range(self.size))
            return np.stack([np.frombuffer(p, dtype=buf.dtype).reshape(buf.shape) for p in parts])

        result: np.ndarray = self._thread.submit(run, name, buf).wait()
        return result

    def barrier(self) -> None:
        prefix, name = self._next("barrier")
        self._thread.submit(lambda: self._exchange(prefix, b"", name, range(self.size)), name).wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.close()
        self._store.close()
        self._p2p.close()


@hookimpl
def tnt_comm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="store",
            factory=StoreBackend,
            priority=-100,
            available=lambda config: config.backend == "store" and config.rendezvous is not None,
            description="reference backend through the rendezvous store (tests only; slow)",
        )
    ]
