"""tnt's PMI-1 server (tnt run mode) spoken to by a scripted client; no MPI needed."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tnt_comm_mpi.pmi_server import PMI_HANDSHAKE, PmiServer, connect_authenticated, process_mapping

KEY = "0123456789abcdef"
#: the handshake's refusal status bytes, as the wire has them (tnt_core.Handshake)
WRONG_KEY, NOT_ADMITTED = 1, 2


@pytest.mark.parametrize(("hosts", "expected"), [
    (["a"] * 4, "(vector,(0,1,4))"),
    (["a", "a", "b", "b"], "(vector,(0,2,2))"),
    (["a", "a", "a", "b"], "(vector,(0,1,3),(1,1,1))"),
    (["a", "b", "a", "b"], "(vector,(0,1,1),(1,1,1),(0,1,1),(1,1,1))"),
])
def test_process_mapping(hosts, expected) -> None:
    assert process_mapping(hosts) == expected


class Client:
    """A PMI client as MPICH's is after ``connect_authenticated`` handed it the socket."""

    def __init__(self, port: int, rank: int | None = None, key: str = KEY) -> None:
        if rank is None:  # an outsider: talks PMI without the handshake
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        else:
            self.sock = connect_authenticated("127.0.0.1", port, key, rank, timeout=10)
            self.sock.settimeout(10)
        self.lines = self.sock.makefile("r", encoding="ascii")

    def send(self, line: str) -> None:
        self.sock.sendall((line + "\n").encode())

    def ask(self, line: str) -> dict[str, str]:
        self.send(line)
        return self.read()

    def read(self) -> dict[str, str]:
        return dict(w.split("=", 1) for w in self.lines.readline().split())

    def close(self) -> None:
        """What the end of the rank's process does to its connection."""
        self.lines.close()
        self.sock.close()


def test_a_two_rank_start_up_conversation() -> None:
    server = PmiServer(2, ["n0", "n0"], kvsname="job-1", key=KEY)
    try:
        clients = [Client(server.port, rank) for rank in range(2)]
        for rank, c in enumerate(clients):
            assert c.ask("cmd=init pmi_version=1 pmi_subversion=1")["rc"] == "0"
            assert c.ask("cmd=get_maxes")["vallen_max"] == "1024"
            assert c.ask("cmd=get_my_kvsname")["kvsname"] == "job-1"
            assert c.ask("cmd=get_appnum")["appnum"] == "0"
            assert c.ask(f"cmd=put kvsname=job-1 key=card-{rank} value=addr{rank}")["rc"] == "0"
        # the barrier answers nobody before everyone arrived
        clients[0].send("cmd=barrier_in")
        answered = threading.Event()
        threading.Thread(target=lambda: (clients[0].read(), answered.set()), daemon=True).start()
        assert not answered.wait(0.3), "barrier_out before rank 1 entered the barrier"
        clients[1].send("cmd=barrier_in")
        assert clients[1].read() == {"cmd": "barrier_out"}
        assert answered.wait(5)
        got = clients[0].ask("cmd=get kvsname=job-1 key=card-1")
        assert (got["rc"], got["value"]) == ("0", "addr1")
        assert clients[1].ask("cmd=get kvsname=job-1 key=PMI_process_mapping")["value"] == "(vector,(0,1,2))"
        assert clients[1].ask("cmd=get kvsname=job-1 key=missing")["rc"] == "-1"
        assert clients[0].ask("cmd=spawn nprocs=1")["rc"] == "-1", "unsupported commands must fail"
        assert not server.wait_finalized(0.1)
        for c in clients:
            assert c.ask("cmd=finalize") == {"cmd": "finalize_ack"}
        assert server.wait_finalized(5)
    finally:
        server.close()


def test_rejects_bad_names_and_keys() -> None:
    with pytest.raises(ValueError, match="job name"):
        PmiServer(1, ["a"], kvsname="has space", key=KEY)
    with pytest.raises(ValueError, match="host names"):
        PmiServer(2, ["a"], key=KEY)
    with pytest.raises(ValueError, match="job key"):
        PmiServer(1, ["a"], key="")


HELLO = 4 + 1 + 32  # the handshake's tag, version and nonce


def _rest(sock: socket.socket) -> bytes:
    """What the server sends until it hangs up."""
    data = b""
    try:
        while chunk := sock.recv(64):
            data += chunk
    except ConnectionResetError:  # hung up with our bytes unread: refused all the same
        pass
    return data


