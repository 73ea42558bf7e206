"""The failure matrix: how a job ends when a rank or the launcher fails, measured.

For each backend (gloo over shared memory, gloo over TCP, MPI under mpiexec, MPI under
tnt run's own launcher) x 2 and 3 ranks x scenario (the failing rank is killed with
SIGKILL, raises, calls ``os._exit(3)``, hangs; the launcher gets SIGINT, SIGTERM,
SIGKILL), it runs a small tnt_core job (no framework: seconds per run) and prints one
Markdown row: the time from the failure to the end, the exit code, whether tnt run's last
line names the right rank, and what was left (rank processes, new files in /dev/shm,
/tmp/hydra*).

    python ci/reliability/failures.py [--quick] [--out table.md]
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TNT = str(Path(sys.executable).parent / "tnt")
HANG_TIMEOUT_S = 10
RANK = """
import os, signal, sys, time
from pathlib import Path
import numpy as np, tnt_core
rt = tnt_core.init()
mark, what, victim = Path(os.environ["FM_DIR"]), os.environ["FM_WHAT"], int(os.environ["FM_RANK"])
(mark / f"pid.{rt.rank}").write_text(str(os.getpid()))
for step in range(1_000_000):
    if step == 50 and rt.rank == victim and what in ("kill", "raise", "exit", "hang"):
        (mark / "failed_at").write_text(repr(time.time()))
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "raise":
            raise ValueError("boom")
        if what == "exit":
            os._exit(3)
        time.sleep(600)
    rt.backend.allreduce(np.ones(1024, dtype=np.float32))
    time.sleep(0.01)
"""

BACKENDS = {
    "gloo shm": ["--backend", "gloo"],
    "gloo TCP": ["--backend", "gloo", "-x", "TNT_GLOO_SHM=0"],
    "mpi, mpiexec": ["--backend", "mpi", "--launcher", "mpirun"],
    "mpi, --launcher local": ["--backend", "mpi", "--launcher", "local"],
}
SCENARIOS = ["kill", "raise", "exit", "hang", "SIGINT", "SIGTERM", "SIGKILL"]


def _files() -> set[str]:
    return set(glob.glob("/dev/shm/*")) | set(glob.glob("/tmp/hydra*"))


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    alive.append(pid)
        except OSError:
            continue
    return alive


def run_one(backend: str, n: int, what: str, victim: int) -> str:
    with tempfile.TemporaryDirectory(prefix="tnt-fm-") as tmp:
        work = Path(tmp)
        script = work / "rank.py"
        script.write_text(RANK)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
        env.update(FM_DIR=str(work), FM_WHAT=what, FM_RANK=str(victim))
        before = _files()
        cmd = [TNT, "run", "-n", str(n), "--timeout", str(HANG_TIMEOUT_S), "-x", "TNT_STALL_WARN_S=4",
               *BACKENDS[backend], "--", str(script)]
        proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while len(list(work.glob("pid.*"))) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in work.glob("pid.*") if p.read_text()]
        failed_at = None
        if what.startswith("SIG"):
            time.sleep(1.0)
            failed_at = time.time()
            proc.send_signal(getattr(signal, what))
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            return f"| {backend} | {n} | {what} | >90 s (hung) | - | - | ✗ |"
        if what == "SIGKILL":  # tnt run is gone at once; its agents must end the ranks
            end_deadline = time.monotonic() + 30
            while _alive(pids) and time.monotonic() < end_deadline:
                time.sleep(0.05)
        ended = time.time()
        if failed_at is None:
            stamp = work / "failed_at"
            failed_at = float(stamp.read_text()) if stamp.exists() else ended
        time.sleep(2.0)
        left = [f"pid {p}" for p in _alive(pids)] + sorted(_files() - before)
        for pid in _alive(pids):
            os.kill(pid, signal.SIGKILL)
        last = (err or "").strip().splitlines()[-1:] or [""]
        took = ended - failed_at
        limit = (HANG_TIMEOUT_S if what == "hang" else 0) + 5
        if what.startswith("SIG"):
            named = "n/a"
        else:
            named = "yes" if f"rank {victim}" in last[0] else "no"
        ok = took <= limit and named != "no" and not left and proc.returncode != 0
        return (f"| {backend} | {n} | {what} | {took:.1f} s | {proc.returncode} | {named} | "
                f"{', '.join(left) or 'nothing'} | {'✓' if ok else '✗'} | "
                f"{last[0][:140].replace('|', '/')} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, gloo shm and mpi local only")
    parser.add_argument("--out")
    args = parser.parse_args()
    head = ["| backend | ranks | failure | time to end | exit code | right rank named | left behind "
            "| ok | tnt run's last line |", "|---|---|---|---|---|---|---|---|---|"]
    rows = list(head)
    print("\n".join(head), flush=True)
    backends = ["gloo shm", "mpi, --launcher local"] if args.quick else list(BACKENDS)
    for backend in backends:
        for n in ([2] if args.quick else [2, 3]):
            for what in SCENARIOS:
                victim = 0 if (n == 3 and what == "raise") else n - 1
                row = run_one(backend, n, what, victim)
                rows.append(row)
                print(row, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")
    return 0 if all("✗" not in r for r in rows[2:]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
