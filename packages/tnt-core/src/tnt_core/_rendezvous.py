"""The rendezvous store: a small authenticated TCP key-value server and its client.

The launcher hosts one server per job (``TNT_RENDEZVOUS=host:port``); ranks use it to
exchange addresses before the real transport exists. Standard library only.

Wire protocol (big-endian; simple enough for a C++ client):

* handshake: ``_handshake`` with the tag ``b"TNTR"`` (the client's identity
  is its rank, -1 for the launcher). No request is read on a connection before it has
  proven it knows ``TNT_RENDEZVOUS_KEY``, and the key never crosses the wire.
* request: one op byte, then ``str`` = u32 length + UTF-8, ``bytes`` = u64 length + data:
  ``SET str bytes`` · ``GET str i64-timeout-ms`` · ``WAIT u32-n str*n i64-timeout-ms`` ·
  ``CHECK u32-n str*n`` · ``ADD str i64`` · ``DELETE str`` (timeout < 0: no limit).
* reply: status byte (0 ok, 1 timeout, 2 error + ``bytes`` message), then for GET
  ``bytes``, for CHECK and DELETE one byte, for ADD an i64.
"""

from __future__ import annotations

import logging
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from ._addresses import is_loopback
from ._config import Config
from ._elastic import interrupt_on_change
from ._errors import CommError, ConfigError, HandshakeError
from ._handshake import HANDSHAKE_TIMEOUT_S, NO_IDENTITY, Handshake

__all__ = [
    "StoreServer",
    "StoreClient",
    "connect_store",
    "address_towards",
    "reachable_address",
    "RENDEZVOUS_HANDSHAKE",
]

log = logging.getLogger("tnt.rendezvous")

#: the handshake every connection passes before its first request
RENDEZVOUS_HANDSHAKE = Handshake(b"TNTR", "rendezvous store")
OP_SET, OP_GET, OP_WAIT, OP_CHECK, OP_ADD, OP_DELETE = 1, 2, 3, 4, 5, 6
ST_OK, ST_TIMEOUT, ST_ERROR = 0, 1, 2
MAX_KEY = 1 << 16
MAX_VALUE = 1 << 32
#: seconds of a blocking get/wait between two looks at :attr:`StoreClient.interrupt`
INTERRUPT_SLICE_S = 0.25


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _pack_str(s: str) -> bytes:
    b = s.encode()
    if len(b) > MAX_KEY:
        raise ValueError(f"rendezvous key longer than {MAX_KEY} bytes")
    return struct.pack(">I", len(b)) + b


def _pack_bytes(b: bytes) -> bytes:
    return struct.pack(">Q", len(b)) + b


def _read_str(sock: socket.socket) -> str:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > MAX_KEY:
        raise ValueError("key too long")
    return _recv_exact(sock, n).decode()


def _read_bytes(sock: socket.socket) -> bytes:
    (n,) = struct.unpack(">Q", _recv_exact(sock, 8))
    if n > MAX_VALUE:
        raise ValueError("value too large")
    return _recv_exact(sock, n)


def _timeout_s(ms: int) -> float | None:
    return None if ms < 0 else ms / 1000.0


