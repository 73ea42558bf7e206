"""The rank agent: ``python -m tnt_cli.agent`` runs one rank and answers for it.

``tnt run`` starts one agent per rank (directly, over ssh, or under mpirun/srun). The
agent reads its job description, starts the rank in a session of its own, applies the
output policy (master only, or every line prefixed ``[rank]``; TensorFlow's start-up lines
left out: :func:`startup_filter`), and makes sure the rank never outlives the job:

* local and ssh: the description arrives as the first line on stdin and stdin stays open;
  end of file (launcher closed it, died, or the ssh connection dropped) ends the rank;
* mpirun/srun: the description is in ``TNT_AGENT_SPEC``; rank, size and local rank come
  from the launcher's variables; the agent ends the rank when its parent goes away;
* the rank gets ``PR_SET_PDEATHSIG`` so even a SIGKILLed agent takes its rank along.

Ending a rank means SIGTERM to its process group, then SIGKILL after the grace period.
The exit code is the rank's (128+N when a signal N killed it). Standard library only,
but for tnt-core's reading of the MPI launchers' variables.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .cleanup import remove_orphan_segments, shm_segments
from .devices import rank_cpus, visible_gpus
from .oom import OOM_ADVICE, OomCount

__all__ = ["main", "rank_identity", "SPEC_ENV", "FAILURE_KEY", "PEER_FAILURE_EXIT_CODE",
           "STATUS_PREFIX", "exception_text", "report_failure", "read_failures"]

SPEC_ENV = "TNT_AGENT_SPEC"
#: a rank's exit code when it failed because a peer failed: tnt_core.PEER_FAILURE_EXIT_CODE
#: (not imported: the agent needs no tnt-core to run a rank; a test keeps them equal)
PEER_FAILURE_EXIT_CODE = 75
SPEC_VERSION = 1
#: lines of a hidden rank's stderr shown when that rank fails
STDERR_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1
#: the last line of a Python traceback (agents prefix a hidden rank's lines with ``[rank] ``)
_EXCEPTION_LINE = re.compile(r"^(?:\[\d+\] )?(?:[A-Za-z_]\w*\.)*"
                             r"([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?:: .*)?)$")
#: the longest exception text quoted in the launcher's verdict
_CAUSE_CHARS = 300
#: starts the agent's status lines on its error output when the job description asks for
#: them (``"status": true``, agents started over ssh): ``started HOSTNAME`` once the rank
#: runs, ``exited CODE`` as the agent ends. ``tnt run`` reads and drops them; they tell it a
#: connection lost after the rank started (no ``exited`` line) from ssh never reaching the
#: host (no ``started``) and from the rank's own exit code 255 (``exited 255``)
STATUS_PREFIX = b"\x1etnt-agent "


def exception_text(line: str) -> str | None:
    """``ValueError: boom`` from a traceback's last line (module path and rank prefix
    dropped), None when ``line`` is not one."""
    m = _EXCEPTION_LINE.match(line.strip())
    if m is None:
        return None
    return _quoted(m.group(1))


def _quoted(text: str) -> str:
    """``text`` as the verdict quotes a cause: at most ``_CAUSE_CHARS`` characters."""
    return text if len(text) <= _CAUSE_CHARS else text[:_CAUSE_CHARS - 3] + "..."


#: exit codes with which a Python program states its reason in its last line of error
#: output: ``sys.exit("message")`` exits with 1 after printing the message, argparse's usage
#: errors with 2 after ``prog: error: ...``
_STATED_EXIT_CODES = (1, 2)
_RANK_PREFIX = re.compile(r"^\[\d+\] ")


def stated_reason(line: str, code: int) -> str | None:
    """The last line of a rank's error output as the reason it exited with ``code``, where
    a program that exits on purpose says why (``sys.exit("no data in ./data: run
    get_data.py")``): no traceback says it then. None for other codes and empty lines."""
    if code not in _STATED_EXIT_CODES:
        return None
    text = _RANK_PREFIX.sub("", line.strip(), count=1).strip()
    return _quoted(text) if text else None


def rank_identity(env: Mapping[str, str]) -> tuple[int, int, int, int] | None:
    """``(rank, size, local_rank, local_size)`` from an MPI launcher or ``srun``, or None.

    The launcher's variables are read by :func:`tnt_core.detect_mpi_launch`, the same
    reading the MPI backend makes (imported here, late: only agents under mpirun/srun
    need it, and tnt-core imports numpy). A launcher that does not say the local size
    counts as one rank per node.
    """
    from tnt_core import detect_mpi_launch

    launch = detect_mpi_launch(env)
    if launch is None or launch.size is None or launch.local_rank is None:
        return None
    return launch.rank, launch.size, launch.local_rank, launch.local_size or 1


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _numa_nodes() -> int:
    try:
        return max(1, sum(1 for n in os.listdir("/sys/devices/system/node")
                          if n.startswith("node") and n[4:].isdigit()))
    except OSError:
        return 1


def numactl_prefix(local_rank: int, pin_cpu: bool, pin_memory: bool, nodes: int) -> list[str]:
    """``numactl`` arguments binding local rank ``local_rank`` to socket ``local_rank % nodes``."""
    if not (pin_cpu or pin_memory):
        return []
    socket_id = local_rank % max(1, nodes)
    args = ["numactl"]
    if pin_cpu:
        args.append(f"--cpunodebind={socket_id}")
    args.append(f"--membind={socket_id}" if pin_memory else f"--preferred={socket_id}")
    return args


class _Writer:
    """Whole lines to one file descriptor; a closed reader (EPIPE) is not an error."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.broken = False

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except OSError:
                self.broken = True


#: TensorFlow's native start-up lines (its C++ log, through absl): the notice absl writes
#: before its log is set up, INFO records (absl writes those before TensorFlow applies
#: TF_CPP_MIN_LOG_LEVEL, so no level hides them) and the CPU-feature notice's second line
_ABSL_NOTICE = re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) is called "
                          rb"are written to STDERR\s*$")
_ABSL_INFO = re.compile(rb"^I\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
_CPU_FEATURES = re.compile(rb"^To enable the following instructions: .* rebuild TensorFlow with "
                           rb"the appropriate compiler flags\.\s*$")
#: CUDA's probe failing on a machine without an NVIDIA driver: noise for a CPU rank
_NO_CUDA = re.compile(rb"^E\d{4} [^\]]* cuda_platform\.cc:\d+\] failed call to cuInit: ")


def startup_filter(env: Mapping[str, str], has_gpu: bool) -> Callable[[bytes], bool] | None:
    """Whether a line of a rank's error output is TensorFlow's start-up chatter, which ``tnt
    run`` leaves out (None: show everything, as ``--log-level DEBUG`` and an explicit
    ``TF_CPP_MIN_LOG_LEVEL=0`` ask). ``has_gpu``: the rank may use a GPU (a failed CUDA
    probe is then an error worth seeing)."""
    if env.get("TNT_LOG_LEVEL", "").upper() == "DEBUG" or env.get("TF_CPP_MIN_LOG_LEVEL") == "0":
        return None
    patterns = [_ABSL_NOTICE, _ABSL_INFO, _CPU_FEATURES] + ([] if has_gpu else [_NO_CUDA])

    def chatter(line: bytes) -> bool:
        return any(p.match(line) for p in patterns)

    return chatter


def _rank_has_gpu(env: Mapping[str, str]) -> bool:
    return bool(visible_gpus(dict(env)))


def _pump(pipe, sink: Callable[[bytes], None]) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            sink(line if line.endswith(b"\n") else line + b"\n")


class Agent:
    def __init__(self, spec: Mapping, stdin_watch: bool) -> None:
        self.spec = spec
        self.stdin_watch = stdin_watch
        self.host = spec.get("host") or socket.gethostname()
        self.grace_s = float(spec.get("grace_s", 3.0))
        self.stop_requested = threading.Event()
        self.proc: subprocess.Popen | None = None
        #: the CPUs the rank is bound to (None: not bound); set by run()
        self.cpus: list[int] | None = None
        self.out = _Writer(1)
        self.err = _Writer(2)
        self.tail: collections.deque[bytes] = collections.deque(maxlen=STDERR_TAIL_LINES)
        #: the rank's last line of error output, and the last one that ends a traceback,
        #: whoever shows them (the master's lines go straight out, not into ``tail``)
        self.last_err_line = ""
        self.last_exception_line = ""
        self._pid = os.getpid()
        self._prctl: Callable[..., int] | None
        try:  # looked up before fork: the child must not load libraries
            self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            self._prctl = None

    # -- environment ------------------------------------------------------------------
    def build_env(self) -> tuple[dict[str, str], int]:
        spec = self.spec
        pairs: list[tuple[str, str]] = [(k, v) for k, v in spec["env"]]
        env = dict(os.environ)
        env.pop(SPEC_ENV, None)
        rank = spec.get("rank")
        identity: list[tuple[str, str]] = []
        if rank is None:
            ident = rank_identity(env)
            if ident is None:
                raise RuntimeError("rank unknown: no MPI or Slurm step variables "
                                   "(PMI_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK, SLURM_PROCID "
                                   "with SLURM_STEP_ID) give rank, size and local rank")
            rank, size, local_rank, local_size = ident
            names = {k for k, _ in pairs}
            identity += [("TNT_RANK", str(rank)), ("TNT_SIZE", str(size)),
                         ("TNT_LOCAL_RANK", str(local_rank)), ("TNT_LOCAL_SIZE", str(local_size))]
            if "TNT_NUM_THREADS" not in names:
                identity.append(("TNT_NUM_THREADS", str(max(1, _cpu_count() // max(1, local_size)))))
            gpus = spec.get("gpus")
            if spec.get("hide_gpus"):
                identity.append(("CUDA_VISIBLE_DEVICES", "-1"))
            elif gpus and local_rank < len(gpus):
                identity.append(("CUDA_VISIBLE_DEVICES", str(gpus[local_rank])))
        # the launcher's order is kept: remove, then insert in order (later wins)
        for name, value in identity + pairs:
            env.pop(name, None)
            env[name] = value
        return env, int(rank)

    # -- life cycle -------------------------------------------------------------------
    def _preexec(self) -> None:
        """Runs in the child between fork and exec: only what is safe there."""
        os.setsid()
        # the rank's new session keeps the agent's (tnt run's) priority, as
        # tnt_core.carry_priority does, retrying the kernel's rate limit (EAGAIN) for
        # half a second (the agent imports no tnt-core: start-up time)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        for _ in range(10 if nice > 0 else 0):
            try:
                fd = os.open("/proc/self/autogroup", os.O_WRONLY)
                try:
                    os.write(fd, str(nice).encode())
                finally:
                    os.close(fd)
                break
            except OSError as e:
                if e.errno != errno.EAGAIN:
                    break
            time.sleep(0.05)
        if self.cpus:  # before exec: every thread the rank starts inherits it
            os.sched_setaffinity(0, self.cpus)
        if self._prctl is not None:
            self._prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self._pid:  # the agent died between fork and prctl
            os._exit(137)

    @staticmethod
    def binding(spec: Mapping[str, Any], share: int, shares: int) -> list[int] | None:
        """The CPUs this rank is bound to (``--bind-to core``: share ``share`` of the
        host's cores cut in ``shares``), or None: not asked, socket binding asked instead
        (numactl), or a rank placed by mpirun/srun (whose own binding options apply: Open
        MPI binds by default)."""
        if spec.get("bind") != "core" or spec.get("pin_cpu") or spec.get("rank") is None:
            return None
        return rank_cpus(share, shares)

    def terminate(self) -> None:
        """SIGTERM the rank's process group, SIGKILL it after the grace period."""
        self.stop_requested.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid, signal.SIGKILL)

    def _watch_stdin(self) -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        if self.proc is not None and self.proc.poll() is None:
            threading.Thread(target=self.terminate, daemon=True).start()
        self.stop_requested.set()

    def _watch_parent(self, parent: int) -> None:
        while not self.stop_requested.wait(0.5):
            if os.getppid() != parent:
                self.terminate()
                return

    def run(self) -> int:
        spec = self.spec
        env, rank = self.build_env()
        ident_local = int(env.get("TNT_LOCAL_RANK", "0"))
        share, shares = spec.get("share") or (ident_local, int(env.get("TNT_LOCAL_SIZE", "1")))
        self.cpus = self.binding(spec, share, shares)
        argv = numactl_prefix(ident_local, bool(spec.get("pin_cpu")), bool(spec.get("pin_memory")),
                              _numa_nodes()) + list(spec["argv"])
        output_all, master = bool(spec.get("output_all")), rank == 0
        prefix = f"[{rank}] ".encode()
        shm_before = shm_segments()
        oom = OomCount()

        def show_out(line: bytes) -> None:
            if output_all:
                self.out.write(prefix + line)
            elif master:
                self.out.write(line)

        chatter = startup_filter(env, _rank_has_gpu(env))

        def show_err(line: bytes) -> None:
            if chatter is not None and chatter(line):
                return
            text = line.decode(errors="replace").strip()
            if text:
                self.last_err_line = text
                if exception_text(text) is not None:
                    self.last_exception_line = text
            if output_all:
                self.err.write(prefix + line)
            elif master or LOG_LINE_OF_TNT.match(line):
                # the tnt logger of a non-master rank says only what must be seen (errors,
                # and the stall report of whichever rank waits): shown as it comes
                self.err.write(line)
            else:
                self.tail.append(line)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: threading.Thread(target=self.terminate, daemon=True).start())
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        cwd = spec.get("cwd") or None
        if cwd and not os.path.isdir(cwd):
            self.err.write(f"[{rank}] tnt: cannot start rank {rank} on {self.host}: the working "
                           f"directory {cwd} does not exist here (tnt run needs the same paths on "
                           "every host)\n".encode())
            return 127
        try:
            # under mpirun/srun the rank inherits the MPI launcher's PMI socket, which an MPI
            # backend needs to start; every other descriptor of the agent stays closed
            pmi_fd = os.environ.get("PMI_FD", "")
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, preexec_fn=self._preexec,
                                         pass_fds=(int(pmi_fd),) if pmi_fd.isdigit() else ())
        except OSError as exc:
            what = argv[0]
            self.err.write(f"[{rank}] tnt: cannot start rank {rank} on {self.host}: {what}: "
                           f"{exc.strerror or exc}\n".encode())
            return 127
        if spec.get("status"):
            self.err.write(STATUS_PREFIX + f"started {socket.gethostname()}\n".encode())
        pumps = [threading.Thread(target=_pump, args=(self.proc.stdout, show_out), daemon=True),
                 threading.Thread(target=_pump, args=(self.proc.stderr, show_err), daemon=True)]
        for t in pumps:
            t.start()
        if self.stop_requested.is_set():  # a signal came while the rank was starting
            threading.Thread(target=self.terminate, daemon=True).start()
        if self.stdin_watch:
            threading.Thread(target=self._watch_stdin, daemon=True).start()
        else:
            threading.Thread(target=self._watch_parent, args=(os.getppid(),), daemon=True).start()
        while True:
            try:
                code = self.proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                continue
        _killpg(self.proc.pid, signal.SIGKILL)  # helpers the rank left in its group
        for t in pumps:
            t.join(timeout=2.0)
        if code != 0 or self.stop_requested.is_set():
            # a killed rank cannot remove what its MPI library keeps in /dev/shm; the last
            # agent of the host to get here finds it mapped by nobody and removes it
            remove_orphan_segments(shm_before)
        if code != 0 and not self.stop_requested.is_set():
            if not (output_all or master):
                # a rank that failed because a peer failed said why in its last line
                tail = list(self.tail)[-1:] if code == PEER_FAILURE_EXIT_CODE else self.tail
                for line in tail:
                    self.err.write(prefix + line)
            if code == -signal.SIGKILL and oom.grew():  # the rank could not say it
                self.err.write(prefix + OOM_ADVICE.encode() + b"\n")
                self.last_exception_line = OOM_ADVICE
            if spec.get("rank") is None:  # under mpirun/srun only the agent can name the rank
                self.err.write(f"[{rank}] tnt: rank {rank} on {self.host} {describe_exit(code)}\n".encode())
                report_failure(env, rank, code, self.last_exception_line or self.last_err_line)
        exit_code = 128 - code if code < 0 else code
        if spec.get("status"):
            self.err.write(STATUS_PREFIX + f"exited {exit_code}\n".encode())
        return exit_code


