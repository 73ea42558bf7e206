"""Elastic recovery time: a rank SIGKILLed, to the first allreduce completed without it.

    python benchmarks/elastic_recovery.py [--repeats 3] [--ranks 3] [--bytes 4194304]

Each repetition runs ``tnt run -n RANKS`` of this script's rank loop (numpy allreduces of
BYTES, no framework). Member 1 SIGKILLs itself at step 20, after writing the time.

* survivors (``--min-np RANKS-1``): kill -> the survivor's allreduce fails (CommError) ->
  ``tnt_core.rejoin()`` returns the new backend -> first allreduce completed on it;
* replacement (``--min-np RANKS-1 --max-restarts 1``): the survivors go on as above; a new
  process of this script joins once its ``tnt_core.init()`` says it is ready, and the
  survivors rebind again (their pause: the collective the join aborted, to the first
  allreduce with the newcomer). The newcomer's phases: process started (before its
  imports), imports done, ``init()`` returned (connected), first allreduce completed. A
  framework's import (TensorFlow: several seconds) adds to the process start;
* replacement, held (``--min-np RANKS --max-restarts 1``): the survivors wait for the
  replacement in ``rejoin()`` (fewer than ``--min-np`` may not go on).

Prints the median and every sample, in seconds after the kill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.time()  # before the imports below: a replacement's process start
KILL_STEP, STEPS = 20, 200
#: the elastic options of each measured case, for RANKS ranks
MODES = {
    "survivors": lambda n: ["--min-np", str(n - 1)],
    "replacement": lambda n: ["--min-np", str(n - 1), "--max-restarts", "1"],
    "replacement, held": lambda n: ["--min-np", str(n), "--max-restarts", "1"],
}


def rank_main(out: Path, nbytes: int) -> None:
    import numpy as np

    import tnt_core

    imported = time.time()
    rt = tnt_core.init()
    inited = time.time()
    me = rt.config.member_id
    x = np.ones(max(1, nbytes // 4), dtype=np.float32)
    step, report = 0, {"member": me, "started": STARTED, "imported": imported, "init": inited}
    rejoins: list[list[float]] = []  # [collective failed, rejoin returned, next allreduce done]
    report["rejoins"] = rejoins
    if rt.membership is not None and rt.rank in rt.membership.joined:
        buf = np.zeros(1, dtype=np.int64)
        rt.backend.broadcast(buf, 0)
        step, report["role"] = int(buf[0]), "replacement"
    while step < STEPS:
        if me == 1 and step == KILL_STEP:
            (out / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            rt.backend.allreduce(x)
        except tnt_core.CommError:
            failed = time.time()
            tnt_core.rejoin(timeout=60)
            rejoins.append([failed, time.time()])
            report.setdefault("role", "survivor")
            if rt.membership is not None and rt.membership.joined:
                buf = np.array([step], dtype=np.int64)
                rt.backend.broadcast(buf, 0)
            continue
        if rejoins and len(rejoins[-1]) == 2:
            rejoins[-1].append(time.time())  # the first allreduce after this rejoin
        if "role" in report and "first" not in report:
            report["first"] = time.time()
        step += 1
        time.sleep(0.05)  # a step's compute: the job lasts long enough for a replacement to join
    (out / f"member{me}.json").write_text(json.dumps(report))


def run_once(mode: str, ranks: int, nbytes: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    options = MODES[mode](ranks)
    tnt = Path(sys.executable).with_name("tnt")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        subprocess.run([str(tnt), "run", "-n", str(ranks), *options, "--", __file__,
                        "--rank-main", "--out", tmp, "--bytes", str(nbytes)],
                       env=env, check=True, timeout=300, stdout=subprocess.DEVNULL)
        killed = float((out / "killed").read_text())
        reports = [json.loads(p.read_text()) for p in sorted(out.glob("member*.json"))]
    for r in reports:
        for key in ("started", "imported", "init", "first"):
            if key in r:
                r[key] -= killed
        r["rejoins"] = [[t - killed for t in times] for times in r["rejoins"]]
    return [r for r in reports if "role" in r]


def _line(name: str, samples: list[float]) -> str:
    listed = ", ".join(f"{s:.3f}" for s in samples)
    return f"  {name:<34} median {statistics.median(samples):7.3f} s   samples [{listed}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=4 << 20, help="allreduce size (default 4 MiB)")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(Path(args.out), args.bytes)
        return
    print(f"elastic recovery, {args.ranks} ranks on this machine, allreduce of {args.bytes} "
          f"bytes, {args.repeats} repetitions (seconds after the SIGKILL)")
    for mode, flags in MODES.items():
        runs = [run_once(mode, args.ranks, args.bytes) for _ in range(args.repeats)]
        survivors = [r for run in runs for r in run if r["role"] == "survivor"]
        print(f"{mode}: tnt run -n {args.ranks} {' '.join(flags(args.ranks))}")
        first = [r["rejoins"][0] for r in survivors]
        print(_line("survivor: collective failed", [t[0] for t in first]))
        print(_line("survivor: rejoin() returned", [t[1] for t in first]))
        print(_line("survivor: first allreduce done", [t[2] for t in first]))
        joins = [r["rejoins"][1] for r in survivors if len(r["rejoins"]) > 1]
        if joins:
            print(_line("survivor: paused by the join", [t[2] - t[0] for t in joins]))
        new = [r for run in runs for r in run if r["role"] == "replacement"]
        if new:
            print(_line("replacement: process started", [r["started"] for r in new]))
            print(_line("replacement: imports done", [r["imported"] for r in new]))
            print(_line("replacement: init() connected", [r["init"] for r in new]))
            print(_line("replacement: first allreduce done", [r["first"] for r in new]))


if __name__ == "__main__":
    main()
