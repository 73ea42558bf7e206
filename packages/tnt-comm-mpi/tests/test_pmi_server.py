"""tnt's PMI-1 server (tnt run mode) spoken to by a scripted client; no MPI needed."""

from __future__ import annotations

import socket
import threading

import pytest

from tnt_comm_mpi.pmi_server import PmiServer, process_mapping


@pytest.mark.parametrize(("hosts", "expected"), [
    (["a"] * 4, "(vector,(0,1,4))"),
    (["a", "a", "b", "b"], "(vector,(0,2,2))"),
    (["a", "a", "a", "b"], "(vector,(0,1,3),(1,1,1))"),
    (["a", "b", "a", "b"], "(vector,(0,1,1),(1,1,1),(0,1,1),(1,1,1))"),
])
def test_process_mapping(hosts, expected) -> None:
    assert process_mapping(hosts) == expected


class Client:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.lines = self.sock.makefile("r", encoding="ascii")

    def send(self, line: str) -> None:
        self.sock.sendall((line + "\n").encode())

    def ask(self, line: str) -> dict[str, str]:
        self.send(line)
        return self.read()

    def read(self) -> dict[str, str]:
        return dict(w.split("=", 1) for w in self.lines.readline().split())


def test_a_two_rank_start_up_conversation() -> None:
    server = PmiServer(2, ["n0", "n0"], kvsname="job-1")
    try:
        clients = [Client(server.port) for _ in range(2)]
        for rank, c in enumerate(clients):
            assert c.ask(f"cmd=initack pmiid={rank}") == {"cmd": "initack"}
            assert [c.read() for _ in range(3)] == [
                {"cmd": "set", "size": "2"}, {"cmd": "set", "rank": str(rank)},
                {"cmd": "set", "debug": "0"}]
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


def test_rejects_bad_names_and_ids() -> None:
    with pytest.raises(ValueError, match="job name"):
        PmiServer(1, ["a"], kvsname="has space")
    with pytest.raises(ValueError, match="host names"):
        PmiServer(2, ["a"])
    server = PmiServer(1, ["a"], kvsname="j")
    try:
        c = Client(server.port)
        c.send("cmd=initack pmiid=7")
        assert c.lines.readline() == "", "an id outside the job must be disconnected"
    finally:
        server.close()
