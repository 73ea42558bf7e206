"""Scaling of Tarantella-NT training, measured side by side in one run.

For each model (see models.py) it measures, with the same micro-batch and 1 intra-op
thread per process:

* a plain Keras 3 process (the serial reference, throughput(1)), twice: free to use every
  core, and held to one core (``--cpus 1``). With 1 intra-op thread TensorFlow still runs
  independent ops and the input pipeline on other threads, so the free process uses more
  than one core, while each of N ranks on an N-core machine gets one. Both efficiencies are
  printed; the one-core baseline gives every rank what the single process had;
* Tarantella-NT with N ranks for every backend asked for (global batch = N x micro-batch);
  scaling efficiency = throughput(N) / (N x throughput(1));
* with --vs-mwms, tf.distribute.MultiWorkerMirroredStrategy with N workers (legacy
  tf-keras, installed here on first use) and the ratio ours / theirs;
* with --overlap, Tarantella-NT again with overlap off (every allreduce after backprop);
* with --comm-free, a diagnostic: Tarantella-NT with every gradient allreduce replaced by a
  no-op (the training itself is then wrong), the throughput faster communication could
  reach at best.

Results: a table on stdout, JSON and a PNG plot in --out-dir. Machines are noisy: compare
the ratios of one run, read absolute numbers only as context.

    python benchmarks/scaling.py --ranks 2 --backends gloo,mpi --vs-mwms --overlap
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "throughput_worker.py"
sys.path.insert(0, str(HERE))
import models  # noqa: E402


def ensure_deps(need_mwms: bool) -> None:
    """The benchmark's own set-up: legacy tf-keras (for MWMS) and matplotlib (the plot)."""
    wanted = ["matplotlib"] if importlib.util.find_spec("matplotlib") is None else []
    if need_mwms and importlib.util.find_spec("tf_keras") is None:
        from importlib.metadata import version

        tf_version = ".".join(version("tensorflow").split(".")[:2])
        wanted.append(f"tf-keras=={tf_version}.*")
    if wanted:
        print(f"installing benchmark dependencies: {' '.join(wanted)}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *wanted], check=True)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _common(args, model: str) -> list[str]:
    return ["--model", model, "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
            "--steps", str(args.steps)]


def _read(out: Path, what: str, procs_output: str) -> dict:
    if not out.exists():
        raise RuntimeError(f"{what} produced no result:\n{procs_output[-4000:]}")
    return json.loads(out.read_text())


def run_keras(args, model: str, tmp: Path, cpus: int = 0) -> dict:
    out = tmp / f"keras-{model}-{cpus}.json"
    p = subprocess.run([sys.executable, str(WORKER), "--mode", "keras", *_common(args, model),
                        "--cpus", str(cpus), "--out", str(out)],
                       capture_output=True, text=True, timeout=args.timeout)
    return _read(out, "plain keras", p.stdout + p.stderr)


def run_tnt(args, model: str, backend: str, tmp: Path, overlap: bool = True,
            comm_free: bool = False) -> dict:
    out = tmp / f"tnt-{backend}-{model}-{overlap}-{comm_free}.json"
    tnt = shutil.which("tnt", path=str(Path(sys.executable).parent)) or "tnt"
    cmd = [tnt, "run", "-n", str(args.ranks), "--backend", backend, "-x", "TNT_NUM_THREADS=1"]
    if args.timeline:
        timeline = args.out_dir / f"timeline-{backend}-{model}-overlap{int(overlap)}.json"
        cmd += ["-x", f"TNT_TIMELINE={timeline}"]
    cmd += ["--", str(WORKER), "--mode", "tnt", *_common(args, model), "--out", str(out)]
    if not overlap:
        cmd.append("--no-overlap")
    if comm_free:
        cmd.append("--comm-free")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    return _read(out, f"tnt run ({backend})", p.stdout + p.stderr)


def run_mwms(args, model: str, tmp: Path) -> dict:
    out = tmp / f"mwms-{model}.json"
    workers = [f"127.0.0.1:{p}" for p in free_ports(args.ranks)]
    procs = []
    for i in range(args.ranks):
        env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers},
                                         "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "--mode", "mwms", *_common(args, model),
                                       "--out", str(out)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + args.timeout
    output = ""
    try:
        for p in procs:
            output += p.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return _read(out, "MultiWorkerMirroredStrategy", output)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["model"] for r in results]
    series = {"Keras, 1 process": [r["keras"]["samples_per_s"] for r in results]}
    for r in results:
        for key in r:
            if key.startswith(("tnt-", "mwms")):
                series.setdefault(key, [None] * len(results))
    for i, r in enumerate(results):
        for key in series:
            if key in r:
                series[key][i] = r[key]["samples_per_s"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + k * width for i in range(len(labels))]
        ax.bar(xs, [v or 0 for v in values], width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("samples / s (total)")
    ax.set_title(f"Throughput, {results[0]['ranks']} ranks, micro-batch {results[0]['micro_batch']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(models.MODELS))
    p.add_argument("--backends", default="gloo")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--vs-mwms", action="store_true")
    p.add_argument("--overlap", action="store_true", help="also run with overlap off")
    p.add_argument("--comm-free", action="store_true",
                   help="also run with every allreduce a no-op (diagnostic: the bound without communication)")
    p.add_argument("--timeline", action="store_true", help="write TNT_TIMELINE traces to --out-dir")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = p.parse_args()
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ensure_deps(args.vs_mwms)
    backends = [b for b in args.backends.split(",") if b]
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for model in args.models.split(","):
            row = {"model": model, "ranks": args.ranks, "micro_batch": args.micro_batch}
            row["keras"] = run_keras(args, model, tmp)
            row["keras_1cpu"] = run_keras(args, model, tmp, cpus=1)
            base = row["keras"]["samples_per_s"]
            base_1cpu = row["keras_1cpu"]["samples_per_s"]

            def rate(r: dict, base: float = base, base_1cpu: float = base_1cpu) -> dict:
                r["efficiency"] = r["samples_per_s"] / (args.ranks * base)
                r["efficiency_1cpu"] = r["samples_per_s"] / (args.ranks * base_1cpu)
                return r

            for backend in backends:
                row[f"tnt-{backend}"] = rate(run_tnt(args, model, backend, tmp))
                if args.overlap:
                    row[f"tnt-{backend}-no-overlap"] = rate(run_tnt(args, model, backend, tmp, overlap=False))
                if args.comm_free:
                    row[f"tnt-{backend}-comm-free"] = rate(run_tnt(args, model, backend, tmp, comm_free=True))
            if args.vs_mwms:
                row["mwms"] = rate(run_mwms(args, model, tmp))
                for backend in backends:
                    tnt_row = row[f"tnt-{backend}"]
                    tnt_row["vs_mwms"] = tnt_row["samples_per_s"] / row["mwms"]["samples_per_s"]
            results.append(row)
            print_row(row, backends, args)
    (args.out_dir / "scaling.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out_dir / "scaling.png")
    print(f"\nwrote {args.out_dir / 'scaling.json'} and {args.out_dir / 'scaling.png'}")
    return 0


def print_row(row: dict, backends: list[str], args) -> None:
    base = row["keras"]["samples_per_s"]
    print(f"\n{row['model']} ({row['keras']['params']:,} params), {args.ranks} ranks, "
          f"micro-batch {args.micro_batch}")
    print(f"  {'keras, 1 process':<28} {base:>10.0f} samples/s")
    print(f"  {'keras, 1 process on 1 CPU':<28} {row['keras_1cpu']['samples_per_s']:>10.0f} samples/s")
    for key, r in row.items():
        if not isinstance(r, dict) or key.startswith("keras"):
            continue
        extra = f"  efficiency {r['efficiency']:.2f} (1-CPU baseline: {r['efficiency_1cpu']:.2f})"
        if "vs_mwms" in r:
            extra += f"  ours/MWMS {r['vs_mwms']:.2f}x"
        print(f"  {key:<28} {r['samples_per_s']:>10.0f} samples/s{extra}")
    for backend in backends:
        off = row.get(f"tnt-{backend}-no-overlap")
        if off:
            ratio = row[f"tnt-{backend}"]["samples_per_s"] / off["samples_per_s"]
            print(f"  overlap on/off ({backend}): {ratio:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
