"""Does the pipeline overlap? A ``TNT_TIMELINE`` trace of a pipelined run, read back.

    python benchmarks/pipeline_timeline.py [--micro-batches 4] [--batch-size 256] [--out DIR]

Runs ``examples/pipelining/pipelined_mlp.py`` for one epoch on 2 ranks with
``TNT_TIMELINE`` set, puts both ranks' traces on one time axis (they share the host's
monotonic clock: each trace says where its zero is), writes the merged trace for
chrome://tracing or Perfetto, and prints, over the training steps:

- how often stage 0 was computing the forward pass of micro-batch k + 1 while stage 1
  was computing on micro-batch k (the pipelining the schedule is for);
- how much of each stage's step time went to computing, to waiting for a neighbour, and
  to the rest (Python, Keras' loop, the metric broadcast).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    origin = next(e["args"]["perf_counter_s"] for e in events if e.get("name") == "clock_origin")
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    out = []
    for e in events:
        if e.get("ph") == "X":
            start = origin + e["ts"] / 1e6
            out.append({**e, "lane": lanes[e["tid"]], "start": start, "end": start + e["dur"] / 1e6})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None, help="where the traces go")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="tnt-pipeline-trace-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TNT_TIMELINE=str(out / "trace.json"), TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    tnt = Path(sys.executable).with_name("tnt")
    subprocess.run([str(tnt), "run", "-n", "2", "--", str(ROOT / "examples/pipelining/pipelined_mlp.py"),
                    "--epochs", "1", "--micro-batches", str(args.micro_batches),
                    "--batch-size", str(args.batch_size)], env=env, check=True, timeout=600,
                   capture_output=True)
    ranks = [load(p) for p in sorted(out.glob("trace*.json")) if p.name != "merged.json"]
    if len(ranks) != 2:
        raise SystemExit(f"expected 2 rank traces in {out}, found {len(ranks)}")
    zero = min(e["start"] for events in ranks for e in events)
    merged = [{**{k: v for k, v in e.items() if k not in ("lane", "start", "end")},
               "ts": round((e["start"] - zero) * 1e6, 3)} for events in ranks for e in events]
    (out / "merged.json").write_text(json.dumps({"traceEvents": merged}))
    stage0, stage1 = ranks
    forward0 = [e for e in stage0 if e["lane"] == "stage 0" and e["name"].startswith("forward")]
    busy1 = [e for e in stage1 if e["lane"] == "stage 1"]
    pairs = overlapping = 0
    for e in forward0:
        k = int(re.search(r"\d+", e["name"]).group())
        if k == 0:
            continue
        pairs += 1
        mine = [b for b in busy1 if b["name"].endswith(f" {k - 1}")]
        if any(b["start"] < e["end"] and e["start"] < b["end"] for b in mine):
            overlapping += 1
    print(f"trace: {out / 'merged.json'} ({args.micro_batches} micro-batches, global batch "
          f"{args.batch_size}, 2 stages)")
    print(f"stage 0's forward of micro-batch k+1 overlapped stage 1's work on k in "
          f"{overlapping} of {pairs} cases")
    for stage, events in enumerate(ranks):
        span = max(e["end"] for e in events) - min(e["start"] for e in events)
        compute = sum(e["dur"] for e in events if e["lane"] == f"stage {stage}") / 1e6
        waits = sum(e["dur"] for e in events if e["lane"] == f"stage {stage}: waits") / 1e6
        print(f"stage {stage}: {span:.2f} s traced: computing {compute / span:.0%}, waiting for a "
              f"neighbour {waits / span:.0%}, the rest {(span - compute - waits) / span:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
