"""Run under mpiexec with 2 ranks: CPU use of a rank waiting on an allreduce, and Python
work done by the caller's thread while a large allreduce is in flight.

Writes ``OUT/rank<R>.json``. Scenarios (rank 1 is the late peer in each):

* ``wait_ours``: rank 0 waits ``DELAY`` s in ``allreduce_async(...).wait()``;
* ``wait_blocking``: the same in the blocking ``allreduce(...)`` (run by the caller's
  thread itself when nothing is queued);
* ``wait_mpi``: the same wait inside plain mpi4py ``Allreduce`` (MPICH's own waiting), for
  comparison only;
* ``overlap``: both ranks start a 64 MiB ``allreduce_async`` and count pure-Python work
  units until it is done; the same work is timed alone first.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import psutil

import tnt_core

DELAY = 1.5  # long against the 50 ms spin budget (TNT_MPI_MAX_WAITED_SPIN_MS): 3 % of it


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def python_work(units: int) -> int:
    acc = 0
    for i in range(units * 2000):
        acc += i & 7
    return acc


def main() -> int:
    out = Path(sys.argv[1])
    runtime = tnt_core.init()
    backend = runtime.backend
    rank = backend.rank
    proc = psutil.Process()
    report: dict = {"rank": rank, "size": backend.size, "backend": backend.name}
    buf = np.ones(1 << 20, np.float32)  # 4 MiB

    # -- a rank waiting for a late peer, our backend
    backend.allreduce(buf)  # warm up
    backend.barrier()
    if rank == 1:
        time.sleep(DELAY)
    c0, t0 = cpu_seconds(proc), time.perf_counter()
    backend.allreduce_async(buf).wait()
    c1, t1 = cpu_seconds(proc), time.perf_counter()
    report["wait_ours"] = {"cpu_s": c1 - c0, "wall_s": t1 - t0, "cpu_percent": 100 * (c1 - c0) / (t1 - t0)}

    # -- the same wait in the blocking allreduce, which the caller's thread runs itself
    backend.barrier()
    if rank == 1:
        time.sleep(DELAY)
    c0, t0 = cpu_seconds(proc), time.perf_counter()
    backend.allreduce(buf)
    c1, t1 = cpu_seconds(proc), time.perf_counter()
    report["wait_blocking"] = {"cpu_s": c1 - c0, "wall_s": t1 - t0,
                               "cpu_percent": 100 * (c1 - c0) / (t1 - t0)}

    # -- the same wait in MPICH's blocking MPI_Allreduce (what the backend avoids)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    backend.barrier()
    if rank == 1:
        time.sleep(DELAY)
    c0, t0 = cpu_seconds(proc), time.perf_counter()
    comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
    c1, t1 = cpu_seconds(proc), time.perf_counter()
    report["wait_mpi"] = {"cpu_s": c1 - c0, "wall_s": t1 - t0, "cpu_percent": 100 * (c1 - c0) / (t1 - t0)}

    # -- overlap: Python keeps running while a 64 MiB allreduce is in flight
    big = (np.arange(16 << 20) % 1024).astype(np.float32)
    backend.barrier()
    t0 = time.perf_counter()
    python_work(200)
    alone_rate = 200 / (time.perf_counter() - t0)
    backend.barrier()
    if rank == 1:
        time.sleep(1.0)
    t0 = time.perf_counter()
    handle = backend.allreduce_async(big)
    issue_s = time.perf_counter() - t0
    units = 0
    while not handle.done():
        python_work(1)
        units += 1
    busy_s = time.perf_counter() - t0
    handle.wait()
    correct = bool(np.array_equal(big, (np.arange(16 << 20) % 1024).astype(np.float32) * backend.size))
    report["overlap"] = {
        "issue_s": issue_s, "busy_s": busy_s, "units": units,
        "rate_during": units / busy_s, "rate_alone": alone_rate,
        "rate_ratio": units / busy_s / alone_rate, "correct": correct,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    tnt_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
