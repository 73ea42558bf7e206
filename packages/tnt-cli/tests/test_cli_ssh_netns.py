"""Two "hosts" without a cluster: two network namespaces joined by a veth pair, each with
its own address and its own sshd (keys made by the test). ``tnt run`` starts in the first
namespace; rank 0 runs there directly, rank 1 in the second namespace over ssh, and the
ranks do a real allreduce across the link.

The collective uses the Gloo backend when tnt-comm-gloo is installed, else tnt-core's
``store`` reference backend. Both namespaces name their end of the link ``tnteth0`` (as
cluster nodes share interface names), so ``TNT_GLOO_IFACE=tnteth0`` fits both hosts.

Needs root, iproute2 with ``ip netns`` and OpenSSH's sshd; skipped otherwise.
Namespaces, links and sshd processes are removed whatever happens.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(180)

ADDR_A, ADDR_B = "10.200.0.1", "10.200.0.2"
IFACE = "tnteth0"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
BACKEND = "gloo" if importlib.util.find_spec("tnt_comm_gloo") else "store"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _must(*args: str) -> None:
    res = _ip(*args)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")


def _preconditions() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.access(SSHD, os.X_OK):
        return "sshd (openssh-server) is not installed"
    return None


class TwoHosts:
    """The namespaces, their sshds, and the files tnt run needs to reach them."""

    def __init__(self, tmp: Path) -> None:
        tag = f"tntcli{os.getpid() % 100000}"
        self.tmp = tmp
        self.ns = (f"{tag}a", f"{tag}b")
        self.sshds: list[subprocess.Popen] = []
        self.hostfile = tmp / "hostfile"
        self.ssh_config = tmp / "ssh_config"

    def create(self) -> None:
        ns_a, ns_b = self.ns
        res = _ip("netns", "add", ns_a)
        if res.returncode != 0:
            pytest.skip(f"ip netns is not supported here: {res.stderr.strip()}")
        _must("netns", "add", ns_b)
        _must("link", "add", f"{ns_a}v", "type", "veth", "peer", "name", f"{ns_b}v")
        for ns, addr in ((ns_a, ADDR_A), (ns_b, ADDR_B)):
            _must("link", "set", f"{ns}v", "netns", ns)
            _must("-n", ns, "link", "set", f"{ns}v", "name", IFACE)
            _must("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            _must("-n", ns, "link", "set", IFACE, "up")
            _must("-n", ns, "link", "set", "lo", "up")
        self._keys_and_sshd()

    def _keys_and_sshd(self) -> None:
        t = self.tmp
        for key in ("host_key", "user_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(t / key)],
                           check=True, timeout=30, stdin=subprocess.DEVNULL)
        shutil.copy(t / "user_key.pub", t / "authorized_keys")
        host_pub = " ".join((t / "host_key.pub").read_text().split()[:2])
        (t / "known_hosts").write_text(f"{ADDR_A},{ADDR_B} {host_pub}\n")
        self.ssh_config.write_text(
            f"Host {ADDR_A} {ADDR_B}\n  User root\n  IdentityFile {t / 'user_key'}\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {t / 'known_hosts'}\n"
            "  StrictHostKeyChecking yes\n  LogLevel ERROR\n")
        self.hostfile.write_text(f"# two namespaces\n{ADDR_A}\n{ADDR_B}\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        for ns, addr in zip(self.ns, (ADDR_A, ADDR_B)):
            conf = t / f"sshd_{ns}.conf"
            conf.write_text(
                f"ListenAddress {addr}:22\nHostKey {t / 'host_key'}\nPidFile {t / f'sshd_{ns}.pid'}\n"
                f"AuthorizedKeysFile {t / 'authorized_keys'}\nPubkeyAuthentication yes\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n")
            with open(t / f"sshd_{ns}.log", "wb") as log:
                self.sshds.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(conf)],
                    stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        for ns in self.ns:
            log = t / f"sshd_{ns}.log"
            deadline = time.monotonic() + 20
            while b"Server listening" not in log.read_bytes():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd in {ns} did not start: {log.read_text()}")
                time.sleep(0.05)

    def destroy(self) -> None:
        for proc in self.sshds:
            try:
                procs = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
            except psutil.NoSuchProcess:
                procs = []
            for p in procs:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(procs, timeout=5)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.ns:
            pids = _ip("netns", "pids", ns).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns)  # removes the veth pair too

    def tnt_argv(self, *args: str) -> list[str]:
        """``tnt run`` inside the first namespace, over ssh with the test's keys."""
        tnt = str(Path(os.sys.executable).parent / "tnt")
        return ["ip", "netns", "exec", self.ns[0], tnt, "run", "--hostfile", str(self.hostfile),
                "--launcher", "ssh", "--ssh-args", f"-F {self.ssh_config}", *args]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _preconditions()
    if reason:
        pytest.skip(reason)
    two = TwoHosts(tmp_path_factory.mktemp("netns"))
    try:
        two.create()
        yield two
    finally:
        two.destroy()


def _host_name_is_loopback() -> bool:
    import socket

    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return True
    return all(i[4][0].startswith("127.") or i[4][0] == "::1" for i in infos)