class _Data:
    """The store's contents and the condition every blocked GET/WAIT sleeps on."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def wait_for(self, keys: Sequence[str], timeout: float | None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: all(k in self.values for k in keys), timeout)


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = f"{self.client_address[0]}:{self.client_address[1]}"
        try:
            RENDEZVOUS_HANDSHAKE.server(sock, self.server.key, timeout=HANDSHAKE_TIMEOUT_S)
        except HandshakeError as exc:
            if self.server.closing:
                return
            # a wrong answer is worth a warning; a peer that went away (a rank killed while
            # it connected) is not
            log.log(logging.WARNING if exc.refused else logging.DEBUG,
                    "refused rendezvous peer %s: %s", peer, exc)
            return
        try:
            while not self.server.closing:
                try:
                    op = _recv_exact(sock, 1)[0]
                except ConnectionError:
                    return
                sock.sendall(self._serve(sock, op))
        except (OSError, ValueError, struct.error) as exc:
            if not self.server.closing:
                log.debug("rendezvous connection %s ended: %s", peer, exc)

    def _serve(self, sock: socket.socket, op: int) -> bytes:
        data = self.server.data
        if op == OP_SET:
            key, value = _read_str(sock), _read_bytes(sock)
            with data.cond:
                data.values[key] = value
                data.cond.notify_all()
            return bytes([ST_OK])
        if op == OP_GET:
            key = _read_str(sock)
            (ms,) = struct.unpack(">q", _recv_exact(sock, 8))
            if not data.wait_for([key], _timeout_s(ms)):
                return bytes([ST_TIMEOUT])
            with data.cond:
                return bytes([ST_OK]) + _pack_bytes(data.values[key])
        if op == OP_WAIT:
            (n,) = struct.unpack(">I", _recv_exact(sock, 4))
            keys = [_read_str(sock) for _ in range(n)]
            (ms,) = struct.unpack(">q", _recv_exact(sock, 8))
            return bytes([ST_OK if data.wait_for(keys, _timeout_s(ms)) else ST_TIMEOUT])
        if op == OP_CHECK:
            (n,) = struct.unpack(">I", _recv_exact(sock, 4))
            keys = [_read_str(sock) for _ in range(n)]
            with data.cond:
                present = all(k in data.values for k in keys)
            return bytes([ST_OK, int(present)])
        if op == OP_ADD:
            key = _read_str(sock)
            (amount,) = struct.unpack(">q", _recv_exact(sock, 8))
            with data.cond:
                try:
                    value = int(data.values.get(key, b"0")) + amount
                except ValueError:
                    return bytes([ST_ERROR]) + _pack_bytes(f"ADD on non-counter key {key!r}".encode())
                data.values[key] = str(value).encode()
                data.cond.notify_all()
            return bytes([ST_OK]) + struct.pack(">q", value)
        if op == OP_DELETE:
            key = _read_str(sock)
            with data.cond:
                existed = data.values.pop(key, None) is not None
            return bytes([ST_OK, int(existed)])
        raise ValueError(f"unknown op {op}")


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    # every rank connects at start-up at once: socketserver's backlog of 5 made the kernel
    # drop the rest, whose retries (1 s, 3 s, 7 s...) made 200 connections take ~30 s
    request_queue_size = socket.SOMAXCONN

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.key = key
        self.data = _Data()
        self.closing = False
        super().__init__(address, _Handler)


class StoreServer:
    """A rendezvous store serving in a background thread.

    :param host: address to bind, chosen by the launcher (``127.0.0.1`` for one node, an
        address the other nodes reach for several).
    :param port: 0 picks a free port; read it back from :attr:`address`.
    :param key: the job key; a random one is made if not given (:attr:`key`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, key: str | None = None) -> None:
        self.key = key or secrets.token_hex(16)
        try:
            self._server = _TCPServer((host, port), self.key.encode())
        except OSError as exc:
            raise ConfigError(f"cannot host the rendezvous store on {host}:{port}: {exc}") from exc
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
            name="tnt-rendezvous", daemon=True,
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        assert isinstance(host, str)  # a TCP server's address, never an AF_UNIX path
        return host, port

    @property
    def url(self) -> str:
        """``host:port`` as it goes into ``TNT_RENDEZVOUS``."""
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        if self._server.closing:
            return
        self._server.closing = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreClient:
    """A connection to the rendezvous store. Thread-safe (one request at a time).

    :param connect_timeout: keep retrying the connection this long (ranks may start
        before the server listens).
    :param timeout: default for blocking ``get``/``wait``, seconds (None: no limit).
    """

    def __init__(self, host: str, port: int, key: str, *, connect_timeout: float = 60.0,
                 timeout: float | None = None, rank: int | None = None) -> None:
        self.address = (host, port)
        self.timeout = timeout
        self.rank = rank
        #: asked between slices of a blocking ``get``/``wait``: a reason (a string) ends the
        #: wait with CommError. An elastic job's ranks stop waiting for a peer that left.
        self.interrupt: Callable[[], str | None] | None = None
        self._lock = threading.Lock()
        self._sock = self._connect(key, connect_timeout)

    def _error(self, message: str, operation: str) -> CommError:
        return CommError(message, rank=self.rank, operation=operation)

    def _connect(self, key: str, connect_timeout: float) -> socket.socket:
        deadline = time.monotonic() + connect_timeout
        delay = 0.02
        host, port = self.address
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise self._error(
                        f"cannot reach the rendezvous store at {host}:{port} within "
                        f"{connect_timeout:g}s ({exc}); is the launcher (tnt run) still running?",
                        "rendezvous connect",
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        try:
            RENDEZVOUS_HANDSHAKE.client(sock, key, timeout=HANDSHAKE_TIMEOUT_S,
                                        identity=NO_IDENTITY if self.rank is None else self.rank)
        except HandshakeError as exc:
            sock.close()
            raise self._error(str(exc), "rendezvous connect") from None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _request(self, payload: bytes, operation: str) -> socket.socket:
        try:
            self._sock.sendall(payload)
        except OSError as exc:
            raise self._error(f"rendezvous store connection lost: {exc}", operation) from exc
        return self._sock

    def _status(self, operation: str) -> int:
        try:
            status = _recv_exact(self._sock, 1)[0]
            if status == ST_ERROR:
                raise self._error(_read_bytes(self._sock).decode(), operation)
        except (OSError, ConnectionError) as exc:
            raise self._error(f"rendezvous store connection lost: {exc}", operation) from exc
        return status

    def _ms(self, timeout: float | None) -> int:
        timeout = self.timeout if timeout is None else timeout
        return -1 if timeout is None else max(0, int(timeout * 1000))

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwrites) and wake every waiter."""
        with self._lock:
            self._request(bytes([OP_SET]) + _pack_str(key) + _pack_bytes(bytes(value)), f"set {key!r}")
            self._status(f"set {key!r}")

    def _sliced(self, attempt: Callable[[int], bool], timeout: float | None, op: str) -> bool:
        """``attempt(ms)`` (True: done) until done or ``timeout``; with :attr:`interrupt`, in
        slices, asking it in between."""
        interrupt = self.interrupt
        if interrupt is None:
            return attempt(self._ms(timeout))
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if attempt(self._ms(INTERRUPT_SLICE_S if left is None else min(left, INTERRUPT_SLICE_S))):
                return True
            if left is not None and left <= INTERRUPT_SLICE_S:
                return False
            reason = interrupt()
            if reason:
                raise self._error(reason, op)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until it is set."""
        op = f"get {key!r}"
        value: list[bytes] = []

        def attempt(ms: int) -> bool:
            with self._lock:
                self._request(bytes([OP_GET]) + _pack_str(key) + struct.pack(">q", ms), op)
                if self._status(op) == ST_TIMEOUT:
                    return False
                try:
                    value.append(_read_bytes(self._sock))
                except (OSError, ConnectionError) as exc:
                    raise self._error(f"rendezvous store connection lost: {exc}", op) from exc
                return True

        if not self._sliced(attempt, timeout, op):
            raise self._error(f"key {key!r} was not set within the timeout", op)
        return value[0]

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Return once every key in ``keys`` is set; CommError past the timeout."""
        keys = list(keys)
        op = f"wait {keys[:4]!r}"
        payload = bytes([OP_WAIT]) + struct.pack(">I", len(keys)) + b"".join(map(_pack_str, keys))

        def attempt(ms: int) -> bool:
            with self._lock:
                self._request(payload + struct.pack(">q", ms), op)
                return self._status(op) != ST_TIMEOUT

        if not self._sliced(attempt, timeout, op):
            with self._lock:
                missing = [k for k in keys if not self._check_locked([k])]
            raise self._error(f"keys {missing[:8]} were not set within the timeout", op)

    def _check_locked(self, keys: list[str]) -> bool:
        packed = b"".join(map(_pack_str, keys))
        self._request(bytes([OP_CHECK]) + struct.pack(">I", len(keys)) + packed, "check")
        self._status("check")
        return bool(_recv_exact(self._sock, 1)[0])

    def check(self, keys: Iterable[str]) -> bool:
        """True if every key is set. Does not block."""
        with self._lock:
            return self._check_locked(list(keys))

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add to the integer counter ``key``; return the new value."""
        op = f"add {key!r}"
        with self._lock:
            self._request(bytes([OP_ADD]) + _pack_str(key) + struct.pack(">q", amount), op)
            self._status(op)
            value: int = struct.unpack(">q", _recv_exact(self._sock, 8))[0]
            return value

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed."""
        op = f"delete {key!r}"
        with self._lock:
            self._request(bytes([OP_DELETE]) + _pack_str(key), op)
            self._status(op)
            return bool(_recv_exact(self._sock, 1)[0])

    def close(self) -> None:
        with self._lock:
            try:
                self._sock.close()
            except OSError:
                pass

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_store(config: Config, *, connect_timeout: float = 60.0) -> StoreClient:
    """A client for the job's store from ``TNT_RENDEZVOUS`` / ``TNT_RENDEZVOUS_KEY``."""
    host, port = config.rendezvous_address()
    if not config.rendezvous_key:
        raise ConfigError("TNT_RENDEZVOUS_KEY is not set; it comes from the launcher (tnt run)")
    client = StoreClient(host, port, config.rendezvous_key, connect_timeout=connect_timeout,
                         timeout=config.timeout_s, rank=config.rank)
    if config.elastic:  # a rank waiting for a peer that left stops when the job goes on
        client.interrupt = interrupt_on_change(client, config.generation)
    return client


