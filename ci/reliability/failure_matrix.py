"""The failure matrix: how a ``tnt run`` job ends when a rank or the launcher fails.

For each backend/transport (gloo over shared memory, gloo over TCP, MPI under mpiexec,
MPI under tnt run's own ``--launcher local``) x 2 and 3 ranks x scenario, it starts a
small ``tnt_core``-only job (no framework, seconds per run) and records one Markdown row:

- scenarios of the failing rank (rank 1; with 3 ranks also rank 0): SIGKILL to itself,
  ``raise ValueError("boom")``, ``os._exit(3)``, a hang (``time.sleep(600)``, run with
  ``--timeout 10 -x TNT_STALL_WARN_S=4``); scenarios of the launcher (3 s after every rank
  runs): SIGINT, SIGTERM, SIGKILL sent to ``tnt run``'s pid;
- the time from the failure (a timestamp the failing rank writes just before failing, or
  the moment the signal was sent) to ``tnt run`` exiting (for SIGKILL: until no rank
  process is left), the exit code, whether ``tnt run``'s last stderr line names the
  failing rank, the line itself;
- what is left 5 s after the end: processes carrying this run's marker (an environment
  variable every process of the job inherits: tnt run, agents, mpiexec, ranks), new files
  in /dev/shm, new /tmp/hydra* and /tmp/tnt* entries (files that existed before the run,
  or that a process outside the run holds open, are not counted).

Acceptance (the reliability issue): every row ends within detection time + 5 s (10 s of
``--timeout`` for the hang, 0 otherwise), names the right rank, and leaves nothing; rows
that miss it are marked ✗.

    python ci/reliability/failure_matrix.py [--quick] [--out table.md]
        [--backends "gloo shm,gloo TCP"] [--ranks 2,3] [--scenarios kill,raise]

Exit code: 0 when every row passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TNT = str(Path(sys.executable).parent / "tnt")
HANG_TIMEOUT_S = 10
STALL_WARN_S = 4
GRACE_S = 5.0  # the acceptance: detection time + this
LEFTOVER_WAIT_S = 5.0
SIGNAL_AFTER_S = 3.0
RUN_LIMIT_S = 60.0  # a run that has not ended by then is killed and reported as hung
START_LIMIT_S = 60.0
FAIL_AT_STEP = 100  # ~1-2 s of collectives before the failing rank fails

#: every process a run starts inherits this variable; its value is unique per run
MARK_VAR = "TNT_RELIABILITY_FM_MARK"
SESSION = f"relfm{os.getpid()}x{secrets.token_hex(4)}"

RANK_SCRIPT = """\
import os, signal, sys, time
from pathlib import Path
import numpy as np
import tnt_core

rt = tnt_core.init()
work, what, victim = Path(os.environ["FM_DIR"]), os.environ["FM_WHAT"], int(os.environ["FM_RANK"])
(work / f"pid.{rt.rank}").write_text(str(os.getpid()))
buf = np.ones(1024, dtype=np.float32)
for step in range(10_000_000):
    if step == int(os.environ["FM_STEP"]) and rt.rank == victim and what in ("kill", "raise", "exit", "hang"):
        (work / "failed_at").write_text(repr(time.time()))
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif what == "raise":
            raise ValueError("boom")
        elif what == "exit":
            os._exit(3)
        else:
            time.sleep(600)
    rt.backend.allreduce(buf)
    time.sleep(0.01)
