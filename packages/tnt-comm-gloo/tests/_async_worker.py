"""One rank of test_async_overlap.py: a 64 MiB allreduce in flight while Python runs.

Rank 0 is the waiting rank; the others join each phase late (``--delay`` seconds), so
rank 0 spends that time blocked in ``Handle.wait``. Rank 0 writes ``rank0.json``.

* progress: a Python thread counts loop iterations while the main thread waits; its
  time stamps show whether it ever stalled (a wait holding the GIL would stall it).
* cpu: no Python loop; the process's CPU time is sampled inside a window in which rank 0
  can only be waiting (the peer has not joined yet), and the waiting thread's own CPU
  time over the whole wait is read from /proc through psutil.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from pathlib import Path

import numpy as np
import psutil

import tnt_core

N = 64 * 1024 * 1024 // 4


def _expected(size: int) -> np.ndarray:
    return np.full(N, size * (size + 1) / 2, dtype=np.float32)


def _thread_cpu(proc: psutil.Process, native_id: int) -> float:
    for t in proc.threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    raise RuntimeError(f"thread {native_id} not found")


def progress_phase(backend, delay: float) -> dict:
    buf = np.full(N, backend.rank + 1, dtype=np.float32)
    backend.barrier()
    if backend.rank != 0:
        time.sleep(delay)
        backend.allreduce_async(buf).wait()
        return {}
    stamps: list[float] = []
    count = 0
    stop = threading.Event()

    def loop() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1
            if count % 2000 == 0:
                stamps.append(time.monotonic())

    handle = backend.allreduce_async(buf)
    spinner = threading.Thread(target=loop)
    t0 = time.monotonic()
    spinner.start()
    handle.wait()
    t1 = time.monotonic()
    stop.set()
    spinner.join()
    inside = [s for s in stamps if t0 <= s <= t1]
    edges = [t0, *inside, t1]
    return {
        "wait_s": t1 - t0,
        "iterations": count,
        "stamps_during_wait": len(inside),
        "max_stall_s": max(b - a for a, b in itertools.pairwise(edges)),
        "correct": bool(np.array_equal(buf, _expected(backend.size))),
    }


def cpu_phase(backend, delay: float) -> dict:
    buf = np.full(N, backend.rank + 1, dtype=np.float32)
    backend.barrier()
    if backend.rank != 0:
        time.sleep(delay)
        backend.allreduce_async(buf).wait()
        return {}
    proc = psutil.Process()
    samples: dict[str, tuple[float, float]] = {}

    def cpu() -> float:
        t = proc.cpu_times()
        return t.user + t.system

    def monitor(start: float) -> None:
        time.sleep(max(0.0, start + 0.2 - time.monotonic()))
        samples["a"] = (time.monotonic(), cpu())
        time.sleep(max(0.0, start + delay - 0.3 - time.monotonic()))
        samples["b"] = (time.monotonic(), cpu())

    main_id = threading.get_native_id()
    handle = backend.allreduce_async(buf)
    start = time.monotonic()
    watcher = threading.Thread(target=monitor, args=(start,))
    watcher.start()
    c0, thread0 = cpu(), _thread_cpu(proc, main_id)
    handle.wait()
    t1, c1, thread1 = time.monotonic(), cpu(), _thread_cpu(proc, main_id)
    watcher.join()
    (wa, ca), (wb, cb) = samples["a"], samples["b"]
    return {
        "window_s": wb - wa,
        "window_process_cpu_fraction": (cb - ca) / (wb - wa),
        "wait_s": t1 - start,
        "wait_process_cpu_fraction": (c1 - c0) / (t1 - start),
        "waiting_thread_cpu_s": thread1 - thread0,
        "correct": bool(np.array_equal(buf, _expected(backend.size))),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--delay", type=float, default=2.0)
    args = parser.parse_args()
    runtime = tnt_core.init()
    backend = runtime.backend
    report = {"backend": backend.name,
              "transport": backend.allreduce_transport,
              "progress": progress_phase(backend, args.delay),
              "cpu": cpu_phase(backend, args.delay)}
    if backend.rank == 0:
        (args.report / "rank0.json").write_text(json.dumps(report, indent=1))
    tnt_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
