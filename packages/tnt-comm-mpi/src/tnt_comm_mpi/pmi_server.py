"""A small PMI-1 process-manager server, so ranks started by ``tnt run`` form one MPI job.

An MPI library learns who it is and exchanges its network addresses ("business cards")
through a process manager; ``mpiexec`` (Hydra) is one. Ranks that ``tnt run`` started
have none, so rank 0 starts this server as a helper process (:func:`start_helper`),
publishes its address in tnt's rendezvous store, and every rank connects to it and
initialises MPI with ``PMI_FD`` set to that connection: MPICH's PMI client then talks to
this server instead of Hydra. A separate process, not a thread of rank 0: mpi4py holds the GIL while
``MPI_Init`` waits for the PMI barrier, so a thread of rank 0 could never answer.

The helper exits once every rank sent ``finalize``. Rank 0 may go away first (its end of
the helper's stdin closes): after a normal end it finalised and its launcher killed its
process group, while the other ranks may still need the server for their own
``MPI_Finalize``, however late that comes. So from then on the helper serves the ranks
whose connection is still open, and exits as soon as none is left: every rank finalised,
or died (the kernel closes a dead rank's connection, even after SIGKILL), or never
joined (then rank 0 cannot have passed ``MPI_Init``: the job failed). A failed job thus
leaves no helper behind once its ranks are gone, however its ranks and ``tnt run`` ended.

Only the job's ranks may talk to it: the server listens on TCP, where any process of the
host (or, across hosts, of the network) can connect, and a client that could ``put``,
``barrier_in`` or ``finalize`` for a rank corrupts or ends the job. So every connection
first passes tnt-core's handshake (:class:`tnt_core.Handshake`, the one the rendezvous
store uses, here with the tag ``b"TNTP"``): it proves it knows the job key
(``TNT_RENDEZVOUS_KEY``) and which rank it is, before a single PMI word is served; each
rank may connect once. MPICH's own PMI client cannot do this, so the rank does it in
Python (:func:`connect_authenticated`) and hands the connected socket to MPI through
``PMI_FD``, the way Hydra's proxies hand over theirs. The handshake reads exactly its own
bytes, so nothing of the PMI conversation that follows is consumed.

The wire protocol is PMI version 1 (MPICH's "simple PMI"): newline-terminated lines of
``key=value`` words, the first word ``cmd=NAME``. Implemented: ``init``, ``get_maxes``,
``get_appnum``, ``get_my_kvsname``,
``get_universe_size``, ``put``, ``get`` (with ``PMI_process_mapping`` for node-local
ranks), ``barrier_in``, ``finalize`` and ``abort``. Not implemented: dynamic processes
(spawn, publish/lookup names) -- the answer says so.

It speaks to MPICH-derived libraries (MPICH, Intel MPI, MVAPICH); Open MPI uses PMIx and
needs its own launcher.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, cast

from tnt_core import HANDSHAKE_TIMEOUT_S, Handshake, HandshakeError

__all__ = ["PmiServer", "process_mapping", "start_helper", "connect_authenticated",
           "AUTH_TIMEOUT_S", "PMI_HANDSHAKE"]

log = logging.getLogger("tnt.mpi.pmi")

MAX_KEY, MAX_VALUE = 64, 1024
#: how long a new connection has to prove it knows the job key
AUTH_TIMEOUT_S = HANDSHAKE_TIMEOUT_S
#: the handshake every connection passes before PMI is spoken; identity: the rank
PMI_HANDSHAKE = Handshake(b"TNTP", "PMI server")


def connect_authenticated(host: str, port: int, key: str, rank: int, timeout: float) -> socket.socket:
    """Connect to the job's PMI server and pass its handshake as ``rank``; the socket is
    then ready for PMI (blocking, no timeout).

    :raises HandshakeError: (a ``ConnectionError``) the server refused the key or the
        rank, or went away.
    :raises OSError: the server cannot be reached within ``timeout``.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        PMI_HANDSHAKE.client(sock, key, identity=rank, timeout=timeout)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def process_mapping(hosts: Sequence[str]) -> str:
    """``PMI_process_mapping`` for ranks placed on ``hosts`` (one host name per rank).

    Each ``(node, 1, n)`` block says: the next ``n`` ranks live on node ``node``.
    """
    node_ids: dict[str, int] = {}
    blocks: list[list[int]] = []
    for host in hosts:
        node = node_ids.setdefault(host, len(node_ids))
        if blocks and blocks[-1][0] == node:
            blocks[-1][2] += 1
        else:
            blocks.append([node, 1, 1])
    if len(blocks) == len(node_ids) and len({b[2] for b in blocks}) == 1:
        blocks = [[0, len(blocks), blocks[0][2]]]  # regular: n ranks on each node, in order
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