"""

BACKENDS: dict[str, list[str]] = {
    "gloo shm": ["--backend", "gloo"],
    "gloo TCP": ["--backend", "gloo", "-x", "TNT_GLOO_SHM=0"],
    "mpi via mpiexec": ["--backend", "mpi", "--launcher", "mpirun"],
    "mpi via --launcher local": ["--backend", "mpi", "--launcher", "local"],
}
RANK_FAILURES = ["kill", "raise", "exit", "hang"]
LAUNCHER_SIGNALS = ["SIGINT", "SIGTERM", "SIGKILL"]
SCENARIOS = RANK_FAILURES + LAUNCHER_SIGNALS
#: the exit code docs/cli.md promises for a rank failure (128+N for a signal)
DOCUMENTED_EXIT = {"kill": 137, "raise": 1, "exit": 3, "hang": 1}


# -- processes and files -----------------------------------------------------------------

def _proc_env_has(pid: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return needle in fh.read()
    except OSError:
        return False


def _state(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def marked(mark: str) -> dict[int, str]:
    """Live (not zombie) processes whose environment carries ``MARK_VAR=mark``: pid -> cmdline."""
    needle = f"{MARK_VAR}={mark}\0".encode()
    found = {}
    for pid in os.listdir("/proc"):
        if (pid.isdigit() and int(pid) != os.getpid() and _proc_env_has(pid, needle)
                and _state(pid) not in ("Z", "X", "?")):
            found[int(pid)] = _cmdline(pid)
    return found


def _kind(cmd: str, script: str) -> str:
    if re.search(r"/(tnt|tarantella) run\b", cmd):
        return "tnt run"
    if "mpiexec" in cmd.split(" ", 1)[0]:
        return "mpiexec"
    if "hydra_pmi_proxy" in cmd:
        return "hydra_pmi_proxy"
    if "tnt_cli.agent" in cmd:
        return "agent"
    if "_pmi_helper" in cmd:
        return "pmi helper"
    if script in cmd:
        return "rank"
    return (cmd.split() or ["?"])[0].rsplit("/", 1)[-1]


def _listing() -> set[str]:
    return (set(glob.glob("/dev/shm/*")) | set(glob.glob("/dev/shm/.*"))
            | set(glob.glob("/tmp/hydra*")) | set(glob.glob("/tmp/tnt*")))


def _holders(paths: set[str]) -> dict[str, set[int]]:
    """For each path, the pids that map it or hold it open."""
    held: dict[str, set[int]] = {p: set() for p in paths}
    if not paths:
        return held
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            for p in paths:
                if p in text:
                    held[p].add(int(pid))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                for p in paths:
                    if target == p or target.startswith(p + "/"):
                        held[p].add(int(pid))
        except OSError:
            continue
    return held


STARTED_GROUPS: list[int] = []


def kill_everything() -> None:
    """SIGKILL every process of this session's runs and every process group it started."""
    needle = f"{MARK_VAR}={SESSION}".encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid() and _proc_env_has(pid, needle):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    for pgid in STARTED_GROUPS:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


# -- one run ------------------------------------------------------------------------------

@dataclass
class Row:
    backend: str
    ranks: int
    scenario: str
    failing: str
    took: float | None = None
    limit: float = GRACE_S
    code: int | None = None
    named: str = "n/a"
    last: str = ""
    left: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.took is not None and self.took <= self.limit and self.named != "no"
                and not self.left and self.code not in (None, 0))

    def markdown(self) -> str:
        took = "did not end" if self.took is None else f"{self.took:.1f} s"
        last = self.last[:160].replace("|", "\\|")
        notes = "; ".join(self.notes)
        return (f"| {self.backend} | {self.ranks} | {self.scenario} | {self.failing} | {took} "
                f"| {'-' if self.code is None else self.code} | {self.named} "
                f"| {', '.join(self.left) or 'nothing'} | {'✓' if self.ok else '✗'} "
                f"| {notes} | `{last}` |")


