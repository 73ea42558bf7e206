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
* the bound without communication (on unless --no-comm-free): N independent single-rank
  Tarantella-NT processes at once, each held to its own CPU (the same step, no collective);
  the N ranks of a job are held to a CPU each as well (unless --no-pin-ranks);
* the same bound in lockstep (unless --no-lockstep, with the comm-free bound): the N processes
  wait for each other at the end of every step (``throughput_worker.Lockstep``, a shared
  counter, no data): what a synchronous job's waiting for its slowest rank costs before a
  byte moves. With 2 ranks the table also gives the allreduce's own memory traffic at this
  machine's memcpy speed times the share of it two CPUs keep copying at once (measured
  before every run: ``memory_sharing``; the gradients copied into shared memory once, then
  both ranks' copies read and the sum written: 2.5 copies per rank) and what the step could
  reach with nothing else: the lockstep bound's step plus that traffic;
* with --python-path, Tarantella-NT again with TNT_NATIVE_OPS=false (gradients through one
  ``tf.numpy_function`` per bucket instead of the op library): before/after side by side;
* with --one-rank, Tarantella-NT on 1 rank held to one CPU, against Keras held to one CPU;
* with --update-ab, Tarantella-NT on 1 rank (with --one-rank) and on N ranks again with
  ``jit_compile=False``: the optimizer's update as TensorFlow ops, against the default
  (``"auto"``, no XLA for Keras here), where a ``tnt.Model`` compiles the update alone with
  XLA (``tarantella.data_parallel.compiled_update``); printed: compiled / as ops;
* with --shm-copy-ab (gloo), Tarantella-NT on N ranks again with ``TNT_GLOO_SHM_COPY=stream``
  (every copy into the shared-memory slots with non-temporal stores, the way before
  ``auto``), against the default (``auto``: the faster way on the host, timed by each
  rank); printed: auto / stream;
* with --frames, Python frames entered per step on each path (profiled runs, slower);
* with --priority N (root for N < 0), every timed process at nice N in a scheduling
  group of its own (throughput_worker.set_priority), so that other work on a shared
  machine starves the runs less;
* with --xla, every run above again with ``jit_compile=True`` (Keras on one CPU, tnt on 1
  rank, tnt on N ranks, the comm-free bound): Keras compiles its whole step with XLA,
  tnt on N ranks clusters of the step cut at each gradient bucket's allreduce, or with
  --overlap also (``TNT_OVERLAP=false``) the step's body and the optimizer's update as two
  XLA functions, the collectives between them (``tarantella.data_parallel.xla``). Printed:
  tnt 1 rank / Keras, both with XLA on one CPU; N ranks / N x Keras, both with XLA; N
  ranks with / without XLA; with XLA, overlap on / off.

Every configuration runs --repeats times (5 by default) in interleaved rounds, so that a
change of the machine's load hits all of them alike; the table gives the median of each and
then every run's samples/s, the CPU time per step of the process (rank 0 of a job) and the
1-minute load average when it ended: on a shared machine a run starved of CPU shows a long
wall time beside an unchanged CPU time per step.

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
from machine_memory import memcpy_gbps, memory_sharing  # noqa: E402


def ensure_deps(need_mwms: bool) -> None:
    """The benchmark's own set-up: legacy tf-keras (for MWMS). Not matplotlib, which the
    plot wants: Keras imports it at start-up in every process of an environment that has
    it (0.3 s of CPU each, the test suite's ranks too); benchmarks/requirements.txt has it."""
    wanted = []
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
    priority = [] if args.priority is None else ["--priority", str(args.priority)]
    return ["--model", model, "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup),
            "--steps", str(args.steps), *priority]


def _read(out: Path, what: str, procs_output: str) -> dict:
    if not out.exists():
        raise RuntimeError(f"{what} produced no result:\n{procs_output[-4000:]}")
    return json.loads(out.read_text())


def run_keras(args, model: str, tmp: Path, cpus: int = 0, jit: bool = False) -> dict:
    """One plain Keras process (with ``jit``: ``jit_compile=True``)."""
    out = tmp / f"keras-{model}-{cpus}-{jit}.json"
    p = subprocess.run([sys.executable, str(WORKER), "--mode", "keras", *_common(args, model),
                        "--cpus", str(cpus), "--out", str(out)] + (["--jit"] if jit else []),
                       capture_output=True, text=True, timeout=args.timeout)
    return _read(out, "plain keras", p.stdout + p.stderr)