def address_towards(host: str) -> str | None:
    """This machine's address on the interface that routes to ``host``, or None.

    What a backend listens on when nothing else says: the interface through which this
    node reaches the rendezvous host is the one its peers can reach it on in the usual
    cluster (one network between the nodes). Connecting a UDP socket sends no packet; it
    only asks the kernel for the route.
    """
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(address)
                return str(probe.getsockname()[0])
            except OSError:
                continue
    return None


def reachable_address(rendezvous_host: str | None, *, hint: str = "") -> str:
    """The name or address this node's peers reach it on: what a backend listens on and
    publishes when the user said nothing.

    Loopback when the rendezvous host is loopback (every rank is on this machine); else
    this host's name if it resolves to an address other nodes can reach; else (e.g.
    Debian's ``127.0.1.1 <hostname>`` in /etc/hosts) the address of the interface that
    routes to the rendezvous host. One answer for every backend, so a fix here reaches
    them all.

    :param rendezvous_host: the launcher's store host, None when there is none (a file store).
    :param hint: what the user can set instead, appended to the error.
    :raises ConfigError: when neither the name nor the route gives a reachable address.
    """
    if rendezvous_host and is_loopback(rendezvous_host):
        return "127.0.0.1"
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        problem = "resolves to a loopback address, which other nodes cannot reach"
        if not all(is_loopback(str(info[4][0])) for info in infos):
            return name
    except OSError as exc:
        problem = f"does not resolve ({exc})"
    routed = address_towards(rendezvous_host) if rendezvous_host else None
    if routed and not is_loopback(routed):
        log.info("this host's name %r %s; listening on %s, the address that routes to the "
                 "rendezvous host %s", name, problem, routed, rendezvous_host)
        return routed
    raise ConfigError(
        f"this host's name {name!r} {problem}, and no route to the rendezvous host "
        f"{rendezvous_host or '(none)'} leaves through another interface"
        + (f"; {hint}" if hint else "")
    )
