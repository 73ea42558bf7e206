"""An emulated cluster on one Linux machine, for tests and benchmarks that need several hosts.

Every host is a network namespace with one link, ``tnteth0``, to a bridge in a "switch"
namespace of its own, so the root namespace's interfaces, addresses and routes are never
touched. Each link can be rate-limited in both directions (``tc tbf`` on both ends of the
veth pair: a full-duplex port of a switched network). Addresses come from 198.18.0.0/15,
the range reserved for benchmarking (RFC 2544).

A host is a host to the software running on it, not just an address:

* its own sshd, with keys made for the cluster; ``ssh -F <ssh_config>`` reaches every host
  without a prompt, so ``tnt run --launcher ssh --ssh-args "-F <ssh_config>"`` and MPICH's
  Hydra start ranks the way they do on a real cluster;
* its own host name (a UTS namespace) and its own ``/etc/hosts`` naming every host of the
  cluster (a bind mount inside the host's mount namespace). Namespaces share one kernel and
  so one boot id; the host name is what tells two hosts apart to libraries that key "same
  host" on host name + boot id (tnt-comm-gloo's shared-memory allreduce, MPICH's node map);
* commands run "on" a host (:meth:`EmulatedCluster.argv`) enter the sshd's network, UTS and
  mount namespaces, so they see exactly what a rank started over ssh sees.

UCX (MPICH's transport) decides what is local by the boot id and would move data between
namespaces through shared memory, past the link; :data:`RANK_ENV` (``UCX_TLS=tcp,self``)
keeps it on TCP, and :meth:`EmulatedCluster.tnt_run_argv` passes it to every rank.

Clean-up: the cluster is a context manager and also registers itself with :mod:`atexit`;
closing kills every process in its namespaces (sshds, ranks, anything entered with
:meth:`~EmulatedCluster.argv`) and deletes the namespaces, which takes the links and the
bridge with them. A run that was killed outright leaves namespaces named
``tntc-<pid>-...``; the next cluster started on the machine removes those whose process is
gone.

Needs root, iproute2 (``ip netns``; ``tc`` for rate limits), util-linux's ``nsenter`` and
``unshare``, and OpenSSH (``sshd``, ``ssh``, ``ssh-keygen``). :func:`cluster_unavailable`
says which is missing, for ``pytest.skip``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["IFACE", "RANK_ENV", "ClusterHost", "ClusterUnavailable", "EmulatedCluster",
           "cluster_unavailable", "remove_leftover_clusters"]

#: every namespace and work directory of an emulated cluster starts with this
PREFIX = "tntc-"
#: the name of every host's link (cluster nodes share interface names): ``TNT_GLOO_IFACE``
IFACE = "tnteth0"
#: what every rank needs on the emulated cluster: UCX over TCP only (see the module docstring)
RANK_ENV: Mapping[str, str] = {"UCX_TLS": "tcp,self"}
_SSHD_READY_S = 20.0
_COMMAND_TIMEOUT_S = 30.0


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster; ``str(exc)`` says why (a skip reason)."""


@dataclass(frozen=True)
class ClusterHost:
    """One emulated host."""

    index: int
    #: its host name (UTS namespace), listed in every host's /etc/hosts
    name: str
    #: its address on the cluster's network (198.18.0.0/15)
    address: str
    #: its network namespace (``ip netns``)
    netns: str
    #: the switch-side end of its link, in the switch namespace
    port: str


def _sshd() -> str | None:
    return shutil.which("sshd") or next(
        (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)), None)


