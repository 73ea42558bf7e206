"""The one authenticated handshake of a job's TCP services.

``tnt run``'s rendezvous store and the MPI backend's PMI server listen on TCP, where any
process of the host (or of the network) can connect; a stranger that could set a key or
finalise a rank would corrupt or end the job. So each connection first proves that it
knows the job key (``TNT_RENDEZVOUS_KEY``) before the service reads a single request,
and the key itself never crosses the wire. Both services speak this handshake; a new
service takes a :class:`Handshake` with a tag of its own.

Wire (big-endian), version 2:

* server: ``tag`` (4 bytes), version byte, a fresh 32-byte random nonce;
* client: ``tag``, its identity (i64; a rank, or -1 for none) and
  ``HMAC-SHA256(key, tag + version + nonce + identity)``;
* server: one status byte, :data:`ACCEPTED`, :data:`WRONG_KEY` or :data:`NOT_ADMITTED`
  (the key was right, the identity is not welcome: outside the job or already joined);
  on a refusal it closes the connection.

The digest binds the service, this connection's nonce and the claimed identity, so an
answer seen on one connection is worth nothing on another. Digests are compared in
constant time. Every read on both sides has a deadline for the whole handshake, so a
silent or trickling peer costs at most ``timeout`` seconds. A peer that does not start
its answer with the tag speaks another protocol and is refused at once. Each side reads
exactly the handshake's bytes: what follows on the socket belongs to the service (the PMI
server hands its socket to MPICH's own PMI client).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from ._errors import HandshakeError

__all__ = ["Handshake", "HANDSHAKE_TIMEOUT_S", "ACCEPTED", "WRONG_KEY", "NOT_ADMITTED", "NO_IDENTITY"]

#: the wire version; a peer of another one is told to install the same tnt-core everywhere
VERSION = 2
NONCE_LEN = 32
DIGEST_LEN = 32
#: seconds a peer has for the whole handshake
HANDSHAKE_TIMEOUT_S = 10.0
#: the status byte the server answers with
ACCEPTED, WRONG_KEY, NOT_ADMITTED = 0, 1, 2
#: the identity of a client that is no rank (the launcher's own connections)
NO_IDENTITY = -1
_IDENTITY = struct.Struct(">q")


def _key_bytes(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError("the handshake needs the job key (TNT_RENDEZVOUS_KEY); it is empty")
    return raw


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "the peer"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _recv_exact(sock: socket.socket, n: int, deadline: float, limit: float) -> bytes:
    """``n`` bytes, or :class:`HandshakeError` once ``deadline`` (monotonic) has passed."""
    data = bytearray()
    while len(data) < n:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            raise HandshakeError(f"no complete answer within {limit:g}s") from None
        if not chunk:
            raise HandshakeError("the connection closed during the handshake")
        data += chunk
    return bytes(data)


def _refuse(sock: socket.socket, status: int) -> None:
    """Tell the client why it is refused, if it still listens."""
    try:
        sock.sendall(bytes([status]))
    except OSError:
        pass


@dataclass(frozen=True)
class Handshake:
    """The handshake of one service: ``tag`` (4 bytes) names it on the wire, ``name`` in
    messages (``"rendezvous store"``)."""

    tag: bytes
    name: str

    def __post_init__(self) -> None:
        if len(self.tag) != 4:
            raise ValueError(f"a handshake tag is 4 bytes, got {self.tag!r}")

    def digest(self, key: str | bytes, nonce: bytes, identity: int) -> bytes:
        """What a client that knows ``key`` answers to ``nonce`` as ``identity``."""
        message = self.tag + bytes([VERSION]) + nonce + _IDENTITY.pack(identity)
        return hmac.new(_key_bytes(key), message, hashlib.sha256).digest()

    # -- the two sides -------------------------------------------------------------------

    def client(self, sock: socket.socket, key: str | bytes, *, identity: int = NO_IDENTITY,
               timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        """Prove to the server on ``sock`` that this process knows ``key``.

        Returns once the server accepted; the socket's timeout is as it was before.

        :param identity: the rank this process claims to be (bound into the digest).
        :raises HandshakeError: with what to do: a wrong key, an identity the server does
            not admit, a peer that is not this service or speaks another version, a peer
            that went silent or away.
        """
        where = f"the {self.name} at {_peer(sock)}"
        previous = sock.gettimeout()
        deadline = time.monotonic() + timeout
        try:
            hello = _recv_exact(sock, 5 + NONCE_LEN, deadline, timeout)
            if hello[:4] != self.tag:
                raise HandshakeError(f"it is not a tnt {self.name} (it said {hello[:4]!r})")
            if hello[4] != VERSION:
                raise HandshakeError(f"it speaks handshake version {hello[4]}, this tnt-core "
                                     f"{VERSION}: install the same tnt-core version on every host")
            nonce = hello[5:]
            sock.sendall(self.tag + _IDENTITY.pack(identity) + self.digest(key, nonce, identity))
            status = _recv_exact(sock, 1, deadline, timeout)[0]
        except OSError as exc:  # HandshakeError is one too
            cause = None if isinstance(exc, HandshakeError) else exc
            raise HandshakeError(f"handshake with {where}: {exc}",
                                 refused=isinstance(exc, HandshakeError) and exc.refused) from cause
        finally:
            try:
                sock.settimeout(previous)
            except OSError:
                pass
        if status == WRONG_KEY:
            raise HandshakeError(f"{where} refused this process: wrong job key "
                                 "(TNT_RENDEZVOUS_KEY); every rank of a job must be started by "
                                 "the same launcher (tnt run)", refused=True)
        if status == NOT_ADMITTED:
            raise HandshakeError(f"{where} refused identity {identity} (the key was right): it is "
                                 "not a rank of this job, or it has joined already", refused=True)
        if status != ACCEPTED:
            raise HandshakeError(f"{where} answered the handshake with unknown status {status}")

    def server(self, sock: socket.socket, key: str | bytes, *,
               timeout: float = HANDSHAKE_TIMEOUT_S,
               admit: Callable[[int], bool] | None = None) -> int:
        """Challenge the client on ``sock``; return the identity it proved.

        The socket's timeout is as it was before. On a refusal the client has been told
        (when it is still there to hear it); closing the socket is the caller's.

        :param admit: called once with a proven identity; False refuses it (a rank outside
            the job, or one that joined already). None admits every identity.
        :raises HandshakeError: saying why the client was refused.
        """
        raw_key = _key_bytes(key)
        previous = sock.gettimeout()
        deadline = time.monotonic() + timeout
        nonce = secrets.token_bytes(NONCE_LEN)
        try:
            sock.settimeout(timeout)
            sock.sendall(self.tag + bytes([VERSION]) + nonce)
            if _recv_exact(sock, 4, deadline, timeout) != self.tag:
                _refuse(sock, WRONG_KEY)
                raise HandshakeError(f"it does not speak the {self.name}'s handshake", refused=True)
            answer = _recv_exact(sock, 8 + DIGEST_LEN, deadline, timeout)
            identity: int = _IDENTITY.unpack(answer[:8])[0]
            if not hmac.compare_digest(answer[8:], self.digest(raw_key, nonce, identity)):
                _refuse(sock, WRONG_KEY)
                raise HandshakeError("it does not know the job key (TNT_RENDEZVOUS_KEY)", refused=True)
            if admit is not None and not admit(identity):
                _refuse(sock, NOT_ADMITTED)
                raise HandshakeError(f"it knows the job key, but identity {identity} is not "
                                     "admitted (not a rank of this job, or joined already)",
                                     refused=True)
            sock.sendall(bytes([ACCEPTED]))
        except OSError as exc:  # HandshakeError is one too
            if isinstance(exc, HandshakeError):
                raise
            raise HandshakeError(f"the handshake failed: {exc}") from exc
        finally:
            try:
                sock.settimeout(previous)
            except OSError:
                pass
        return identity
