import logging
import socket
import threading
import time

import pytest

from tnt_core import CommError, Config, StoreClient, StoreServer, connect_store


@pytest.fixture
def server():
    with StoreServer("127.0.0.1", 0, key="secret") as s:
        yield s


def client(server, **kw):
    host, port = server.address
    return StoreClient(host, port, server.key, connect_timeout=5, **kw)


def test_set_get_check_add_delete(server):
    with client(server) as c:
        c.set("a", b"1")
        assert c.get("a") == b"1"
        assert c.check(["a"]) and not c.check(["a", "b"])
        assert c.add("n", 2) == 2 and c.add("n", 3) == 5 and c.get("n") == b"5"
        assert c.delete("a") and not c.delete("a")
        c.set("empty", b"")
        assert c.get("empty") == b""


def test_large_values_round_trip(server):
    blob = bytes(range(256)) * (32 * 1024)  # 8 MiB
    with client(server) as a, client(server) as b:
        a.set("blob", blob)
        assert b.get("blob") == blob


def test_get_waits_for_a_key_set_by_another_client(server):
    with client(server) as a, client(server) as b:
        threading.Timer(0.3, lambda: b.set("late", b"x")).start()
        t0 = time.monotonic()
        assert a.get("late", timeout=10) == b"x"
        assert 0.2 < time.monotonic() - t0 < 5


def test_wait_times_out_with_comm_error_naming_missing_keys(server):
    with client(server, rank=3) as c:
        c.set("here", b"1")
        t0 = time.monotonic()
        with pytest.raises(CommError) as err:
            c.wait(["here", "missing"], timeout=0.3)
        assert time.monotonic() - t0 < 5
        assert "missing" in str(err.value) and "rank 3" in str(err.value)
        with pytest.raises(CommError, match="not set within the timeout"):
            c.get("never", timeout=0.2)
        assert c.get("here") == b"1", "the connection stays usable after a timeout"


def test_wrong_key_is_refused_and_logged(server, caplog):
    host, port = server.address
    with caplog.at_level(logging.WARNING, logger="tnt.rendezvous"):
        with pytest.raises(CommError, match="wrong job key"):
            StoreClient(host, port, "not-the-key", connect_timeout=5)
        deadline = time.monotonic() + 5
        while "refused rendezvous peer" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "refused rendezvous peer 127.0.0.1" in caplog.text
    with client(server) as c:  # the server keeps serving the right peers
        c.set("k", b"v")


def test_peer_that_skips_the_handshake_gets_nothing(server):
    host, port = server.address
    with socket.create_connection((host, port), timeout=5) as raw:
        raw.recv(37)
        raw.sendall(bytes([1]) + b"\x00" * 40)  # a SET request instead of the digest
        assert raw.recv(1) == bytes([1]), "refusal byte expected"
    with client(server) as c:
        assert not c.check(["\x00" * 4])


def test_unreachable_store_fails_within_the_connect_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        t0 = time.monotonic()
        with pytest.raises(CommError, match="cannot reach the rendezvous store"):
            StoreClient("127.0.0.1", port, "k", connect_timeout=0.5)
        assert time.monotonic() - t0 < 5


def test_many_waiters_wake_together(server):
    got = []
    clients = [client(server) for _ in range(8)]
    threads = [threading.Thread(target=lambda c=c: got.append(c.get("go", timeout=10))) for c in clients]
    for t in threads:
        t.start()
    time.sleep(0.2)
    with client(server) as c:
        c.set("go", b"now")
    for t in threads:
        t.join(10)
    assert got == [b"now"] * 8
    for c in clients:
        c.close()


def test_connect_store_from_config(server):
    cfg = Config(rank=0, size=2, rendezvous=server.url, rendezvous_key=server.key, timeout_s=5)
    with connect_store(cfg) as c:
        c.set("x", b"1")
        assert c.timeout == 5


def test_port_in_use_gives_a_clear_error():
    from tnt_core import ConfigError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot host the rendezvous store on 127.0.0.1:{port}"):
            StoreServer("127.0.0.1", port, key="k")


def test_address_towards_asks_the_kernel_for_the_route():
    from tnt_core import address_towards

    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("no-such-host.invalid") is None


def test_reachable_address_name_then_route_then_a_clear_error(monkeypatch):
    """One answer for every backend: loopback for a loopback store, else the host name if
    other nodes can reach it, else the route to the store host."""
    import tnt_core._rendezvous as rdv
    from tnt_core import ConfigError, is_loopback, reachable_address

    assert is_loopback("127.0.1.1") and is_loopback("::1") and not is_loopback("10.0.0.1")
    assert reachable_address("127.0.0.1") == "127.0.0.1"
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("10.1.2.3", 0))])
    assert reachable_address("10.9.8.7") == socket.gethostname()
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("127.0.1.1", 0))])
    monkeypatch.setattr(rdv, "address_towards", lambda host: "10.9.8.20")
    assert reachable_address("10.9.8.7") == "10.9.8.20"
    monkeypatch.setattr(rdv, "address_towards", lambda host: "127.0.0.1")
    with pytest.raises(ConfigError, match=r"loopback address.*10\.9\.8\.7.*; set X"):
        reachable_address("10.9.8.7", hint="set X")
    with pytest.raises(ConfigError, match=r"rendezvous host \(none\)"):
        reachable_address(None)


def test_two_hundred_ranks_connect_at_once_without_kernel_retries():
    """Every rank connects at start-up at the same moment. With socketserver's backlog of
    5 the kernel dropped the rest and their SYN retries (1 s, 3 s, ...) made 200
    connections take ~30 s; with the system's maximum backlog they take well under one."""
    import concurrent.futures
    import time

    with StoreServer("127.0.0.1", 0) as server:
        host, port = server.address
        barrier = threading.Barrier(200)

        def connect(i: int) -> None:
            barrier.wait(10)
            client = StoreClient(host, port, server.key, connect_timeout=30, timeout=30)
            try:
                client.set(f"rank/{i}", b"x")
            finally:
                client.close()

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(200) as pool:
            list(pool.map(connect, range(200)))
        took = time.monotonic() - start
    assert took < 5.0, f"200 simultaneous connections took {took:.1f}s (kernel SYN retries?)"