#: store keys an agent under mpirun/srun sets when its rank fails: mpirun/srun may wait for
#: the other ranks instead of ending them, so the launcher does it. Every failing rank's
#: agent reports (``FAILURE_KEY/N``, N counted by ``FAILURE_KEY/count``): the first report
#: is often a rank that failed because a peer failed, the cause comes after it
FAILURE_KEY = "tnt/launcher/rank-failed"

#: a line of the ``tnt`` logger (tnt-core's log format) at warning level or above
LOG_LINE_OF_TNT = re.compile(rb"^\[tnt \d+\] (?:WARNING|ERROR|CRITICAL) ")


def report_failure(env: Mapping[str, str], rank: int, code: int, last_line: str = "") -> None:
    """Tell ``tnt run`` through the rendezvous store that ``rank`` failed (best effort):
    ``"RANK CODE LAST-LINE"``, the last line of its error output being the cause."""
    url, key = env.get("TNT_RENDEZVOUS", ""), env.get("TNT_RENDEZVOUS_KEY", "")
    host, sep, port = url.rpartition(":")
    if not (sep and key and port.isdigit()):
        return
    try:
        from tnt_core import StoreClient

        client = StoreClient(host.strip("[]"), int(port), key, connect_timeout=5.0, timeout=5.0)
        try:
            number = client.add(f"{FAILURE_KEY}/count", 1)
            client.set(f"{FAILURE_KEY}/{number}", f"{rank} {code} {last_line}".rstrip().encode())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - the launcher may be gone already; nothing left to tell
        pass