def run_tnt(args, model: str, backend: str, tmp: Path, overlap: bool = True,
            comm_free: bool = False, native: bool = True, ranks: int = 0, cpus: int = 0,
            frames: bool = False, jit: bool = False, update_ops: bool = False,
            shm_copy: str = "") -> dict:
    ranks = ranks or args.ranks
    out = tmp / (f"tnt-{backend}-{model}-{overlap}-{comm_free}-{native}-{ranks}-{cpus}-{frames}-"
                 f"{jit}-{update_ops}-{shm_copy}.json")
    tnt = shutil.which("tnt", path=str(Path(sys.executable).parent)) or "tnt"
    cmd = [tnt, "run", "-n", str(ranks), "-x", "TNT_NUM_THREADS=1",
           "-x", f"TNT_NATIVE_OPS={str(native).lower()}"]
    if ranks > 1:  # one rank runs on the built-in local backend
        cmd[4:4] = ["--backend", backend]
    if shm_copy:
        cmd += ["-x", f"TNT_GLOO_SHM_COPY={shm_copy}"]
    if args.timeline:
        compiled = "+xla" if jit else ""  # one dash-separated field: render_results splits on them
        timeline = args.out_dir / f"timeline-{backend}-{model}{compiled}-overlap{int(overlap)}.json"
        cmd += ["-x", f"TNT_TIMELINE={timeline}"]
    cmd += ["--", str(WORKER), "--mode", "tnt", *_common(args, model), "--out", str(out)]
    if not overlap:
        cmd.append("--no-overlap")
    if comm_free:
        cmd.append("--comm-free")
    if cpus:
        cmd += ["--cpus", str(cpus)]
    elif ranks > 1 and args.pin_ranks:
        cmd += ["--pin-local-rank"]
    if frames:
        cmd += ["--count-frames"]
    if jit:
        cmd += ["--jit"]
    if update_ops:
        cmd += ["--update-as-ops"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    return _read(out, f"tnt run ({backend})", p.stdout + p.stderr)


def run_independent(args, model: str, tmp: Path, jit: bool = False, lockstep: bool = False) -> dict:
    """The comm-free bound: ``--ranks`` single-rank tnt processes at once, each held to its
    own CPU. The same step as a rank's, with no collective and no waiting for a peer (one
    rank reduces its gradients in the graph); their summed throughput is what N ranks
    could reach with free communication. With ``lockstep``, the processes wait for each
    other at the end of every step (no data): free communication, synchronous steps."""
    procs, outs = [], []
    meeting = tmp / f"lockstep-{model}-{jit}.bin"
    meeting.unlink(missing_ok=True)
    for i in range(args.ranks):
        out = tmp / f"independent-{model}-{i}-{jit}-{lockstep}.json"
        outs.append(out)
        wait = (["--lockstep", str(meeting), "--lockstep-of", str(args.ranks),
                 "--lockstep-index", str(i)] if lockstep else [])
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), "--mode", "tnt", *_common(args, model), "--pin", str(i),
             "--out", str(out)] + (["--jit"] if jit else []) + wait, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("TNT_")}))
    output = "".join(p.communicate(timeout=args.timeout)[0] for p in procs)
    results = [_read(o, "an independent rank", output) for o in outs]
    return {**results[0], "samples_per_s": sum(r["samples_per_s"] for r in results),
            "workers": args.ranks, "independent": [r["samples_per_s"] for r in results]}


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


