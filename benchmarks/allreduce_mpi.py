"""tnt-comm-mpi's allreduce next to a plain mpi4py ``Allreduce``, same buffers, same run.

Used by ``benchmarks/allreduce.py --backend mpi``; runs on its own too::

    python benchmarks/allreduce_mpi.py --sizes 4KiB..256MiB --iters 30

Starts ``--nprocs`` ranks (2 by default) with the ``mpiexec`` next to the interpreter (the
``mpich`` wheel's Hydra) or the one on PATH. In every rank, for every size:

* ours: ``backend.allreduce(buf)``, the blocking collective (what ``tnt-keras`` calls for
  metrics and flags, and any user who wants a reduced buffer now): validation,
  ``MPI_Iallreduce`` driven by the spin-then-sleep poller, run on the calling thread when
  the communication thread has nothing queued;
* async (keys ``async_*``): ``backend.allreduce_async(buf).wait()`` one call at a time,
  the non-blocking path with nothing to overlap: the same work plus waking the
  communication thread at submit, which then takes the GIL once from the waiter;
* baseline: ``MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)`` on the caller's
  thread (MPICH's blocking path, busy-polling), on the same buffer;
* stream (keys ``stream_*``, sizes up to 32 MiB): 8 buffers of the size issued with
  ``allreduce_async`` back to back and then waited for with ``tnt_core.wait_all``, as
  tnt-core's ``FusedAllreducer`` waits for gradient buckets, against 8 blocking
  ``Allreduce`` calls in a row.

Ours and async are each timed in a loop of their own, alternating call by call with the
baseline, after a barrier each, so load from other processes hits both sides alike; each
ratio is against the baseline of its own loop. After each async call the rank pauses
0.5 ms, untimed (see ``SETTLE_S``). A call's time is the slowest rank's; medians are
reported. Buffers hold float32 zeros. Bandwidth is algorithm bandwidth: bytes / median
seconds / 1e9.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BYTES_PER_SIZE = 4 << 30  # cap on the bytes reduced per size and side (large buffers)
STREAM_DEPTH = 8  # allreduces in flight in the "stream" measurement
#: pause after each async call, untimed: the communication thread, woken by the submit,
#: may get a core only later on a machine whose cores are all busy; without the pause it
#: would run during the next timed call (the baseline), not during the one that woke it
SETTLE_S = 0.5e-3
STREAM_MAX_BYTES = 256 << 20  # its buffers per rank: sizes up to 32 MiB
DEFAULT_SIZES = [1 << p for p in range(12, 29)]  # 4 KiB .. 256 MiB, every power of two


#: columns ``benchmarks/allreduce.py`` prints after the standard ones: (key, header, format)
EXTRA_COLUMNS = [("async_ratio", "async ratio", ".3f"), ("async_median_us", "async med µs", ".1f"),
                 ("stream_ratio", "stream×8 ratio", ".3f")]


def iterations(size: int, iters: int) -> int:
    return max(5, min(iters, BYTES_PER_SIZE // size))


def _stream(backend, comm, MPI, size: int, rounds: int) -> dict:
    """``STREAM_DEPTH`` allreduces issued back to back, then waited for as one batch (as
    tnt-keras does with gradient buckets), against as many blocking ``Allreduce`` calls in
    a row."""
    import tnt_core

    bufs = [np.zeros(size // 4, dtype=np.float32) for _ in range(STREAM_DEPTH)]
    ours = np.empty(rounds)
    base = np.empty(rounds)
    for i in range(rounds):
        comm.Barrier()
        t0 = MPI.Wtime()
        tnt_core.wait_all([backend.allreduce_async(b) for b in bufs])
        ours[i] = MPI.Wtime() - t0
        comm.Barrier()
        t0 = MPI.Wtime()
        for b in bufs:
            comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM)
        base[i] = MPI.Wtime() - t0
    comm.Allreduce(MPI.IN_PLACE, ours, MPI.MAX)
    comm.Allreduce(MPI.IN_PLACE, base, MPI.MAX)
    ours_s, base_s = float(np.median(ours)), float(np.median(base))
    return {"stream_depth": STREAM_DEPTH,
            "stream_ours_gbps": STREAM_DEPTH * size / ours_s / 1e9,
            "stream_baseline_gbps": STREAM_DEPTH * size / base_s / 1e9,
            "stream_ratio": base_s / ours_s}


def _alternate(comm, MPI, total: int, ours, baseline, settle_s: float = 0.0) -> tuple:
    """``total`` timed calls of ``ours`` and ``baseline``, alternating, a barrier before each;
    per call the slowest rank's time. ``settle_s``: a pause after each of ours, untimed."""
    times = np.empty((2, total))
    for i in range(total):
        comm.Barrier()
        t0 = MPI.Wtime()
        ours()
        times[0, i] = MPI.Wtime() - t0
        if settle_s:
            time.sleep(settle_s)
        comm.Barrier()
        t0 = MPI.Wtime()
        baseline()
        times[1, i] = MPI.Wtime() - t0
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)  # a call lasts as long as its slowest rank
    return times[0], times[1]