def read_failures(client: Any) -> Iterator[tuple[int, int, str]]:
    """``(rank, code, last line)`` of each report :func:`report_failure` leaves in the store
    of ``client`` (a ``tnt_core.StoreClient``), in order, waiting for the next one; ends when
    the store goes away."""
    number = 1
    while True:
        raw = client.get(f"{FAILURE_KEY}/{number}", timeout=None).decode()
        rank, code, *last = raw.split(" ", 2)
        yield int(rank), int(code), last[0] if last else ""
        number += 1


def describe_exit(code: int) -> str:
    """``exited with code 3`` / ``was killed by signal SIGSEGV``."""
    if code < 0:
        return f"was killed by signal {_signame(-code)}"
    if code > 128 and code - 128 < 65:
        return f"exited with code {code} (signal {_signame(code - 128)}?)"
    return f"exited with code {code}"


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read_spec_line() -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 1)  # byte by byte: what follows the line stays unread
        if not chunk:
            break
        data += chunk
    return data


def main(argv: list[str] | None = None) -> int:
    raw = os.environ.get(SPEC_ENV)
    stdin_watch = raw is None
    try:
        if raw is None:
            raw = _read_spec_line().decode()
            if not raw.strip():
                print("tnt agent: no job description on stdin; this program is started by "
                      "`tnt run`, not by hand", file=sys.stderr)
                return 2
        spec = json.loads(raw)
        if spec.get("version") != SPEC_VERSION:
            print(f"tnt agent: job description version {spec.get('version')} but this "
                  f"tnt-cli speaks {SPEC_VERSION}; install the same tnt-cli on every host",
                  file=sys.stderr)
            return 2
        spec.setdefault("watch", "stdin" if stdin_watch else "parent")
        return Agent(spec, stdin_watch=spec["watch"] == "stdin").run()
    except (ValueError, KeyError, RuntimeError) as exc:
        print(f"tnt agent on {socket.gethostname()}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