@pytest.mark.parametrize("network", ["iface", "route"])
def test_two_ranks_across_namespaces_over_ssh(hosts, h, network):
    # "route": no TNT_GLOO_IFACE; the host name resolves to loopback (both namespaces share
    # it, as Debian's 127.0.1.1 entry does), so Gloo must find the link on its own: the
    # interface that routes to the rendezvous host
    if network == "route" and not (BACKEND == "gloo" and _host_name_is_loopback()):
        pytest.skip("needs the Gloo backend and a host name that resolves to loopback")
    iface = ["-x", f"TNT_GLOO_IFACE={IFACE}"] if network == "iface" else []
    res = subprocess.run(
        hosts.tnt_argv("--backend", BACKEND, *iface, "--output-on-all-devices",
                       "--timeout", "60", "--", h.rank_script("allreduce.py")),
        capture_output=True, text=True, timeout=120, cwd=hosts.tmp, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    found = dict(re.findall(rf"^\[(\d)\] rank \d/2 backend {BACKEND} sum 3 netns (\d+)", res.stdout, re.M))
    assert set(found) == {"0", "1"}, res.stdout + res.stderr
    assert found["0"] != found["1"], "both ranks ran in the same network namespace"
    print(f"2 ranks across two network namespaces over ssh, backend {BACKEND}")


def _sleepers(hosts, *extra: str, env_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        hosts.tnt_argv("-x", f"TNT_TEST_DIR={env_dir}", *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=hosts.tmp,
        stdin=subprocess.DEVNULL)


def _wait_pids(directory: Path, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while not all((directory / f"pid.{r}").exists() for r in range(n)):
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks did not start within {timeout}s")
        time.sleep(0.05)
    return [int((directory / f"pid.{r}").read_text()) for r in range(n)]


def _alive_procs(pids):
    """The ranks still running (a rank may exit between any two psutil calls)."""
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                procs.append(proc)
        except psutil.NoSuchProcess:
            pass
    return procs


def _alive(pids):
    return [p.pid for p in _alive_procs(pids)]


def test_remote_rank_failure_ends_the_job(hosts, h, tmp_path):
    proc = _sleepers(hosts, "-x", "TNT_TEST_FAIL_RANK=1", "TNT_TEST_FAIL_CODE=3", "--",
                     h.rank_script("sleeper.py"), env_dir=tmp_path)
    try:
        pids = _wait_pids(tmp_path, 2)
        _out, err = proc.communicate(timeout=60)
        ended = time.time()
        failed_at = float((tmp_path / "failed_at").read_text())
        assert proc.returncode == 3, err
        assert f"rank 1 on {ADDR_B} failed: exited with code 3" in err
        assert ended - failed_at < 5.0, f"the job took {ended - failed_at:.1f}s to end"
        assert _alive(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_sigint_ends_the_remote_rank(hosts, h, tmp_path):
    proc = _sleepers(hosts, "--", h.rank_script("sleeper.py"), env_dir=tmp_path)
    try:
        pids = _wait_pids(tmp_path, 2)
        proc.send_signal(signal.SIGINT)  # `ip netns exec` became tnt run itself
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        _gone, alive = psutil.wait_procs(_alive_procs(pids), timeout=5)
        assert alive == [], f"left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_dropped_ssh_connection_ends_the_remote_rank_and_the_job(hosts, h, tmp_path):
    proc = _sleepers(hosts, "--", h.rank_script("sleeper.py"), env_dir=tmp_path)
    try:
        pids = _wait_pids(tmp_path, 2)
        # the server side of the connection dies: ssh exits 255, the agent reads end of file
        sessions = [p for p in psutil.Process(hosts.sshds[1].pid).children() if p.name().startswith("sshd")]
        assert len(sessions) == 1, sessions
        sessions[0].kill()
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 255, err
        assert f"rank 1 on {ADDR_B} failed: exited with code 255 (ssh could not reach {ADDR_B}?" in err
        _gone, alive = psutil.wait_procs(_alive_procs(pids), timeout=5)
        assert alive == [], f"left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_killed_launcher_ends_the_remote_rank(hosts, h, tmp_path):
    proc = _sleepers(hosts, "--", h.rank_script("sleeper.py"), env_dir=tmp_path)
    try:
        pids = _wait_pids(tmp_path, 2)
        proc.kill()  # SIGKILL: tnt run cannot clean up; ssh's stdin closes with it
        proc.communicate(timeout=10)
        _gone, alive = psutil.wait_procs(_alive_procs(pids), timeout=10)
        assert alive == [], f"left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_cleanup_over_ssh(hosts, h, tmp_path):
    """--cleanup through ssh only (a hostfile naming just the remote host). The namespaces
    share one PID namespace, so the remote host's cleanup sees both ranks and ends both."""
    script = tmp_path / f"leftover_{os.getpid()}.py"
    script.write_text((h.RANKS / "sleeper.py").read_text())
    remote_only = tmp_path / "remote_hostfile"
    remote_only.write_text(f"{ADDR_B}\n")
    proc = _sleepers(hosts, "--", str(script), env_dir=tmp_path)
    try:
        pids = _wait_pids(tmp_path, 2)
        argv = hosts.tnt_argv("--cleanup", "--", script.name)
        argv[argv.index(str(hosts.hostfile))] = str(remote_only)
        res = subprocess.run(argv, capture_output=True, text=True, timeout=90, cwd=hosts.tmp,
                             stdin=subprocess.DEVNULL)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.startswith(f"{ADDR_B}: ended 2 rank(s) of {script.name} (pids "), res.stdout
        _gone, alive = psutil.wait_procs(_alive_procs(pids), timeout=5)
        assert alive == []
        proc.communicate(timeout=30)
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