def _parse(line: str) -> dict[str, str]:
    words = {}
    for word in line.strip().split(" "):
        key, sep, value = word.partition("=")
        if sep:
            words[key] = value
    return words


class PmiServer:
    """Serves one job of ``size`` ranks on ``host`` (port chosen by the system).

    :param hosts: the host name of every rank, in rank order (for the process mapping).
    :param kvsname: the job's name; MPICH derives shared-memory segment names from it, so
        it must differ between jobs that may run at the same time on one machine.
    :param key: the job key every client must prove it knows (see the module's doc).
    """

    def __init__(self, size: int, hosts: Sequence[str], host: str = "127.0.0.1",
                 kvsname: str = "tnt", *, key: str) -> None:
        if len(hosts) != size:
            raise ValueError(f"{len(hosts)} host names for {size} ranks")
        if not kvsname or any(c.isspace() or c == "=" for c in kvsname):
            raise ValueError(f"bad PMI job name {kvsname!r}")
        if not key:
            raise ValueError("the PMI server needs the job key")
        self.size = size
        self.kvsname = kvsname
        self._key = key.encode()
        self._connected: set[int] = set()
        #: connections refused for not knowing the key (for tests and the log)
        self.refused = 0
        self._kvs: dict[str, str] = {"PMI_process_mapping": process_mapping(hosts)}
        self._lock = threading.Condition()
        self._barrier_waiting: list[socket.socket] = []
        self._finalized: set[int] = set()
        #: ranks whose connection ended (finalised or not): none of them needs the server
        self._gone: set[int] = set()
        self._closing = False
        self._sock = socket.create_server((host, 0), backlog=max(size, 16), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="tnt-pmi-server", daemon=True)
        self._thread.start()

    # -- public -----------------------------------------------------------------------

    def wait_finalized(self, timeout: float) -> bool:
        """Wait until every rank sent ``finalize`` (so none still needs the server)."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._finalized) >= self.size, timeout)

    def wait_unneeded(self, timeout: float) -> bool:
        """Wait until no rank can need the server any more, once rank 0 has gone: every
        rank joined and left again (finalised or died), or some rank never joined (rank 0
        cannot have passed ``MPI_Init`` without it, so the job failed)."""
        def unneeded() -> bool:
            return len(self._connected) < self.size or len(self._gone) >= self.size

        with self._lock:
            return self._lock.wait_for(unneeded, timeout)

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.close()
        except OSError:
            pass

    # -- serving ----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="tnt-pmi-conn",
                             daemon=True).start()

    def _admit(self, rank: int) -> bool:
        """A rank of the job that has not joined yet (a second connection claiming a rank
        is a replay, or a rank that connects twice: either is wrong)."""
        with self._lock:
            if not 0 <= rank < self.size or rank in self._connected:
                return False
            self._connected.add(rank)
            return True

    def _authenticate(self, conn: socket.socket) -> int:
        """The rank this connection proved to be, or -1 (then it is closed unanswered)."""
        try:
            rank = PMI_HANDSHAKE.server(conn, self._key, timeout=AUTH_TIMEOUT_S, admit=self._admit)
        except HandshakeError as exc:
            with self._lock:
                self.refused += 1
            try:
                peer = conn.getpeername()
            except OSError:
                peer = "?"
            log.warning("refused a PMI client from %s: %s", peer, exc)
            return -1
        conn.settimeout(None)
        return rank

    def _serve(self, conn: socket.socket) -> None:
        rank = self._authenticate(conn)
        if rank < 0:
            conn.close()
            return
        reader = conn.makefile("r", encoding="ascii", newline="\n")
        try:
            for line in reader:
                msg = _parse(line)
                cmd = msg.get("cmd") or msg.get("mcmd", "")
                if cmd == "init":
                    self._send(conn, "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0")
                elif cmd == "get_maxes":
                    self._send(conn, f"cmd=maxes kvsname_max=256 keylen_max={MAX_KEY} "
                                     f"vallen_max={MAX_VALUE} rc=0")
                elif cmd == "get_appnum":
                    self._send(conn, "cmd=appnum appnum=0 rc=0")
                elif cmd == "get_my_kvsname":
                    self._send(conn, f"cmd=my_kvsname kvsname={self.kvsname} rc=0")
                elif cmd == "get_universe_size":
                    self._send(conn, f"cmd=universe_size size={self.size} rc=0")
                elif cmd == "put":
                    with self._lock:
                        self._kvs[msg.get("key", "")] = msg.get("value", "")
                    self._send(conn, "cmd=put_result rc=0 msg=success")
                elif cmd == "get":
                    with self._lock:
                        value = self._kvs.get(msg.get("key", ""))
                    if value is None:
                        self._send(conn, "cmd=get_result rc=-1 msg=key_not_found")
                    else:
                        self._send(conn, f"cmd=get_result rc=0 value={value}")
                elif cmd == "barrier_in":
                    self._barrier_in(conn)
                elif cmd == "finalize":
                    self._send(conn, "cmd=finalize_ack")
                    with self._lock:
                        self._finalized.add(rank)
                        self._lock.notify_all()
                    return
                elif cmd == "abort":
                    log.error("rank %d aborted MPI: %s", rank, line.strip())
                    return
                else:
                    log.error("rank %d sent an unsupported PMI command %r (tnt's PMI server "
                              "serves start-up only; run under mpiexec for dynamic processes)",
                              rank, line.strip())
                    self._send(conn, f"cmd={cmd or 'unknown'} rc=-1 msg=unsupported_by_tnt")
        except (OSError, ValueError) as exc:
            if not self._closing:
                log.debug("PMI connection of rank %d ended: %s", rank, exc)
        finally:
            with self._lock:
                if conn in self._barrier_waiting:
                    self._barrier_waiting.remove(conn)
                self._gone.add(rank)
                self._lock.notify_all()
            try:
                conn.close()
            except OSError:
                pass

    def _barrier_in(self, conn: socket.socket) -> None:
        with self._lock:
            self._barrier_waiting.append(conn)
            if len(self._barrier_waiting) < self.size:
                return
            waiting, self._barrier_waiting = self._barrier_waiting, []
        for peer in waiting:
            self._send(peer, "cmd=barrier_out")

    @staticmethod
    def _send(conn: socket.socket, *lines: str) -> None:
        conn.sendall("".join(line + "\n" for line in lines).encode("ascii"))


def start_helper(size: int, hosts: Sequence[str], bind: str, timeout: float, *,
                 key: str) -> tuple[subprocess.Popen, int]:
    """Start the PMI server process for a job; return it and its port.

    Its stdin stays open as long as the returned ``Popen`` (rank 0) lives. The job key goes
    through that pipe, not the command line, which every user of the host can read.
    """
    kvsname = f"tnt-{os.getpid()}-{secrets.token_hex(6)}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tnt_comm_mpi._pmi_helper", "--size", str(size), "--bind", bind,
         "--kvsname", kvsname],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("PMI_")},
        # a session of its own: launchers end a finished rank by killing its process
        # group, and the other ranks' MPI_Finalize may still need the server then
        start_new_session=True,
    )
    stdin, stdout = cast(IO[str], proc.stdin), cast(IO[str], proc.stdout)  # PIPEs above
    stdin.write(json.dumps({"hosts": list(hosts), "key": key}) + "\n")
    stdin.flush()
    ready = threading.Event()
    line: list[str] = []

    def read_port() -> None:
        line.append(stdout.readline())
        ready.set()

    threading.Thread(target=read_port, daemon=True).start()
    if not ready.wait(timeout) or not line[0].strip().isdigit():
        proc.kill()
        raise RuntimeError(f"the PMI helper did not start (said {line[:1]!r}, exit {proc.poll()})")
    return proc, int(line[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tnt's PMI-1 server for ranks started by tnt run")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--kvsname", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[tnt pmi] %(levelname)s %(message)s")
    job = json.loads(sys.stdin.readline())
    server = PmiServer(args.size, job["hosts"], host=args.bind, kvsname=args.kvsname,
                       key=job["key"])
    print(server.port, flush=True)
    parent_gone = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()  # returns at EOF: rank 0 exited (even by SIGKILL) or closed us
        parent_gone.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while not server.wait_finalized(0.2):
        # no time limit once rank 0 has gone: a live rank holds its connection open (the
        # job is not over), a dead one's is closed by the kernel (see the module's doc)
        if parent_gone.is_set() and server.wait_unneeded(0):
            break
    server.close()
    return 0