def _answer(port: int, answer_for_nonce) -> bytes:
    """Connect as an attacker would, answer the challenge with ``answer_for_nonce(nonce)``
    and return what the server says until it hangs up."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        hello = sock.recv(HELLO, socket.MSG_WAITALL)
        assert hello[:4] == PMI_HANDSHAKE.tag
        sock.sendall(answer_for_nonce(hello[5:]))
        return _rest(sock)


def test_refuses_every_client_that_does_not_know_the_job_key() -> None:
    """What an attacker on the host tried against the unauthenticated server: fake PMI
    commands (a ``finalize`` for a rank made a correct job exit with SIGSEGV). Now no word
    of PMI is served before the handshake, and the real ranks still get through."""
    server = PmiServer(2, ["n0", "n0"], kvsname="job-1", key=KEY)
    try:
        # PMI spoken straight away, as MPICH's own client (PMI_PORT) or a script would
        outsider = Client(server.port)
        assert outsider.sock.recv(HELLO, socket.MSG_WAITALL)[:4] == PMI_HANDSHAKE.tag
        outsider.send("cmd=finalize")
        assert _rest(outsider.sock) == bytes([WRONG_KEY]), \
            "a PMI word before the handshake must end the connection"
        # the wrong key; a right digest for another nonce (replay); a rank outside the job
        tag = PMI_HANDSHAKE.tag
        for rank, digest, refusal in [
                (0, lambda n: PMI_HANDSHAKE.digest(b"guess", n, 0), WRONG_KEY),
                (0, lambda n: PMI_HANDSHAKE.digest(KEY, b"x" * 32, 0), WRONG_KEY),
                (7, lambda n: PMI_HANDSHAKE.digest(KEY, n, 7), NOT_ADMITTED)]:
            answer = lambda n, r=rank, d=digest: tag + r.to_bytes(8, "big") + d(n)  # noqa: E731
            assert _answer(server.port, answer) == bytes([refusal])
        assert _answer(server.port, lambda n: b"x" * 400) == bytes([WRONG_KEY])
        with pytest.raises(ConnectionError, match="refused"):
            connect_authenticated("127.0.0.1", server.port, "wrong-key", 0, timeout=10)
        # a client that connects and says nothing does not hold up the ranks
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        ranks = [Client(server.port, rank) for rank in range(2)]
        # a rank may join once: a second connection claiming rank 1 (even with the key) is refused
        with pytest.raises(ConnectionError, match="refused"):
            connect_authenticated("127.0.0.1", server.port, KEY, 1, timeout=10)
        for c in ranks:
            assert c.ask("cmd=init pmi_version=1 pmi_subversion=1")["rc"] == "0"
        for c in ranks:
            assert c.ask("cmd=finalize") == {"cmd": "finalize_ack"}
        assert server.wait_finalized(5)
        assert server.refused == 7
        silent.close()
    finally:
        server.close()


def test_a_silent_client_is_dropped_after_the_handshake_timeout(monkeypatch) -> None:
    import tnt_comm_mpi.pmi_server as pmi

    monkeypatch.setattr(pmi, "AUTH_TIMEOUT_S", 0.3)
    server = PmiServer(1, ["n0"], key=KEY)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            assert sock.recv(HELLO, socket.MSG_WAITALL)[:4] == PMI_HANDSHAKE.tag
            start = time.monotonic()
            assert _rest(sock) == b""
            assert time.monotonic() - start < 5
        assert server.refused == 1
    finally:
        server.close()


def _helper(size: int):
    from tnt_comm_mpi.pmi_server import start_helper

    proc, port = start_helper(size, ["n0"] * size, "127.0.0.1", 30, key=KEY)
    clients = [Client(port, rank) for rank in range(size)]
    for c in clients:
        assert c.ask("cmd=init pmi_version=1 pmi_subversion=1")["rc"] == "0"
    return proc, clients


def _rank_0_exits(proc) -> None:
    """What the helper sees when rank 0's process ends: its stdin reaches end of file."""
    proc.stdin.close()


def test_the_helper_ends_with_the_job_when_ranks_die_without_finalize() -> None:
    """A rank killed (or raising, or SIGTERMed by tnt run) leaves without PMI ``finalize``;
    once rank 0 is gone too, the helper must not outlive the job (it waited 30 s more)."""
    proc, (rank0, rank1) = _helper(2)
    try:
        rank1.close()  # died
        time.sleep(0.3)
        assert proc.poll() is None, "the helper must serve rank 0 while it lives"
        _rank_0_exits(proc)
        rank0.close()
        proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.wait()


def test_the_helper_serves_a_late_finalize_after_rank_0_left() -> None:
    """The normal end: rank 0 finalised and exited; rank 1, still working, is served for as
    long as its connection is open (also past the old 30 s limit), then the helper ends."""
    proc, (rank0, rank1) = _helper(2)
    try:
        assert rank0.ask("cmd=finalize") == {"cmd": "finalize_ack"}
        rank0.close()
        _rank_0_exits(proc)
        time.sleep(1.0)
        assert proc.poll() is None, "the helper left while rank 1 still needs it"
        assert rank1.ask("cmd=get kvsname=x key=PMI_process_mapping")["rc"] == "0"
        assert rank1.ask("cmd=finalize") == {"cmd": "finalize_ack"}
        proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.wait()


def test_the_helper_ends_when_rank_0_leaves_before_every_rank_joined() -> None:
    from tnt_comm_mpi.pmi_server import start_helper

    proc, port = start_helper(2, ["n0", "n0"], "127.0.0.1", 30, key=KEY)
    try:
        rank0 = Client(port, 0)
        _rank_0_exits(proc)
        rank0.close()
        proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.wait()
