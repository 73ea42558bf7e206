"""Fusion threshold sweep: Tarantella-NT throughput per TNT_FUSION_THRESHOLD_KB.

For every model (models.py) and backend it trains with ``tnt run -n N --backend B`` once per
threshold (same micro-batch, 1 intra-op thread per rank, overlap on) and reports samples/s,
and each threshold's throughput relative to the best one of its (model, backend). Thresholds
are run interleaved in ``--reps`` rounds (the median is reported), so a change of the
machine's load hits every threshold alike.

    python benchmarks/fusion_sweep.py --backends gloo,mpi --out-dir docs/_static/benchmarks

Writes ``fusion_sweep.json`` to --out-dir; ``render_results.py`` turns it into a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "throughput_worker.py"
sys.path.insert(0, str(HERE))
import models  # noqa: E402

DEFAULT_THRESHOLDS = "0,8,32,128,512,2048,8192"


def run_one(args, model: str, backend: str, threshold_kb: int, out: Path) -> float:
    tnt = shutil.which("tnt", path=str(Path(sys.executable).parent)) or "tnt"
    cmd = [tnt, "run", "-n", str(args.ranks), "--backend", backend, "-x", "TNT_NUM_THREADS=1",
           "-x", f"TNT_FUSION_THRESHOLD_KB={threshold_kb}", "--", str(WORKER), "--mode", "tnt",
           "--model", model, "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
           "--steps", str(args.steps_for(model)), "--out", str(out)]
    out.unlink(missing_ok=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if not out.exists():
        raise RuntimeError(f"{model} on {backend}, threshold {threshold_kb} KB failed:\n"
                           f"{(p.stdout + p.stderr)[-4000:]}")
    return json.loads(out.read_text())["samples_per_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(models.MODELS))
    p.add_argument("--backends", default="gloo,mpi")
    p.add_argument("--thresholds-kb", default=DEFAULT_THRESHOLDS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=60, help="timed steps (mlp: 4x as many)")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = p.parse_args()
    args.steps_for = lambda model: args.steps * (4 if model == "mlp" else 1)
    thresholds = [int(t) for t in args.thresholds_kb.split(",")]
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        for model in args.models.split(","):
            for backend in [b for b in args.backends.split(",") if b]:
                samples: dict[int, list[float]] = {t: [] for t in thresholds}
                for _ in range(args.reps):
                    for t in thresholds:
                        samples[t].append(run_one(args, model, backend, t, out))
                med = {t: statistics.median(v) for t, v in samples.items()}
                best = max(med.values())
                row = {"model": model, "backend": backend, "ranks": args.ranks,
                       "micro_batch": args.micro_batch,
                       "samples_per_s": {str(t): med[t] for t in thresholds},
                       "all_runs": {str(t): samples[t] for t in thresholds},
                       "relative_to_best": {str(t): med[t] / best for t in thresholds}}
                rows.append(row)
                print(f"{model:<9} {backend:<5} " + "  ".join(
                    f"{t}KB {med[t]:.0f} ({med[t] / best:.2f})" for t in thresholds), flush=True)
    result = {"thresholds_kb": thresholds, "rows": rows}
    (args.out_dir / "fusion_sweep.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out_dir / 'fusion_sweep.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
