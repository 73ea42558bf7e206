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
from collections.abc import MutableMapping

import numpy as np

from .._markers import hookimpl
from ..backend import BackendSpec, CommBackend, Handle, check_buffer, check_op
from ..comm_thread import CommThread
from ..config import Config
from ..errors import CommError
from ..rendezvous import connect_store

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
        from ..plugins import reset_plugin_manager

        reset_plugin_manager()


_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


class StoreBackend(CommBackend):
    name = "store"

    def __init__(self, config: Config) -> None:
        self.rank, self.size = config.rank, config.size
        self.local_rank, self.local_size = config.local_rank, config.local_size
        self._timeout = config.timeout_s
        self._store = connect_store(config)
        self._thread = CommThread("tnt-store-comm", self.rank, config.timeout_s)
        self._seq = 0
        self._closed = False
        # the handshake everyone must pass before the first collective: all ranks alive
        self._store.set(f"tnt/store/alive/{self.rank}", b"1")
        self._store.wait([f"tnt/store/alive/{r}" for r in range(self.size)], self._timeout)

    def _next(self, what: str) -> tuple[str, str]:
        self._seq += 1
        return f"tnt/store/{self._seq}", f"{what} #{self._seq}"

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
