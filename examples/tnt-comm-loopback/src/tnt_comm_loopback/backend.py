"""Collectives through rank 0 (a star) over loopback TCP.

Rank 0 receives every rank's buffer, reduces in rank order and sends the result back, so
all ranks get identical bits. Simple, single-machine, and honest about failures: when
anything goes wrong every connection is closed, so every rank sees ``CommError``.
"""

from __future__ import annotations

import struct
from multiprocessing.connection import Client, Connection, Listener

import numpy as np

from tnt_core import (
    CommBackend,
    CommError,
    CommThread,
    ConfigError,
    Handle,
    bad_input,
    check_buffer,
    check_op,
    connect_store,
)

from .plugin import TNT_LOOPBACK_PORT

_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}
_ROOT_KEY = "loopback/root-address"


class LoopbackBackend(CommBackend):
    name = "loopback"

    def __init__(self, config) -> None:
        self.rank, self.size = config.rank, config.size
        self.local_rank, self.local_size = config.local_rank, config.local_size
        self._timeout = config.timeout_s
        authkey = config.rendezvous_key.encode()
        store = connect_store(config)
        try:
            if self.rank == 0:
                port = TNT_LOOPBACK_PORT.read()  # checked: an integer in [0, 65535]
                try:
                    self._listener = Listener(("127.0.0.1", port), authkey=authkey)
                except OSError as exc:  # one line, not a traceback: the user's value
                    raise bad_input(ConfigError(f"TNT_LOOPBACK_PORT={port}: cannot listen on "
                                                f"127.0.0.1:{port} ({exc.strerror})")) from None
                #: where rank 0 listens, ``(host, port)``
                self.root_address = self._listener.address
                store.set(_ROOT_KEY, "{}:{}".format(*self.root_address).encode())
                peers = {}
                for _ in range(self.size - 1):
                    conn = self._listener.accept()
                    (rank,) = struct.unpack(">i", conn.recv_bytes())
                    peers[rank] = conn
                self._peers = [peers[r] for r in range(1, self.size)]
            else:
                host, port = store.get(_ROOT_KEY, timeout=self._timeout).decode().rsplit(":", 1)
                self._root = Client((host, int(port)), authkey=authkey)
                self._root.send_bytes(struct.pack(">i", self.rank))
        finally:
            store.close()
        self._thread = CommThread("tnt-loopback", self.rank, self._timeout)
        self._seq = 0
        self._closed = False

    # -- transport ----------------------------------------------------------------------

    def _recv(self, conn: Connection, peer: int, op: str) -> bytes:
        try:
            if not conn.poll(self._timeout):
                raise CommError(f"no data from rank {peer} within {self._timeout:g}s",
                                rank=self.rank, operation=op, peer=peer)
            return conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise CommError(f"rank {peer} closed the connection (dead?)", rank=self.rank,
                            operation=op, peer=peer) from exc

    def _send(self, conn: Connection, data: bytes, peer: int, op: str) -> None:
        try:
            conn.send_bytes(data)
        except OSError as exc:
            raise CommError(f"cannot send to rank {peer}: {exc}", rank=self.rank,
                            operation=op, peer=peer) from exc

    def _run(self, what: str, fn, buf=None) -> Handle:
        """Queue ``fn`` on the comm thread; on failure cut every connection so the other
        ranks fail fast instead of waiting for the timeout."""
        self._seq += 1
        op = f"{what} #{self._seq}"

        def guarded():
            try:
                return fn(op)
            except CommError:
                self._disconnect()
                raise

        return self._thread.submit(guarded, op, buf)

    def _gather_to_root(self, payload: bytes, op: str) -> list[bytes] | None:
        if self.rank == 0:
            return [payload] + [self._recv(c, r, op) for r, c in enumerate(self._peers, 1)]
        self._send(self._root, payload, 0, op)
        return None

    def _from_root(self, payload: bytes | None, op: str) -> bytes:
        if self.rank == 0:
            for r, c in enumerate(self._peers, 1):
                self._send(c, payload, r, op)
            return payload
        return self._recv(self._root, 0, op)

    # -- collectives --------------------------------------------------------------------

    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> Handle:
        check_op(op)
        check_buffer(buf, "allreduce")

        def run(name):
            parts = self._gather_to_root(buf.tobytes(), name)
            result = None
            if parts is not None:
                acc = np.frombuffer(parts[0], buf.dtype).copy()
                for part in parts[1:]:
                    _REDUCE[op](acc, np.frombuffer(part, buf.dtype), out=acc)
                result = acc.tobytes()
            buf.reshape(-1)[...] = np.frombuffer(self._from_root(result, name), buf.dtype)
            return buf

        return self._run("allreduce", run, buf)

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        check_buffer(buf, "broadcast")
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root {root} is not a rank in [0, {self.size})")

        def run(name):
            data = None
            if root == 0:
                data = buf.tobytes() if self.rank == 0 else None
            elif self.rank == root:
                self._send(self._root, buf.tobytes(), 0, name)
            elif self.rank == 0:
                data = self._recv(self._peers[root - 1], root, name)
            buf.reshape(-1)[...] = np.frombuffer(self._from_root(data, name), buf.dtype)
            return buf

        return self._run(f"broadcast from {root}", run, buf).wait()

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        check_buffer(buf, "allgather", writeable=False)

        def run(name):
            parts = self._gather_to_root(np.ascontiguousarray(buf).tobytes(), name)
            joined = self._from_root(b"".join(parts) if parts is not None else None, name)
            return np.frombuffer(joined, buf.dtype).reshape(self.size, *buf.shape).copy()

        return self._run("allgather", run, buf).wait()

    def barrier(self) -> None:
        self._run("barrier", lambda name: self._from_root(
            b"" if self._gather_to_root(b"", name) is not None else None, name)).wait()

    def _disconnect(self) -> None:
        for conn in getattr(self, "_peers", []) + ([self._root] if hasattr(self, "_root") else []):
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.close(timeout=self._timeout if self._thread.failure is None else 1.0)
        self._disconnect()
        if self.rank == 0:
            self._listener.close()