def _worker(sizes: list[int], iters: int, out: Path) -> int:
    from mpi4py import MPI

    import tnt_core

    runtime = tnt_core.init(backend="mpi")
    backend, comm = runtime.backend, MPI.COMM_WORLD
    warm = np.zeros(1 << 18, dtype=np.float32)
    for _ in range(200):  # start-up: let both ranks settle before the first timed size
        backend.allreduce_async(warm).wait()
        comm.Allreduce(MPI.IN_PLACE, warm, MPI.SUM)
    rows = []
    for size in sizes:
        buf = np.zeros(size // 4, dtype=np.float32)
        total = iterations(size, iters)
        for _ in range(2):  # warm-up: page faults, MPI's first-use costs
            backend.allreduce(buf)
            backend.allreduce_async(buf).wait()
            comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
        ours, base = _alternate(comm, MPI, total, lambda buf=buf: backend.allreduce(buf),
                                lambda buf=buf: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM))
        asynchronous, async_base = _alternate(
            comm, MPI, total, lambda buf=buf: backend.allreduce_async(buf).wait(),
            lambda buf=buf: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM), settle_s=SETTLE_S)
        ours_s, base_s = float(np.median(ours)), float(np.median(base))
        async_s, async_base_s = float(np.median(asynchronous)), float(np.median(async_base))
        stream = _stream(backend, comm, MPI, size, max(3, total // STREAM_DEPTH)) \
            if size * STREAM_DEPTH <= STREAM_MAX_BYTES else None
        rows.append({
            "size_bytes": size,
            "ours_gbps": size / ours_s / 1e9,
            "baseline_gbps": size / base_s / 1e9,
            "ratio": base_s / ours_s,
            "ours_median_us": ours_s * 1e6,
            "baseline_median_us": base_s * 1e6,
            "async_gbps": size / async_s / 1e9,
            "async_ratio": async_base_s / async_s,
            "async_median_us": async_s * 1e6,
            "async_baseline_median_us": async_base_s * 1e6,
            "iters": total,
            "ours_p90_us": float(np.percentile(ours, 90)) * 1e6,
            "async_p90_us": float(np.percentile(asynchronous, 90)) * 1e6,
            "baseline_p90_us": float(np.percentile(base, 90)) * 1e6,
            **(stream or {}),
        })
        if runtime.rank == 0:
            print(f"  {size:>10} B: ours {ours_s * 1e6:10.1f} us, async {async_s * 1e6:10.1f} us, "
                  f"mpi4py {base_s * 1e6:10.1f} us", file=sys.stderr, flush=True)
    if runtime.rank == 0:
        out.write_text(json.dumps({"library": MPI.Get_library_version().splitlines()[0].strip(),
                                   "rows": rows}))
    tnt_core.shutdown()
    return 0


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if os.access(local, os.X_OK) else shutil.which("mpiexec")
    if not found:
        raise SystemExit("no mpiexec: pip install 'tnt-comm-mpi[mpich]' or install an MPI")
    return found


def run(args: argparse.Namespace) -> list[dict]:
    """Benchmark ``args.sizes`` (bytes) with ``args.iters`` calls per size and side on
    ``args.nprocs`` ranks (default 2); one row per size."""
    nprocs = int(getattr(args, "nprocs", 2) or 2)
    sizes = [int(s) for s in args.sizes]
    bad = [s for s in sizes if s % 4]
    if bad:
        raise SystemExit(f"sizes must be multiples of 4 bytes (float32 buffers): {bad}")
    with tempfile.TemporaryDirectory(prefix="tnt-bench-mpi-") as tmp:
        out = Path(tmp, "rows.json")
        launcher_vars = {"TNT_RANK", "TNT_SIZE", "TNT_LOCAL_RANK", "TNT_LOCAL_SIZE",
                         "TNT_RENDEZVOUS", "TNT_RENDEZVOUS_KEY"}  # mpiexec assigns ranks
        env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
        env["TNT_BACKEND"] = "mpi"
        env.setdefault("TNT_TIMEOUT_S", "600")
        cmd = [_mpiexec(), "-n", str(nprocs), sys.executable, str(Path(__file__).resolve()),
               "--worker", "--out", str(out), "--iters", str(args.iters),
               "--sizes", ",".join(map(str, sizes))]
        proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, timeout=3600)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"benchmark ranks failed (exit {proc.returncode}): {' '.join(cmd)}")
        report = json.loads(out.read_text())
    print(f"MPI library: {report['library']}; {nprocs} ranks", file=sys.stderr)
    return report["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                        help="LO..HI (powers of two, e.g. 4KiB..256MiB, the default) or a "
                             "comma list of sizes")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per size and side")
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from allreduce import parse_sizes

    try:
        sizes = parse_sizes(str(args.sizes))
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.worker:
        return _worker(sizes, args.iters, args.out)
    args.sizes = sizes
    rows = run(args)
    from allreduce import format_table

    print(format_table(rows, "mpi", EXTRA_COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
