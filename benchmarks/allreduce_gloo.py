"""tnt-comm-gloo's allreduce next to Gloo's own ring allreduce, same buffers, same run.

Used by ``benchmarks/allreduce.py --backend gloo``. Starts ``--nprocs`` ranks (2 by
default) on this host with tnt-core's test launcher. Every rank, for every size:

* ours: ``backend.allreduce_async(buf).wait()`` timed from Python, one call at a time —
  what tnt-keras pays: validation, the hand-off to the C++ worker thread and back, and
  the transport the backend chose: shared memory (the ranks share this host, so with the
  default ``TNT_GLOO_SHM=auto``), or with ``TNT_GLOO_SHM=0`` TCP and the algorithm
  tnt-comm-gloo picks for the size (recursive doubling or bcube for small buffers, the
  ring for large ones). The transport is printed above the table and stored per row
  (``ours_transport``, ``ours_algorithm``);
* baseline: ``gloo::allreduce`` with ``RING`` called directly in a C++ loop on the
  calling thread (``tnt_comm_gloo.benchmark.time_direct_allreduce``), on the same
  context and buffer, timed per call in C++: always Gloo over TCP, whatever ours uses;
* with shared memory, the shared-memory allreduce called directly from C++ too (key
  ``shm_direct_median_us``): what the queue and Python add on top of it;
* ours again, back to back (key ``ours_back_to_back_median_us``): alternating with the
  baseline leaves the ranks as far apart as the TCP ring's last message, which a
  shared-memory allreduce then waits out; back to back the ranks stay in step, as in a
  training step's successive bucket allreduces;
* for sizes up to 4 MiB also Gloo's ``BCUBE`` and tnt-comm-gloo's recursive doubling
  called directly, to place the crossovers (keys ``bcube_median_us``,
  ``doubling_median_us``).

``TNT_GLOO_SHM=0 python benchmarks/allreduce.py --backend gloo ...`` benchmarks the TCP
transport instead (the ranks inherit the environment).

Ours and the baseline alternate call by call so that load from other processes on the
machine hits both alike; medians are reported (and 10th percentiles in the JSON, which
are less exposed to such load). Buffers hold float32 zeros.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SMALL_UP_TO = 4 << 20
BYTES_PER_SIZE = 4 << 30  # cap on the bytes reduced per size and side (large buffers)


def iterations(size: int, iters: int) -> int:
    return max(5, min(iters, BYTES_PER_SIZE // size))


def _median_us(seconds: list[float]) -> float:
    return float(np.median(seconds)) * 1e6


def _worker(sizes: list[int], iters: int, out: Path) -> int:
    import tnt_core
    from tnt_comm_gloo.benchmark import time_direct_allreduce

    runtime = tnt_core.init()
    backend = runtime.backend
    if backend.name != "gloo":
        raise SystemExit(f"expected the gloo backend, got {backend.name!r}")
    transport = backend.allreduce_transport
    if backend.rank == 0:
        why = "" if transport == "shm" else f" ({backend._comm.shm_reason})"
        print(f"ours: tnt-comm-gloo allreduce over {transport}{why}; baseline: Gloo RING "
              f"over TCP; {backend.size} ranks", file=sys.stderr, flush=True)
    rows = []
    for size in sizes:
        buf = np.zeros(size // 4, dtype=np.float32)
        total = iterations(size, iters)
        for _ in range(2):  # warm-up: connections, page faults, caches
            backend.allreduce_async(buf).wait()
        time_direct_allreduce(backend, buf, 2, "ring")
        ours: list[float] = []
        base: list[float] = []
        bcube: list[float] = []
        doubling: list[float] = []
        shm_direct: list[float] = []
        power_of_two = backend.size & (backend.size - 1) == 0
        for _ in range(total):  # one of each in turn: both see the same machine load
            t0 = time.perf_counter()
            backend.allreduce_async(buf).wait()
            ours.append(time.perf_counter() - t0)
            base.extend(time_direct_allreduce(backend, buf, 1, "ring"))
        back_to_back: list[float] = []
        for _ in range(total):
            t0 = time.perf_counter()
            backend.allreduce_async(buf).wait()
            back_to_back.append(time.perf_counter() - t0)
        if transport == "shm":
            time_direct_allreduce(backend, buf, 2, "shm")
            for _ in range(total):
                shm_direct.extend(time_direct_allreduce(backend, buf, 1, "shm"))
        if size <= SMALL_UP_TO:  # the other algorithms, for the crossovers
            for _ in range(total):
                bcube.extend(time_direct_allreduce(backend, buf, 1, "bcube"))
                if power_of_two:
                    doubling.extend(time_direct_allreduce(backend, buf, 1, "doubling"))
        ours_us, base_us = _median_us(ours), _median_us(base)
        row = {
            "size_bytes": size,
            "ours_gbps": size / ours_us / 1e3,
            "baseline_gbps": size / base_us / 1e3,
            "ratio": base_us / ours_us,
            "ours_median_us": ours_us,
            "baseline_median_us": base_us,
            "iters": total,
            "ours_transport": transport,
            "ours_algorithm": ("shm" if transport == "shm"
                               else backend.allreduce_algorithm(size)),
            "ours_p10_us": float(np.percentile(ours, 10)) * 1e6,
            "baseline_p10_us": float(np.percentile(base, 10)) * 1e6,
        }
        # the 10th percentile is less exposed to other processes on a shared machine
        row["ratio_p10"] = row["baseline_p10_us"] / row["ours_p10_us"]
        if bcube:
            row["bcube_median_us"] = _median_us(bcube)
        if doubling:
            row["doubling_median_us"] = _median_us(doubling)
        row["ours_back_to_back_median_us"] = _median_us(back_to_back)
        if shm_direct:
            row["shm_direct_median_us"] = _median_us(shm_direct)
        rows.append(row)
        if backend.rank == 0:
            print(f"{size:>10} B  ours ({transport}) {ours_us:10.1f} us  ring {base_us:10.1f} us"
                  f"  ours back to back {row['ours_back_to_back_median_us']:10.1f} us"
                  + (f"  shm direct {row['shm_direct_median_us']:10.1f} us" if shm_direct else "")
                  + (f"  bcube {row['bcube_median_us']:10.1f} us" if bcube else "")
                  + (f"  doubling {row['doubling_median_us']:10.1f} us" if doubling else ""),
                  file=sys.stderr, flush=True)
    if backend.rank == 0:
        out.write_text(json.dumps(rows))
    tnt_core.shutdown()
    return 0


def run(args: argparse.Namespace) -> list[dict]:
    """Benchmark tnt-comm-gloo against Gloo's ring allreduce; one row per size."""
    from tnt_core.testing import launch_ranks

    with tempfile.TemporaryDirectory(prefix="tnt-bench-gloo-") as tmp:
        out = Path(tmp, "rows.json")
        sizes = ",".join(str(s) for s in args.sizes)
        result = launch_ranks(
            [str(Path(__file__).resolve()), "--worker", "--sizes", sizes,
             "--iters", str(args.iters), "--out", str(out)],
            args.nprocs, backend="gloo", timeout=3600.0, tnt_timeout_s=600.0,
        )
        if not result.ok or not out.exists():
            raise SystemExit("the benchmark ranks failed:\n" + result.describe())
        rows = json.loads(out.read_text())
        if rows:  # above the driver's table: what "gloo" and "baseline" are
            print(f"gloo = tnt-comm-gloo allreduce_async().wait() over {rows[0]['ours_transport']}"
                  "; baseline = Gloo's RING allreduce over TCP called from C++")
        return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of the gloo allreduce benchmark")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return _worker([int(s) for s in args.sizes.split(",")], args.iters, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
