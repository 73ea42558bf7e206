"""A host's link taken down in the middle of an allreduce: how long until the job reacts.

    .venv/bin/python benchmarks/link_down.py [--sizes 2048,4194304,67108864] [--timeout 20]   # as root

On tnt-core's emulated cluster (``tnt_core.testing.cluster``: 2 hosts as network
namespaces, every link limited to ``--rate-mbit`` each way) one rank per host allreduces
``SIZE`` bytes of float32 in a loop (gloo, 1 rank per host: recursive doubling up to 1 MiB,
the ring above). Once both ranks have completed an allreduce, and ``--delay`` seconds
later, host 1's link goes down at the switch (``set_link``): its packets go nowhere,
nothing is refused. Per size, two jobs:

* ``elastic`` (``tnt run --min-np 1``): the seconds from the link going down to rank 0's
  allreduce failing (the new generation aborted the communicator), to ``rejoin()``
  returning, and to rank 0's first allreduce completed alone: when the survivor goes on;
* ``plain``: the seconds from the link going down to ``tnt run``'s exit, and its last line.

What notices the dead link is ``tnt run``'s ssh keep-alive to host 1
(``tnt_cli.launchers.ssh.keepalive_options``: about half of ``--timeout``); the
collectives' own timeout is ``--timeout``. Every case runs ``--repeats`` times; the table
gives each sample.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch import write_results


def worker(size: int, events: Path) -> int:
    import numpy as np

    import tnt_core

    rt = tnt_core.init()
    started_with = rt.size
    log = events / f"rank{rt.rank}.jsonl"

    def note(what: str) -> None:
        with log.open("a") as f:
            f.write(json.dumps({"event": what, "t": time.time(), "size": rt.size}) + "\n")

    x = np.ones(size // 4, dtype=np.float32)
    alone = 0
    while alone < 3:
        x.fill(1.0)
        try:
            rt.backend.allreduce(x)
        except tnt_core.CommError:
            if not rt.config.elastic:
                raise
            note("failed")
            tnt_core.rejoin()
            note("rejoined")
            continue
        if not (x[0] == rt.size and x[-1] == rt.size):
            raise SystemExit(f"rank {rt.rank}: wrong sum {x[0]} with {rt.size} ranks")
        marker = events / f"looping.{rt.rank}"
        if not marker.exists():
            marker.write_text(str(os.getpid()))
        if rt.size < started_with:
            if alone == 0:
                note("went on")
            alone += 1
    tnt_core.shutdown()
    return 0


def run_case(cluster, size: int, elastic: bool, timeout_s: int, delay: float) -> dict:
    from tnt_core.testing.cluster import IFACE, RANK_ENV

    events = cluster.workdir / f"events-{size}-{int(elastic)}-{time.monotonic_ns()}"
    events.mkdir()
    argv = cluster.tnt_run_argv(
        "--backend", "gloo", "--no-gpu", "--timeout", str(timeout_s), "-x", f"TNT_GLOO_IFACE={IFACE}",
        *(["--min-np", "1"] if elastic else []), "--", str(Path(__file__).resolve()),
        "--worker", "--size", str(size), "--events", str(events),
        env=RANK_ENV, cwd=cluster.workdir)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    remote = cluster.hosts[1]
    try:
        deadline = time.monotonic() + 120
        while not all((events / f"looping.{r}").exists() for r in range(2)):
            if proc.poll() is not None or time.monotonic() > deadline:
                _out, err = proc.communicate(timeout=30)
                return {"error": "the ranks did not loop: " + " | ".join(err.splitlines()[-3:])}
            time.sleep(0.02)
        time.sleep(delay)
        cluster.set_link(remote.index, False)
        down = time.time()
        try:
            _out, err = proc.communicate(timeout=timeout_s * 3 + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
            return {"error": f"no end within {timeout_s * 3 + 60} s"}
        ended = time.time()
    finally:
        cluster.set_link(remote.index, True)
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    result: dict = {"exit": proc.returncode, "ended_s": ended - down,
                    "last_line": (err.strip().splitlines() or [""])[-1]}
    log = events / "rank0.jsonl"
    if log.exists():
        for line in log.read_text().splitlines():
            event = json.loads(line)
            result.setdefault(event["event"] + "_s", event["t"] - down)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--events", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=2048, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="2048,4194304,67108864",
                        help="bytes per allreduce, comma-separated (default 2 KiB, 4 MiB, 64 MiB)")
    parser.add_argument("--timeout", type=int, default=20,
                        help="tnt run --timeout, the ranks' TNT_TIMEOUT_S (default 20)")
    parser.add_argument("--rate-mbit", type=float, default=400.0,
                        help="every link's rate in Mbit/s, each way (default 400)")
    parser.add_argument("--delay", type=float, default=0.3,
                        help="seconds between both ranks looping and the link going down")
    parser.add_argument("--repeats", type=int, default=1, help="runs per case (default 1)")
    parser.add_argument("--modes", default="elastic,plain", help="elastic, plain or both")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default in benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.size, args.events)

    from tnt_core.testing.cluster import ClusterUnavailable, EmulatedCluster

    sizes = [int(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    started = time.time()
    load = os.getloadavg()
    rows = []
    try:
        with EmulatedCluster(2, rate_mbit=args.rate_mbit) as cluster:
            for size in sizes:
                for mode in modes:
                    for _ in range(args.repeats):
                        cell = run_case(cluster, size, mode == "elastic", args.timeout, args.delay)
                        cell.update(size=size, mode=mode)
                        rows.append(cell)
                        print(json.dumps(cell), file=sys.stderr, flush=True)
    except ClusterUnavailable as exc:
        raise SystemExit(f"cannot build the emulated cluster: {exc}") from None
    print(f"2 hosts x 1 rank, gloo, links {args.rate_mbit:g} Mbit/s, --timeout {args.timeout}; "
          f"load average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print("seconds after the link went down")
    print()
    print("| size | mode | allreduce failed | rejoined | went on alone | job ended | exit | last line |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def s(key: str, r: dict = r) -> str:
            return f"{r[key]:.1f}" if key in r else "-"
        what = r.get("error") or r["last_line"]
        print(f"| {r['size'] / 1024:g} KiB | {r['mode']} | {s('failed_s')} | {s('rejoined_s')} | "
              f"{s('went on_s')} | {s('ended_s')} | {r.get('exit', '-')} | {what[:160]} |")
    write_results("link_down", started, {"rate_mbit": args.rate_mbit, "timeout_s": args.timeout,
                                         "load_start": load, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