HEADER = ["| backend | ranks | scenario | failing | failure → end | exit | right rank named "
          "| left after 5 s | ok | notes | tnt run's last stderr line |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]


def _names_rank(line: str, rank: int) -> bool:
    """The line's subject is ``rank``: ``tnt run: rank R on ... failed``, ``tnt run: rank R
    did not arrive ...``, ``tnt run: rank R on ... did not take part ...``."""
    return re.match(rf"tnt run: rank {rank}\b(?! on \S+ failed waiting)", line) is not None


def run_one(backend: str, n: int, scenario: str, victim: int, index: int) -> Row:
    failing = "launcher" if scenario.startswith("SIG") else f"rank {victim}"
    row = Row(backend, n, scenario, failing)
    hang = scenario == "hang"
    row.limit = (HANG_TIMEOUT_S if hang else 0) + GRACE_S
    mark = f"{SESSION}-{index}"
    with tempfile.TemporaryDirectory(prefix=f"{mark}-") as tmp:
        work = Path(tmp)
        script = work / "fm_rank.py"
        script.write_text(RANK_SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
        env.update({MARK_VAR: mark, "FM_DIR": str(work), "FM_WHAT": scenario,
                    "FM_RANK": str(victim), "FM_STEP": str(FAIL_AT_STEP)})
        cmd = [TNT, "run", "-n", str(n), *BACKENDS[backend]]
        if hang:
            cmd += ["--timeout", str(HANG_TIMEOUT_S), "-x", f"TNT_STALL_WARN_S={STALL_WARN_S}"]
        cmd += ["--", str(script)]
        before = _listing()
        err_path = work / "stderr.txt"
        with open(err_path, "wb") as err, open(work / "stdout.txt", "wb") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=work, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, start_new_session=True)
        STARTED_GROUPS.append(proc.pid)
        try:
            deadline = time.monotonic() + START_LIMIT_S
            while (len(list(work.glob("pid.*"))) < n and proc.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            if len(list(work.glob("pid.*"))) < n:
                row.notes.append(f"only {len(list(work.glob('pid.*')))} of {n} ranks started")
            sent_at = None
            if scenario.startswith("SIG") and proc.poll() is None:
                time.sleep(SIGNAL_AFTER_S)
                sent_at = time.time()
                proc.send_signal(getattr(signal, scenario))
            deadline = time.monotonic() + RUN_LIMIT_S + (HANG_TIMEOUT_S if hang else 0)
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            ended = time.time()
            if proc.poll() is None:
                row.notes.append(f"tnt run still running {RUN_LIMIT_S:.0f} s after the start; killed")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                ended = None
            row.code = proc.returncode
            if scenario == "SIGKILL" and ended is not None:  # the agents must end the ranks
                deadline = time.monotonic() + RUN_LIMIT_S
                while (any(_kind(c, str(script)) == "rank" for c in marked(mark).values())
                       and time.monotonic() < deadline):
                    time.sleep(0.05)
                ended = time.time()
                if any(_kind(c, str(script)) == "rank" for c in marked(mark).values()):
                    ended = None
                    row.notes.append(f"ranks still alive {RUN_LIMIT_S:.0f} s after tnt run was killed")
            stamp = work / "failed_at"
            failed_at = sent_at if sent_at is not None else (
                float(stamp.read_text()) if stamp.exists() and stamp.read_text() else None)
            if failed_at is None:
                row.notes.append("the failing rank never reached its failure")
            elif ended is not None:
                row.took = ended - failed_at
            lines = [ln for ln in err_path.read_text(errors="replace").splitlines() if ln.strip()]
            row.last = lines[-1].strip() if lines else ""
            if not scenario.startswith("SIG"):
                row.named = "yes" if _names_rank(row.last, victim) else "no"
                if row.code != DOCUMENTED_EXIT[scenario]:
                    row.notes.append(f"docs/cli.md: exit {DOCUMENTED_EXIT[scenario]}")
            time.sleep(LEFTOVER_WAIT_S)
            alive = marked(mark)
            kinds: dict[str, int] = {}
            for c in alive.values():
                kinds[_kind(c, str(script))] = kinds.get(_kind(c, str(script)), 0) + 1
            row.left += [f"{k} ×{v}" if v > 1 else k for k, v in sorted(kinds.items())]
            new = _listing() - before
            ours = set(alive)
            for path, pids in sorted(_holders(new).items()):
                if pids - ours:
                    continue  # held by a process outside this run: someone else's
                if path.startswith("/tmp/tnt-launch-"):
                    continue  # tnt_core.testing's launcher (other test suites), not tnt run
                row.left.append(path)
        finally:
            for pid in marked(mark):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            if proc.poll() is None:
                proc.wait(timeout=30)
    return row


def plan(args: argparse.Namespace) -> list[tuple[str, int, str, int]]:
    backends = [b.strip() for b in args.backends.split(",")] if args.backends else list(BACKENDS)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [2, 3]
    scenarios = [s.strip() for s in args.scenarios.split(",")] if args.scenarios else SCENARIOS
    if args.quick:
        backends, ranks = ["gloo shm", "mpi via mpiexec"], [2]
        scenarios = ["kill", "raise", "SIGTERM"]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"failure_matrix: unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"failure_matrix: unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")
    runs = []
    for b in backends:
        for n in ranks:
            for s in scenarios:
                runs.append((b, n, s, 1))
            if n >= 3 and not args.quick:  # the master failing
                runs += [(b, n, s, 0) for s in ("kill", "raise", "hang") if s in scenarios]
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a subset: gloo shm and mpi via mpiexec, 2 ranks, kill/raise/SIGTERM")
    parser.add_argument("--out", help="also write the Markdown table to this path")
    parser.add_argument("--backends", help=f"comma-separated subset of: {', '.join(BACKENDS)}")
    parser.add_argument("--ranks", help="comma-separated rank counts (default 2,3)")
    parser.add_argument("--scenarios", help=f"comma-separated subset of: {', '.join(SCENARIOS)}")
    args = parser.parse_args()
    atexit.register(kill_everything)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    started = time.monotonic()
    rows = list(HEADER)
    print("\n".join(HEADER), flush=True)
    failed = 0
    for index, (backend, n, scenario, victim) in enumerate(plan(args)):
        row = run_one(backend, n, scenario, victim, index)
        failed += not row.ok
        rows.append(row.markdown())
        print(rows[-1], flush=True)
    summary = (f"\n{len(rows) - 2} runs, {failed} ✗, {time.monotonic() - started:.0f} s in all "
               f"(acceptance: end within detection + {GRACE_S:.0f} s, the right rank named, "
               f"nothing left {LEFTOVER_WAIT_S:.0f} s after the end)")
    print(summary, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(rows) + "\n" + summary + "\n")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