def cluster_unavailable(rate_limited: bool = True) -> str | None:
    """Why no emulated cluster can start here (a reason for ``pytest.skip``), or None.

    Checks privileges and tools only; the kernel may still refuse a namespace or a qdisc,
    which :meth:`EmulatedCluster.start` reports as :class:`ClusterUnavailable`."""
    if not sys.platform.startswith("linux"):
        return "an emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "an emulated cluster needs root (network namespaces, sshd)"
    tools = ["ip", "nsenter", "unshare", "ssh", "ssh-keygen"] + (["tc"] if rate_limited else [])
    for tool in tools:
        if shutil.which(tool) is None:
            return f"an emulated cluster needs {tool!r}, which is not installed"
    if _sshd() is None:
        return "an emulated cluster needs sshd (openssh-server), which is not installed"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S,
                         stdin=subprocess.DEVNULL)
    if check and res.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed: {res.stderr.strip() or res.returncode}")
    return res


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL every process in ``netns`` until none is left (a dying parent may fork)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = [int(p) for p in _run(["ip", "netns", "pids", netns], check=False).stdout.split()
                if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete_namespace(netns: str) -> None:
    _kill_namespace_processes(netns)
    _run(["ip", "netns", "del", netns], check=False)


def _owner_pid(name: str) -> int | None:
    """The pid in ``tntc-<pid>-...``, or None for another name."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def remove_leftover_clusters() -> list[str]:
    """Delete the namespaces and work directories of clusters whose process is gone (a run
    killed before it could clean up); return the namespaces deleted."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.splitlines()
    removed = []
    for line in listed:
        name = line.split(" ", 1)[0]
        pid = _owner_pid(name)
        if pid is not None and not _pid_alive(pid):
            _delete_namespace(name)
            removed.append(name)
    tmp = Path(tempfile.gettempdir())
    for path in tmp.glob(f"{PREFIX}*"):
        pid = _owner_pid(path.name)
        if path.is_dir() and pid is not None and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
    return removed


class EmulatedCluster:
    """``hosts`` emulated hosts on one switch, each link limited to ``rate_mbit`` Mbit/s in
    each direction (None: as fast as the machine goes). Host ``i`` is ``node<i>`` at
    ``198.18.<subnet>.<i+1>`` (subnets past 255 continue in 198.19). Keys, configs and logs go
    to ``workdir``, by default a temporary directory removed on close.

    Use it as a context manager (or call :meth:`start` and :meth:`close`)::

        with EmulatedCluster(2, rate_mbit=400) as cluster:
            subprocess.run(cluster.tnt_run_argv("--", "train.py"), check=True)
    """

    _serial = 0

    def __init__(self, hosts: int = 2, rate_mbit: float | None = None, *, subnet: int = 0,
                 workdir: str | os.PathLike[str] | None = None) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts={hosts}: give 1 to 250 hosts")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit={rate_mbit}: give a positive rate, or None for no limit")
        if not 0 <= subnet <= 511:
            raise ValueError(f"subnet={subnet}: 198.18.0.0/15 holds the /24 subnets 0 to 511")
        EmulatedCluster._serial += 1
        self.tag = f"{PREFIX}{os.getpid()}-{EmulatedCluster._serial}"
        self.rate_mbit = rate_mbit
        net = f"198.{18 + subnet // 256}.{subnet % 256}"
        self.hosts = [ClusterHost(i, f"node{i}", f"{net}.{i + 1}", f"{self.tag}-h{i}", f"port{i}")
                      for i in range(hosts)]
        self.switch = f"{self.tag}-sw"
        self._own_workdir = workdir is None
        self._workdir_arg = workdir
        self.workdir = Path()
        self._sshds: dict[int, subprocess.Popen[bytes]] = {}
        self._namespaces: list[str] = []
        self._started = False

    # -- life cycle ---------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        """Create the switch, the hosts, their links and sshds.

        :raises ClusterUnavailable: when the machine cannot (a skip reason).
        """
        reason = cluster_unavailable(self.rate_mbit is not None)
        if reason:
            raise ClusterUnavailable(reason)
        if self._started:
            raise RuntimeError("the cluster is already started")
        remove_leftover_clusters()
        self._started = True
        atexit.register(self.close)
        try:
            if self._own_workdir:
                self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
            else:
                self.workdir = Path(self._workdir_arg or ".").resolve()
                self.workdir.mkdir(parents=True, exist_ok=True)
            self._network()
            self._ssh_files()
            for host in self.hosts:
                self._start_sshd(host)
            for host in self.hosts:
                self._wait_sshd(host)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill every process on the cluster and delete its namespaces. Idempotent."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.close)
        for proc in self._sshds.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for netns in reversed(self._namespaces):
            _delete_namespace(netns)
        for proc in self._sshds.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._namespaces.clear()
        self._sshds.clear()
        if self._own_workdir and self.workdir != Path():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _add_namespace(self, netns: str) -> None:
        res = _run(["ip", "netns", "add", netns], check=False)
        if res.returncode != 0:
            raise ClusterUnavailable(f"ip netns add failed: {res.stderr.strip()}")
        self._namespaces.append(netns)

    def _network(self) -> None:
        self._add_namespace(self.switch)
        sw = ["ip", "-n", self.switch]
        res = _run([*sw, "link", "add", "br0", "type", "bridge"], check=False)
        if res.returncode != 0:
            raise ClusterUnavailable(f"cannot create a bridge: {res.stderr.strip()}")
        _run([*sw, "link", "set", "br0", "up"])
        for host in self.hosts:
            self._add_namespace(host.netns)
            # both ends are made inside their namespaces: nothing appears in the root one
            _run(["ip", "link", "add", IFACE, "netns", host.netns, "type", "veth",
                  "peer", "name", host.port, "netns", self.switch])
            _run([*sw, "link", "set", host.port, "master", "br0"])
            _run([*sw, "link", "set", host.port, "up"])
            on_host = ["ip", "-n", host.netns]
            _run([*on_host, "addr", "add", f"{host.address}/24", "dev", IFACE])
            _run([*on_host, "link", "set", IFACE, "up"])
            _run([*on_host, "link", "set", "lo", "up"])
            if self.rate_mbit is not None:
                self._limit(host.netns, IFACE, self.rate_mbit)  # what the host sends
                self._limit(self.switch, host.port, self.rate_mbit)  # what it receives

    def _limit(self, netns: str, dev: str, rate_mbit: float) -> None:
        # the bucket holds at least a few ms at the rate (and a 64 KiB GSO packet), so that
        # timer granularity does not cap the rate; 50 ms of queue before drops
        burst = max(64 << 10, int(rate_mbit * 1e6 / 8 * 0.004))
        res = _run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", f"{round(rate_mbit * 1000)}kbit", "burst", str(burst),
                    "latency", "50ms"], check=False)
        if res.returncode != 0:
            raise ClusterUnavailable(f"cannot rate-limit a link with tc tbf: {res.stderr.strip()}")

    def _ssh_files(self) -> None:
        w = self.workdir
        for key in ("host_key", "user_key"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.tag, "-f", str(w / key)])
        shutil.copy(w / "user_key.pub", w / "authorized_keys")
        host_pub = " ".join((w / "host_key.pub").read_text().split()[:2])
        names = ",".join(n for h in self.hosts for n in (h.address, h.name))
        (w / "known_hosts").write_text(f"{names} {host_pub}\n")
        patterns = " ".join(n for h in self.hosts for n in (h.address, h.name))
        self.ssh_config.write_text(
            f"Host {patterns}\n  User root\n  IdentityFile {w / 'user_key'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {w / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
            "  LogLevel ERROR\n")
        (w / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in self.hosts))
        self.write_hostfile(self.hostfile)

    def _start_sshd(self, host: ClusterHost) -> None:
        w = self.workdir
        conf = w / f"sshd_{host.name}.conf"
        conf.write_text(
            f"ListenAddress {host.address}:22\nHostKey {w / 'host_key'}\n"
            f"PidFile {w / f'sshd_{host.name}.pid'}\nAuthorizedKeysFile {w / 'authorized_keys'}\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nPrintMotd no\n"
            "MaxStartups 200\nMaxSessions 200\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        # ip netns exec gives a private mount namespace (the /etc/hosts bind mount stays in
        # it); unshare --uts a host name of its own; each step execs the next, so the pid is
        # sshd's, and its namespaces are the host's
        setup = ('mount --bind "$1" /etc/hosts && echo "$2" > /proc/sys/kernel/hostname'
                 ' && shift 2 && exec "$@"')
        sshd = _sshd() or "sshd"
        with open(w / f"sshd_{host.name}.log", "wb") as log:
            self._sshds[host.index] = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--", "sh", "-c", setup, "sh",
                 str(w / "hosts"), host.name, sshd, "-D", "-e", "-f", str(conf)],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def _wait_sshd(self, host: ClusterHost) -> None:
        log = self.workdir / f"sshd_{host.name}.log"
        proc = self._sshds[host.index]
        deadline = time.monotonic() + _SSHD_READY_S
        while b"Server listening" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host.name} ({host.netns}) did not start: "
                                   f"{log.read_text(errors='replace').strip()}")
            time.sleep(0.05)

    # -- using it -----------------------------------------------------------------------

    @property
    def ssh_config(self) -> Path:
        """For ``ssh -F``: every host by address or name, as root, with the cluster's keys."""
        return self.workdir / "ssh_config"

    @property
    def hostfile(self) -> Path:
        """A hostfile listing every host's address, one a line."""
        return self.workdir / "hostfile"

    def host(self, which: int | str | ClusterHost) -> ClusterHost:
        """A host by index, name or address."""
        if isinstance(which, ClusterHost):
            return which
        for host in self.hosts:
            if which in (host.index, host.name, host.address):
                return host
        raise KeyError(f"no host {which!r} in the cluster")

    def write_hostfile(self, path: str | os.PathLike[str], hosts: Sequence[int | str] | None = None,
                       slots: int | None = None) -> Path:
        """Write a hostfile of ``hosts`` (default all) by address, ``slots=K`` when given."""
        chosen = [self.host(h) for h in hosts] if hosts is not None else self.hosts
        suffix = f" slots={slots}" if slots else ""
        Path(path).write_text("".join(f"{h.address}{suffix}\n" for h in chosen))
        return Path(path)

    def sshd_pid(self, host: int | str | ClusterHost) -> int:
        """The pid of a host's sshd (its ssh sessions are children of it)."""
        return self._sshds[self.host(host).index].pid

    def argv(self, host: int | str | ClusterHost, command: Sequence[str],
             cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """``command`` run on ``host``: in its network, UTS and mount namespaces, in ``cwd``
        (default: the current directory). Signals reach ``command`` itself (nsenter execs)."""
        wd = os.fspath(Path(cwd if cwd is not None else os.getcwd()).resolve())
        return ["nsenter", f"--target={self.sshd_pid(host)}", "--net", "--uts", "--mount",
                f"--wd={wd}", "--", *command]

    def run(self, host: int | str | ClusterHost, command: Sequence[str],
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """:func:`subprocess.run` of ``command`` on ``host`` (keyword arguments as for it)."""
        return subprocess.run(self.argv(host, command, kwargs.get("cwd")), **kwargs)

    def tnt_run_argv(self, *args: str, host: int | str | ClusterHost = 0,
                     hostfile: str | os.PathLike[str] | None = None,
                     env: Mapping[str, str] = RANK_ENV, cwd: str | os.PathLike[str] | None = None
                     ) -> list[str]:
        """``tnt run --hostfile ... --launcher ssh`` started on ``host`` (the first by default),
        reaching the others over ssh with the cluster's keys; ``env`` goes to every rank
        (``-x``); ``args`` follow (options, then ``--`` and the script)."""
        script = Path(sys.executable).parent / "tnt"
        tnt = [str(script)] if script.exists() else [sys.executable, "-m", "tnt_cli"]
        xs = [f"{k}={v}" for k, v in env.items()]
        return self.argv(host, [*tnt, "run", "--hostfile", os.fspath(hostfile or self.hostfile),
                                "--launcher", "ssh", "--ssh-args", f"-F {self.ssh_config}",
                                *(["-x", *xs] if xs else []), *args], cwd)

    def set_link(self, host: int | str | ClusterHost, up: bool) -> None:
        """Take ``host``'s link down (as if its cable were pulled: the host keeps its address,
        its packets go nowhere) or bring it back up."""
        _run(["ip", "-n", self.switch, "link", "set", self.host(host).port,
              "up" if up else "down"])
