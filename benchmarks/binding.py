"""Ranks bound to cores of their own against ranks left to the scheduler, side by side.

``tnt run`` binds each rank of a host to cores of its own (``--bind-to core``, its default;
``tnt_cli.devices.rank_cpus``). This runs the same jobs of ``--ranks`` ranks under
``--bind-to core`` and ``--bind-to none`` in interleaved rounds (the order alternating, so
that a drift of the machine hits both alike):

* ``data``: the data-parallel benchmark ``mlp`` (``throughput_worker.py``, which here holds
  no rank to a CPU itself: the launcher's binding is what differs);
* ``pipe SCHEDULE``: a 2-stage pipeline of ``pipeline.py``'s MLP (6 Dense layers of 1024,
  global batch 256, 4 micro-batches, Adam) under each of ``--schedules``.

It prints every sample (samples/s, CPU ms per step of rank 0), the medians, the ratio of the
medians bound / unbound, and before each round how much of its memory bandwidth each CPU
keeps while all copy at once (``machine_memory.memory_sharing``: on the development VM it
changes from minute to minute, and 2-rank figures with it).

    python benchmarks/binding.py [--rounds 3] [--schedules zb-h1,1f1b,gpipe]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine_memory import memory_sharing  # noqa: E402

BINDINGS = ("none", "core")


def pipe_worker(args: argparse.Namespace) -> None:
    """One rank of the pipelined job: warm-up, then ``--repeats`` epochs of ``--steps``
    steps; rank 0 writes the median step and this process's CPU time per step."""
    import keras

    import tarantella as tnt
    from pipeline import build, data

    b = 256
    x, y = data(b * args.steps, 1024, 1024)
    model = tnt.Model(build(keras, 1024, 6, 1024, 1024, True),
                      parallel_strategy=tnt.ParallelStrategy.PIPELINING, num_micro_batches=4,
                      pipeline_schedule=args.schedule)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    model.fit(x[:3 * b], y[:3 * b], batch_size=b, epochs=1, shuffle=False, verbose=0)
    steps: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            steps.append(time.perf_counter() - self.start)

    cpu = time.process_time()
    for _ in range(args.repeats):
        model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    cpu = time.process_time() - cpu
    if tnt.get_rank() == 0:
        step = statistics.median(steps)
        args.out.write_text(json.dumps({"samples_per_s": b / step, "step_ms": step * 1e3,
                                        "cpu_ms_per_step": cpu / len(steps) * 1e3,
                                        "cpus": sorted(os.sched_getaffinity(0))}))


def job(args: argparse.Namespace, kind: str, binding: str, out: Path) -> dict:
    """One ``tnt run`` job of ``kind`` ("data" or "pipe SCHEDULE") under ``binding``."""
    tnt = shutil.which("tnt", path=str(Path(sys.executable).parent)) or "tnt"
    cmd = [tnt, "run", "-n", str(args.ranks), "--backend", args.backend, "--bind-to", binding,
           "--timeout", "120", "--"]
    if kind == "data":
        cmd += [sys.executable, str(HERE / "throughput_worker.py"), "--mode", "tnt", "--model",
                "mlp", "--steps", str(args.data_steps), "--warmup", "50", "--out", str(out)]
    else:
        cmd += [sys.executable, str(Path(__file__).resolve()), "--role", "pipe", "--schedule",
                kind.split()[1], "--steps", str(args.steps), "--repeats", str(args.repeats),
                "--out", str(out)]
    out.unlink(missing_ok=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if not out.exists():
        raise RuntimeError(f"{kind} under --bind-to {binding} wrote no result "
                           f"(exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("parent", "pipe"), default="parent")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--schedules", default="zb-h1,1f1b,gpipe",
                   help="pipeline schedules to run ('' for none)")
    p.add_argument("--schedule", default="zb-h1", help="(worker) this job's schedule")
    p.add_argument("--steps", type=int, default=10, help="pipelined steps per epoch")
    p.add_argument("--repeats", type=int, default=3, help="pipelined epochs timed per job")
    p.add_argument("--data-steps", type=int, default=1500, help="data-parallel timed steps")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.role == "pipe":
        pipe_worker(args)
        return 0
    kinds = ["data"] + [f"pipe {s}" for s in args.schedules.split(",") if s]
    print(f"binding benchmark, {os.cpu_count()} CPUs, {args.ranks} ranks, backend "
          f"{args.backend}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
    samples: dict[tuple[str, str], list[dict]] = {(k, b): [] for k in kinds for b in BINDINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            shared = memory_sharing(args.ranks)
            print(f"round {r + 1}: memory shared {shared:.2f}", flush=True)
            for kind in kinds:
                for binding in BINDINGS if r % 2 == 0 else reversed(BINDINGS):
                    result = job(args, kind, binding, Path(tmp, "result.json"))
                    samples[(kind, binding)].append(result)
                    cpus = result.get("cpus")  # the data job's is its --cpus option
                    where = f" (rank 0 on CPUs {','.join(map(str, cpus))})" \
                        if isinstance(cpus, list) else ""
                    print(f"   {kind:12s} --bind-to {binding:4s} {result['samples_per_s']:9.0f} "
                          f"samples/s, {result['cpu_ms_per_step']:.2f} CPU ms per step{where}",
                          flush=True)
    print(f"\n{'job':14s} {'--bind-to none':>16s} {'--bind-to core':>16s} {'core / none':>12s}"
          "   (medians of samples/s)")
    for kind in kinds:
        med = {b: statistics.median(s["samples_per_s"] for s in samples[(kind, b)]) for b in BINDINGS}
        print(f"{kind:14s} {med['none']:16.0f} {med['core']:16.0f} {med['core'] / med['none']:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
