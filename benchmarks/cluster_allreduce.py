"""A large allreduce across emulated hosts, against the bound the hosts' links set.

    .venv/bin/python benchmarks/cluster_allreduce.py --rate-mbit 400     # as root

Builds an emulated cluster (``tnt_core.testing.cluster``: hosts as network namespaces on
one switch, every link limited to ``--rate-mbit`` in each direction, an sshd and a host
name per host) and, for every layout (hosts × ranks per host), runs this file's worker
through ``tnt run --hostfile ... --launcher ssh --n-per-node K`` once per column. The
ranks of one host share its host name, so each backend sees them as one host's ranks.

Bound: a ring allreduce of n bytes over H hosts needs each host to send 2(H-1)/H·n bytes
(and receive as many) over its link of rate R, so no allreduce takes less than
t_bound = 2(H-1)/H · n / R. The table gives t_bound / t: 1.0 is the link's limit. TCP
over Ethernet (1500-byte MTU) carries at most 1448 payload bytes per 1514 on the wire, so
0.956 is the most a TCP transport can reach. A flat ring of P = H·K ranks whose ranks are
placed host by host crosses each host's link with a full share of 2(P-1)/P·n bytes; the
column "flat limit" is the ratio that caps it at: (H-1)/H ÷ (P-1)/P.

Columns: ``--column LABEL:BACKEND[:NAME=VALUE,...]``, repeatable; the settings go to every
rank with ``-x``. The default is ``gloo:gloo``, ``mpi:mpi`` (MPICH picks the algorithm) and
``mpi tsp_ring:mpi:MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=tsp_ring`` (MPICH's ring; tnt-comm-mpi
calls ``MPI_Iallreduce``). To compare variants of one backend side by side, give a column
each, e.g.
``--column flat:gloo:TNT_GLOO_HIERARCHY=0 --column hierarchical:gloo:TNT_GLOO_HIERARCHY=1``
(a setting ``tnt run`` checks: it must exist in the installed backend).

Each rank times ``--reps`` blocking allreduces of a float32 buffer (after one untimed
warm-up), each started after a barrier; a call's time is the slowest rank's; the median is
reported. Every result is checked (each element equals the number of ranks). Needs root
(see ``cluster_unavailable``); writes the rows as JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from launch import write_results

DEFAULT_LAYOUTS = "2x1,2x2,2x4,3x1,3x2"
#: MPICH's own choice of algorithm, and its ring (which its choice passes over for 3 ranks)
DEFAULT_COLUMNS = ("gloo:gloo", "mpi:mpi", "mpi tsp_ring:mpi:MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=tsp_ring")
RESULT_TAG = "CLUSTER_ALLREDUCE_RESULT "
#: payload bytes of a full TCP segment (timestamps on) per bytes on an Ethernet wire
TCP_PAYLOAD_FRACTION = 1448 / 1514


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``2x1,3x2`` -> [(2, 1), (3, 2)]: hosts × ranks per host."""
    layouts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", part)
        if not match or int(match.group(1)) < 2 or int(match.group(2)) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not HOSTSxRANKS with HOSTS >= 2, e.g. 2x4")
        layouts.append((int(match.group(1)), int(match.group(2))))
    return layouts


def parse_column(text: str) -> tuple[str, str, dict[str, str]]:
    """``LABEL:BACKEND[:NAME=VALUE,...]`` -> (label, backend, settings)."""
    label, _, rest = text.partition(":")
    backend, _, settings_text = rest.partition(":")
    if not label or not re.fullmatch(r"[A-Za-z0-9_]+", backend):
        raise argparse.ArgumentTypeError(f"{text!r}: give LABEL:BACKEND[:NAME=VALUE,...]")
    settings = {}
    for item in filter(None, settings_text.split(",")):
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not NAME=VALUE")
        settings[name] = value
    return label, backend, settings


# -- one rank --------------------------------------------------------------------------