def configurations(args, model: str, backends: list[str], tmp: Path) -> dict:
    """Every timed configuration of one model: result key -> a function that runs it once."""
    jobs = {"keras": lambda: run_keras(args, model, tmp),
            "keras_1cpu": lambda: run_keras(args, model, tmp, cpus=1)}
    if args.xla:
        jobs["keras_1cpu_xla"] = lambda: run_keras(args, model, tmp, cpus=1, jit=True)
    if args.one_rank:
        for jit, suffix in ((False, ""), (True, "-xla"))[:2 if args.xla else 1]:
            jobs[f"tnt-1-rank-1cpu{suffix}"] = (
                lambda jit=jit: run_tnt(args, model, backends[0], tmp, ranks=1, cpus=1, jit=jit))
        if args.update_ab:
            jobs["tnt-1-rank-1cpu-update-ops"] = (
                lambda: run_tnt(args, model, backends[0], tmp, ranks=1, cpus=1, update_ops=True))
    if args.comm_free:
        jobs["comm-free"] = lambda: run_independent(args, model, tmp)
        if args.lockstep:
            jobs["comm-free-lockstep"] = lambda: run_independent(args, model, tmp, lockstep=True)
        if args.xla:
            jobs["comm-free-xla"] = lambda: run_independent(args, model, tmp, jit=True)
    for backend in backends:
        jobs[f"tnt-{backend}"] = lambda b=backend: run_tnt(args, model, b, tmp)
        if args.xla:
            jobs[f"tnt-{backend}-xla"] = lambda b=backend: run_tnt(args, model, b, tmp, jit=True)
        if args.update_ab:
            jobs[f"tnt-{backend}-update-ops"] = (
                lambda b=backend: run_tnt(args, model, b, tmp, update_ops=True))
        if args.shm_copy_ab and backend == "gloo":
            jobs[f"tnt-{backend}-shm-stream"] = (
                lambda b=backend: run_tnt(args, model, b, tmp, shm_copy="stream"))
        if args.python_path:
            jobs[f"tnt-{backend}-python-path"] = (
                lambda b=backend: run_tnt(args, model, b, tmp, native=False))
        if args.overlap:
            jobs[f"tnt-{backend}-no-overlap"] = (
                lambda b=backend: run_tnt(args, model, b, tmp, overlap=False))
            if args.xla:  # the compiled step cut into clusters at each bucket, or one body
                jobs[f"tnt-{backend}-xla-no-overlap"] = (
                    lambda b=backend: run_tnt(args, model, b, tmp, overlap=False, jit=True))
    if args.vs_mwms:
        jobs["mwms"] = lambda: run_mwms(args, model, tmp)
    return jobs


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def measure_interleaved(jobs: dict, repeats: int, cpus: int) -> dict[str, dict]:
    """Runs every configuration ``repeats`` times in rounds (each round runs each once, the
    order rotated by one per round), so that a change of the machine's load hits every
    configuration alike; returns per key the median samples/s and every sample, each with
    the :func:`memory_sharing` of ``cpus`` CPUs measured just before it."""
    samples: dict[str, list[dict]] = {key: [] for key in jobs}
    keys = list(jobs)
    for round_ in range(repeats):
        for key in keys[round_ % len(keys):] + keys[:round_ % len(keys)]:
            shared = memory_sharing(cpus)
            samples[key].append({**jobs[key](), "memory_shared": shared})
            print(f"  round {round_ + 1}/{repeats} {key:<28} {samples[key][-1]['samples_per_s']:>10.0f} "
                  f"samples/s  (load {samples[key][-1].get('load', float('nan')):.1f}, "
                  f"memory shared {shared:.2f})", flush=True)
    results = {}
    for key, runs in samples.items():
        results[key] = {**runs[0], "samples_per_s": _median([r["samples_per_s"] for r in runs]),
                        "samples": [r["samples_per_s"] for r in runs],
                        "cpu_ms_per_step": _median([r["cpu_ms_per_step"] for r in runs]),
                        "cpu_ms_per_step_samples": [r["cpu_ms_per_step"] for r in runs],
                        "loads": [r["load"] for r in runs],
                        "memory_shared": [r["memory_shared"] for r in runs]}
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(models.MODELS))
    p.add_argument("--backends", default="gloo")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of every configuration, interleaved in rounds; the median is reported")
    p.add_argument("--vs-mwms", action="store_true")
    p.add_argument("--overlap", action="store_true", help="also run with overlap off")
    p.add_argument("--comm-free", action=argparse.BooleanOptionalAction, default=True,
                   help="the bound without communication: N independent single-rank processes, "
                        "each held to its own CPU (on by default)")
    p.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                   help="with --comm-free, also the comm-free bound in lockstep: the processes "
                        "wait for each other at every step (on by default)")
    p.add_argument("--pin-ranks", action=argparse.BooleanOptionalAction, default=True,
                   help="hold each rank of an N-rank job to the CPU of its local rank, as the "
                        "comm-free bound's processes are (on by default)")
    p.add_argument("--python-path", action="store_true",
                   help="also run with TNT_NATIVE_OPS=false (the numpy_function path): before/after")
    p.add_argument("--one-rank", action="store_true",
                   help="also run tnt on 1 rank held to one CPU, against Keras held to one CPU")
    p.add_argument("--xla", action="store_true",
                   help="also run Keras on 1 CPU, tnt (N ranks; with --one-rank 1 rank; with "
                        "--comm-free the bound) with jit_compile=True")
    p.add_argument("--update-ab", action="store_true",
                   help="also run tnt with its optimizer update as TensorFlow ops (jit_compile=False)")
    p.add_argument("--shm-copy-ab", action="store_true",
                   help="gloo: also run tnt with TNT_GLOO_SHM_COPY=stream (non-temporal stores "
                        "into the shared-memory slots) beside the default (auto)")
    p.add_argument("--frames", action="store_true",
                   help="also count Python frames per step, native and Python paths (slow runs)")
    p.add_argument("--timeline", action="store_true", help="write TNT_TIMELINE traces to --out-dir")
    p.add_argument("--priority", type=int, default=None,
                   help="every timed process (each rank too) at this nice value, in a scheduling "
                        "group of its own (negative: root only): on a shared machine, -10 keeps "
                        "the other work from starving the runs")
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
            print(f"{model}: {args.repeats} interleaved rounds", flush=True)
            row = {"model": model, "ranks": args.ranks, "micro_batch": args.micro_batch,
                   "repeats": args.repeats,
                   **measure_interleaved(configurations(args, model, backends, tmp), args.repeats,
                                         args.ranks)}
            base = row["keras"]["samples_per_s"]
            base_1cpu = row["keras_1cpu"]["samples_per_s"]
            for key, r in row.items():
                if not isinstance(r, dict) or key.startswith("keras"):
                    continue
                if key.startswith("tnt-1-rank"):  # one rank against one Keras process
                    xla_base = row.get("keras_1cpu_xla", row["keras_1cpu"])["samples_per_s"]
                    r["efficiency"] = r["efficiency_1cpu"] = r["samples_per_s"] / (
                        xla_base if key.endswith("-xla") else base_1cpu)
                    continue
                r["efficiency"] = r["samples_per_s"] / (args.ranks * base)
                r["efficiency_1cpu"] = r["samples_per_s"] / (args.ranks * base_1cpu)
            row["memcpy_gbps"] = memcpy_gbps(4 * row["keras"]["params"])
            for backend in backends:
                if args.frames:
                    for native in (True, False):
                        r = run_tnt(args, model, backend, tmp, native=native, frames=True)
                        path = "native" if native else "python"
                        row.setdefault("frames_per_step", {})[f"{backend}-{path}"] = r["frames_per_step"]
                if args.vs_mwms:
                    tnt_row = row[f"tnt-{backend}"]
                    tnt_row["vs_mwms"] = tnt_row["samples_per_s"] / row["mwms"]["samples_per_s"]
            results.append(row)
            print_row(row, backends, args)
    (args.out_dir / "scaling.json").write_text(json.dumps(results, indent=1))
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwrote {args.out_dir / 'scaling.json'} (no plot: matplotlib is not installed; "
              "pip install -r benchmarks/requirements.txt)")
    else:
        plot(results, args.out_dir / "scaling.png")
        print(f"\nwrote {args.out_dir / 'scaling.json'} and {args.out_dir / 'scaling.png'}")
    return 0


