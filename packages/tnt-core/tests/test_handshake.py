"""The one handshake of a job's TCP services (rendezvous store, PMI server), both sides
spoken over a socket pair; the services' own tests speak it over TCP."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tnt_core import HandshakeError
from tnt_core._handshake import VERSION, Handshake

KEY = "job-key"
SERVICE = Handshake(b"TEST", "test service")


def _serve(sock, **kw):
    """Run the server side in a thread; its result (identity or exception) in a list."""
    out: list = []

    def run():
        try:
            out.append(SERVICE.server(sock, KEY, **kw))
        except HandshakeError as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_rank_that_knows_the_key_is_admitted_and_nothing_past_the_handshake_is_read():
    client, server = socket.socketpair()
    with client, server:
        thread, out = _serve(server, admit=lambda rank: rank == 3)
        SERVICE.client(client, KEY, identity=3)
        thread.join(5)
        assert out == [3]
        client.sendall(b"first request")
        server.sendall(b"first reply")
        assert server.recv(64) == b"first request"
        assert client.recv(64) == b"first reply"
        assert client.gettimeout() is None and server.gettimeout() is None, "timeouts restored"


def test_a_wrong_key_is_refused_on_both_sides_with_what_to_do():
    client, server = socket.socketpair()
    with client, server:
        thread, out = _serve(server)
        with pytest.raises(HandshakeError, match=r"refused this process: wrong job key \(TNT_RENDEZ") as err:
            SERVICE.client(client, "another-job's-key")
        thread.join(5)
        assert "does not know the job key" in str(out[0])
        assert err.value.refused and out[0].refused


def test_an_identity_that_is_not_admitted_is_told_so():
    client, server = socket.socketpair()
    with client, server:
        thread, out = _serve(server, admit=lambda rank: False)
        with pytest.raises(HandshakeError, match=r"refused identity 1 \(the key was right\)"):
            SERVICE.client(client, KEY, identity=1)
        thread.join(5)
        assert "identity 1 is not admitted" in str(out[0])


def test_another_service_or_version_is_named():
    client, server = socket.socketpair()
    with client, server:
        server.sendall(b"HTTP" + bytes([VERSION]) + bytes(32))
        with pytest.raises(HandshakeError, match=r"not a tnt test service \(it said b'HTTP'\)"):
            SERVICE.client(client, KEY, timeout=5)
    client, server = socket.socketpair()
    with client, server:
        server.sendall(SERVICE.tag + bytes([VERSION - 1]) + bytes(32))
        with pytest.raises(HandshakeError, match="install the same tnt-core version on every host"):
            SERVICE.client(client, KEY, timeout=5)


def test_a_peer_of_another_protocol_is_refused_at_once():
    client, server = socket.socketpair()
    with client, server:
        thread, out = _serve(server, timeout=30)
        client.recv(37, socket.MSG_WAITALL)
        start = time.monotonic()
        client.sendall(b"cmd=init pmi_version=1\n")
        thread.join(5)
        assert time.monotonic() - start < 5, "waited for the rest of an answer that never comes"
        assert "does not speak the test service's handshake" in str(out[0])


def test_a_silent_or_trickling_peer_costs_at_most_the_timeout():
    """The deadline is for the whole handshake, not per read: a byte now and then does not
    keep the server's thread."""
    client, server = socket.socketpair()
    with client, server:
        thread, out = _serve(server, timeout=0.5)
        client.recv(37, socket.MSG_WAITALL)
        start = time.monotonic()
        for byte in SERVICE.tag + bytes(40):  # 6.6 s in all, had each read its own limit
            if not thread.is_alive():
                break
            client.sendall(bytes([byte]))
            time.sleep(0.15)
        thread.join(5)
        assert time.monotonic() - start < 2
        assert "no complete answer within 0.5s" in str(out[0]) and not out[0].refused
    client, server = socket.socketpair()
    with client, server:
        start = time.monotonic()
        with pytest.raises(HandshakeError, match=r"no complete answer within 0\.3s"):
            SERVICE.client(client, KEY, timeout=0.3)
        assert time.monotonic() - start < 2


def test_the_digest_binds_key_nonce_identity_and_service():
    nonce = bytes(range(32))
    base = SERVICE.digest(KEY, nonce, 0)
    assert base == SERVICE.digest(KEY.encode(), nonce, 0)
    assert len({base, SERVICE.digest("other", nonce, 0), SERVICE.digest(KEY, bytes(32), 0),
                SERVICE.digest(KEY, nonce, 1), Handshake(b"ELSE", "x").digest(KEY, nonce, 0)}) == 5
    with pytest.raises(ValueError, match="empty"):
        SERVICE.digest("", nonce, 0)