def worker(size: int, reps: int) -> int:
    import numpy as np

    import tnt_core

    runtime = tnt_core.init()
    backend = runtime.backend
    buf = np.ones(size // 4, dtype=np.float32)
    expected = float(backend.size)
    times = []
    for rep in range(reps + 1):  # the first is a warm-up: connections, page faults
        buf.fill(1.0)
        backend.barrier()
        t0 = time.perf_counter()
        backend.allreduce(buf)
        elapsed = time.perf_counter() - t0
        if not (buf[0] == expected and buf[-1] == expected and buf[len(buf) // 3] == expected):
            raise SystemExit(f"rank {backend.rank}: wrong sum {buf[0]}, expected {expected}")
        slowest = backend.allgather(np.array([elapsed])).max()
        if rep:
            times.append(float(slowest))
    if backend.rank == 0:
        info = {"backend": backend.name, "size": backend.size, "times_s": times,
                "transport": getattr(backend, "allreduce_transport", "")}
        print(RESULT_TAG + json.dumps(info), flush=True)
    tnt_core.shutdown()
    return 0


# -- the driver --------------------------------------------------------------------------

def run_job(cluster, hosts: int, per_host: int, backend: str, settings: dict[str, str],
            size: int, reps: int, timeout_s: float) -> dict:
    from tnt_core.testing.cluster import RANK_ENV

    hostfile = cluster.write_hostfile(cluster.workdir / f"hostfile{hosts}", range(hosts))
    argv = cluster.tnt_run_argv(
        "--n-per-node", str(per_host), "--backend", backend, "--timeout", str(int(timeout_s)),
        *(["-x", *(f"{k}={v}" for k, v in settings.items())] if settings else []),
        "--", str(Path(__file__).resolve()), "--worker", "--size", str(size), "--reps", str(reps),
        hostfile=hostfile, env=RANK_ENV, cwd=cluster.workdir)
    started = time.monotonic()
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 60,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout_s + 60:.0f} s"}
    wall = time.monotonic() - started
    found = [line[len(RESULT_TAG):] for line in res.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if res.returncode != 0 or not found:
        tail = (res.stderr.strip() or res.stdout.strip()).splitlines()[-3:]
        return {"error": f"exit {res.returncode}: " + " | ".join(tail)}
    info = json.loads(found[0])
    if info["size"] != hosts * per_host:
        return {"error": f"{info['size']} ranks ran, not {hosts * per_host}"}
    info["median_s"] = sorted(info["times_s"])[len(info["times_s"]) // 2]
    info["job_wall_s"] = wall
    return info


def format_table(rows: list[dict], labels: list[str], size: int, rate_mbit: float) -> str:
    lines = [
        f"{size / 2**20:g} MiB float32 allreduce across emulated hosts, every link "
        f"{rate_mbit:g} Mbit/s each way.",
        "bound: t_bound = 2(H-1)/H·n/R (each host sends 2(H-1)/H·n bytes over its link); "
        "cells: t_bound/t (median time t in s)",
        f"TCP payload at most {TCP_PAYLOAD_FRACTION:.3f} of the wire; flat limit = "
        "(H-1)/H ÷ (P-1)/P, a flat ring's ceiling",
        "",
    ]
    header = "| hosts | ranks/host | ranks | t_bound s | flat limit | " + " | ".join(labels) + " |"
    lines += [header, "|" + "---|" * (5 + len(labels))]
    for row in rows:
        cells = []
        for label in labels:
            cell = row["columns"].get(label, {})
            if "median_s" in cell:
                cells.append(f"{row['bound_s'] / cell['median_s']:.2f} ({cell['median_s']:.2f})")
            else:
                cells.append("failed")
        lines.append(f"| {row['hosts']} | {row['per_host']} | {row['hosts'] * row['per_host']} | "
                     f"{row['bound_s']:.2f} | {row['flat_limit']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate-mbit", type=float, default=400.0,
                        help="every link's rate in Mbit/s, each way (default 400)")
    parser.add_argument("--size", type=int, default=64 << 20, help="bytes (default 64 MiB)")
    parser.add_argument("--reps", type=int, default=3, help="timed allreduces per job (default 3)")
    parser.add_argument("--layouts", type=parse_layouts, default=parse_layouts(DEFAULT_LAYOUTS),
                        help=f"HOSTSxRANKS_PER_HOST, comma-separated (default {DEFAULT_LAYOUTS})")
    parser.add_argument("--column", type=parse_column, action="append", default=None,
                        help="LABEL:BACKEND[:NAME=VALUE,...], repeatable (default: "
                             + ", ".join(DEFAULT_COLUMNS) + ")")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a rank waits for a peer (tnt run --timeout; default 120)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default in benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.size % 4 or args.size <= 0 or args.reps < 1:
        parser.error("--size must be a positive multiple of 4 and --reps at least 1")
    if args.worker:
        return worker(args.size, args.reps)

    from tnt_core.testing.cluster import ClusterUnavailable, EmulatedCluster

    columns = args.column or [parse_column(c) for c in DEFAULT_COLUMNS]
    labels = [label for label, _, _ in columns]
    if len(set(labels)) != len(labels):
        parser.error("give every --column its own label")
    rate_bytes = args.rate_mbit * 1e6 / 8
    started = time.time()
    rows = []
    try:
        with EmulatedCluster(max(h for h, _ in args.layouts), rate_mbit=args.rate_mbit) as cluster:
            for hosts, per_host in args.layouts:
                ranks = hosts * per_host
                row = {"hosts": hosts, "per_host": per_host,
                       "bound_s": 2 * (hosts - 1) / hosts * args.size / rate_bytes,
                       "flat_limit": ((hosts - 1) / hosts) / ((ranks - 1) / ranks), "columns": {}}
                for label, backend, settings in columns:
                    cell = run_job(cluster, hosts, per_host, backend, settings, args.size,
                                   args.reps, args.timeout)
                    row["columns"][label] = cell
                    what = (f"{row['bound_s'] / cell['median_s']:.3f} of the bound, median "
                            f"{cell['median_s']:.2f} s, job {cell['job_wall_s']:.0f} s"
                            if "median_s" in cell else cell["error"])
                    print(f"{hosts} hosts x {per_host} {label}: {what}", file=sys.stderr, flush=True)
                rows.append(row)
    except ClusterUnavailable as exc:
        raise SystemExit(f"cannot build the emulated cluster: {exc}") from None
    print(format_table(rows, labels, args.size, args.rate_mbit))
    write_results("cluster_allreduce", started, {
        "rate_mbit": args.rate_mbit, "size_bytes": args.size, "reps": args.reps,
        "columns": [{"label": lb, "backend": b, "settings": s} for lb, b, s in columns],
        "bound": "2(H-1)/H * size / (rate_mbit * 1e6 / 8) seconds", "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
