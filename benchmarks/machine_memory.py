"""What the machine's memory gives a run, measured in the run: one CPU's memcpy bandwidth and
how much of it each CPU keeps when all copy at once. Why its own module: the benchmarks that
compare runs of several ranks on one host (``scaling.py``, ``pipeline.py``) print it beside
their samples, because on a virtual machine it changes from minute to minute."""

from __future__ import annotations

import os
import time


def memcpy_gbps(nbytes: int) -> float:
    """This machine's memcpy bandwidth now, for a buffer of the gradients' size (GB/s)."""
    import numpy as np

    src = np.ones(max(nbytes, 1 << 20) // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(30):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best / 1e9


def memory_sharing(cpus: int, nbytes: int = 32 << 20, seconds: float = 0.3) -> float:
    """How much of its memory bandwidth a CPU keeps while ``cpus`` CPUs copy at once: each
    copies a buffer larger than the caches for ``seconds`` alone, then all together (one
    thread per CPU; NumPy releases the GIL while it copies); returns the mean ratio.

    Why: on a virtual machine the host may place the vCPUs so that they share a memory
    path with each other or with other tenants, and that changes from minute to minute. On
    the development VM (2026-11-30) the two vCPUs copying together kept 0.97 of their speed
    alone in some minutes and 0.42-0.48 in others, and 2-rank jobs run then were 25 % slower
    (startup included): a sample's ratio says which machine it ran on."""
    import threading

    import numpy as np

    def rate(cpu: int, out: list[float], start: threading.Barrier | None) -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        src = np.ones(nbytes // 8, np.float64)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # touch the pages before timing
        if start is not None:
            start.wait()
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            np.copyto(dst, src)
            count += 1
        out.append(count / (time.perf_counter() - t0))

    available = sorted(os.sched_getaffinity(0))[:cpus]
    if len(available) < 2:
        return float("nan")
    alone: list[float] = []
    for cpu in available:
        worker = threading.Thread(target=rate, args=(cpu, alone, None))
        worker.start()
        worker.join()
    together: list[float] = []
    start = threading.Barrier(len(available))
    workers = [threading.Thread(target=rate, args=(cpu, together, start)) for cpu in available]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(together) / sum(alone)