def print_row(row: dict, backends: list[str], args) -> None:
    print(f"\n{row['model']} ({row['keras']['params']:,} params), {args.ranks} ranks, "
          f"micro-batch {args.micro_batch}; medians of {row['repeats']} interleaved runs, then every "
          "run: samples/s, CPU ms per step (the process, rank 0 of a job), 1-minute load average, "
          f"and the memory bandwidth {args.ranks} CPUs copying at once keep (memory_sharing)")

    def samples(r: dict) -> None:
        print(f"  {'':<28} runs {' '.join(f'{v:.0f}' for v in r['samples'])};"
              f"  CPU ms/step {' '.join(f'{v:.2f}' for v in r['cpu_ms_per_step_samples'])};"
              f"  load {' '.join(f'{v:.1f}' for v in r['loads'])};"
              f"  memory shared {' '.join(f'{v:.2f}' for v in r['memory_shared'])}")

    for key, label in (("keras", "keras, 1 process"), ("keras_1cpu", "keras, 1 process on 1 CPU"),
                       ("keras_1cpu_xla", "keras, on 1 CPU, with XLA")):
        if key in row:
            print(f"  {label:<28} {row[key]['samples_per_s']:>10.0f} samples/s")
            samples(row[key])
    for key, r in row.items():
        if not isinstance(r, dict) or key.startswith("keras") or "efficiency" not in r:
            continue
        extra = f"  efficiency {r['efficiency']:.2f} (1-CPU baseline: {r['efficiency_1cpu']:.2f})"
        if "vs_mwms" in r:
            extra += f"  ours/MWMS {r['vs_mwms']:.2f}x"
        print(f"  {key:<28} {r['samples_per_s']:>10.0f} samples/s{extra}")
        samples(r)
    for backend in backends:
        off = row.get(f"tnt-{backend}-no-overlap")
        if off:
            ratio = row[f"tnt-{backend}"]["samples_per_s"] / off["samples_per_s"]
            print(f"  overlap on/off ({backend}): {ratio:.2f}x")
    base_1cpu = row["keras_1cpu"]["samples_per_s"]
    print("  targets:")
    if "tnt-1-rank-1cpu" in row:
        one = row["tnt-1-rank-1cpu"]["samples_per_s"]
        print(f"    tnt 1 rank / Keras, both on 1 CPU: {one / base_1cpu:.2f}")
        ops = row.get("tnt-1-rank-1cpu-update-ops")
        if ops:
            print(f"    tnt 1 rank, update compiled / as ops: {one / ops['samples_per_s']:.2f} "
                  f"(as ops / Keras on 1 CPU: {ops['samples_per_s'] / base_1cpu:.2f})")
    free = row.get("comm-free")
    if free:
        print(f"    {args.ranks} ranks comm-free / {args.ranks}x Keras on 1 CPU: "
              f"{free['samples_per_s'] / (args.ranks * base_1cpu):.2f}")
    lockstep = row.get("comm-free-lockstep")
    traffic_ms = None

    def step_ms(key: str) -> float:  # one step of an N-rank row (N x micro-batch samples)
        return 1e3 * args.ranks * args.micro_batch / row[key]["samples_per_s"]

    if lockstep:
        print(f"    {args.ranks} ranks comm-free in lockstep / {args.ranks}x Keras on 1 CPU: "
              f"{lockstep['samples_per_s'] / (args.ranks * base_1cpu):.2f} (in lockstep / "
              f"free: {lockstep['samples_per_s'] / free['samples_per_s']:.2f}, what waiting for "
              "the slowest rank costs)")
        if args.ranks == 2:
            # one copy into shared memory, then the sum: both copies read, the sum written;
            # both ranks copy at once, at the share of the bandwidth the job's runs measured
            shared = _median(row[f"tnt-{backends[0]}"]["memory_shared"])
            shared = shared if 0 < shared <= 1 else 1.0
            gbps = row["memcpy_gbps"] * shared
            traffic_ms = 2.5 * 4 * row["keras"]["params"] / gbps / 1e6
            synced = step_ms("comm-free-lockstep")
            reach = lockstep["samples_per_s"] * synced / (synced + traffic_ms)
            print(f"    the allreduce's memory traffic: {traffic_ms:.3f} ms per step (2.5 copies of "
                  f"the gradients at {gbps:.1f} GB/s: memcpy x the {shared:.2f} memory sharing of "
                  f"the {backends[0]} runs) on a {synced:.2f} ms lockstep step: at most "
                  f"{reach / (args.ranks * base_1cpu):.2f} of {args.ranks}x Keras on 1 CPU")
    for backend in backends:
        ours = row[f"tnt-{backend}"]["samples_per_s"]
        print(f"    {backend}: {args.ranks} ranks / {args.ranks}x Keras on 1 CPU: "
              f"{ours / (args.ranks * base_1cpu):.2f}")
        ops = row.get(f"tnt-{backend}-update-ops")
        if ops:
            print(f"    {backend}: {args.ranks} ranks, update compiled / as ops: "
                  f"{ours / ops['samples_per_s']:.2f} (as ops / {args.ranks}x Keras on 1 CPU: "
                  f"{ops['samples_per_s'] / (args.ranks * base_1cpu):.2f})")
        stream = row.get(f"tnt-{backend}-shm-stream")
        if stream:
            print(f"    {backend}: shared-memory copies auto / stream: "
                  f"{ours / stream['samples_per_s']:.2f} (stream / {args.ranks}x Keras on 1 CPU: "
                  f"{stream['samples_per_s'] / (args.ranks * base_1cpu):.2f})")
        if free:
            print(f"    {backend}: with communication / comm-free: {ours / free['samples_per_s']:.2f}")
        if lockstep:
            print(f"    {backend}: with communication / comm-free in lockstep: "
                  f"{ours / lockstep['samples_per_s']:.2f} (step {step_ms(f'tnt-{backend}'):.2f} ms "
                  f"against {step_ms('comm-free-lockstep'):.2f} ms"
                  + (f"; the allreduce's traffic {traffic_ms:.2f} ms of it)" if traffic_ms else ")"))
        py = row.get(f"tnt-{backend}-python-path")
        if py:
            print(f"    {backend}: native path / Python path: {ours / py['samples_per_s']:.2f}")
        if "mwms" in row:
            print(f"    {backend}: ours / MWMS: {ours / row['mwms']['samples_per_s']:.2f}")
    if "keras_1cpu_xla" in row:
        xla_1cpu = row["keras_1cpu_xla"]["samples_per_s"]
        print(f"    Keras with XLA / without, both on 1 CPU: {xla_1cpu / base_1cpu:.2f}")
        print(f"  XLA (keras with XLA on 1 CPU: {xla_1cpu:.0f} samples/s):")
        if "tnt-1-rank-1cpu-xla" in row:
            one = row["tnt-1-rank-1cpu-xla"]["samples_per_s"]
            print(f"    tnt 1 rank with XLA / Keras with XLA, both on 1 CPU: {one / xla_1cpu:.2f}")
        free_xla = row.get("comm-free-xla")
        if free_xla:
            print(f"    {args.ranks} ranks comm-free with XLA / {args.ranks}x Keras with XLA on 1 CPU: "
                  f"{free_xla['samples_per_s'] / (args.ranks * xla_1cpu):.2f}")
        for backend in backends:
            with_xla = row.get(f"tnt-{backend}-xla")
            if with_xla:
                ours = with_xla["samples_per_s"]
                print(f"    {backend}: {args.ranks} ranks with XLA / {args.ranks}x Keras with XLA "
                      f"on 1 CPU: {ours / (args.ranks * xla_1cpu):.2f}")
                print(f"    {backend}: {args.ranks} ranks with XLA / without: "
                      f"{ours / row[f'tnt-{backend}']['samples_per_s']:.2f}")
                if free_xla:
                    print(f"    {backend}: with XLA, with communication / comm-free: "
                          f"{ours / free_xla['samples_per_s']:.2f}")
                body = row.get(f"tnt-{backend}-xla-no-overlap")
                if body:
                    print(f"    {backend}: with XLA, overlap on (clusters cut at the buckets) / "
                          f"off (one compiled body): {ours / body['samples_per_s']:.2f}")
    grad_bytes = 4 * row["keras"]["params"]
    print(f"  context: {grad_bytes / 1e6:.2f} MB of float32 gradients; memcpy {row['memcpy_gbps']:.1f} GB/s "
          f"here, so one copy of them takes {grad_bytes / row['memcpy_gbps'] / 1e6:.3f} ms")
    for key, value in row.get("frames_per_step", {}).items():
        print(f"  Python frames per step ({key}): {value:.0f}")


if __name__ == "__main__":
    raise SystemExit(main())
