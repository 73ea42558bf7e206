"""A custom training loop against ``fit``: what a user's own ``GradientTape`` loop costs per
step, distributed with ``tnt.DistributedOptimizer`` and ``tnt.distribute_dataset``, next to
``tnt.Model.fit`` on the same model, data and global batch, in the same ranks.

Both run in one job, in alternating rounds (fit, loop, fit, loop, ...) so that the machine's
noise falls on both alike; the first round of each is the warm-up (tracing). Each round
times ``--steps`` steps on rank 0 from the end of its first step to the end of its last.
Printed: the median step time of each, their ratio (loop / fit; the issue's target is
<= 1.10), and the spread of the per-round ratios.

    python benchmarks/custom_loop.py --ranks 2 --model mlp
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import models  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--model", default="mlp", choices=models.ALL_MODELS)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=60, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=6, help="rounds of each, after one warm-up")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def worker(args: argparse.Namespace) -> None:
    """One rank: alternate fit rounds and custom-loop rounds, report rank 0's times."""
    import keras
    import tensorflow as tf

    import tarantella as tnt

    size = tnt.get_size()
    global_batch = args.micro_batch * size
    samples = global_batch * (args.steps + 1)
    x, y = models.synthetic_data(args.model, samples)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    keras.utils.set_random_seed(1)
    fit_model = tnt.Model(models.build(args.model, keras))
    models.compile_for_benchmark(fit_model, keras)

    keras.utils.set_random_seed(1)
    loop_model = models.build(args.model, keras)
    optimizer = tnt.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    tnt.broadcast_variables(loop_model.weights, root_rank=0)
    dataset = tnt.distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, loop_model(xb, training=True))
        grads = tape.gradient(loss, loop_model.trainable_weights)
        optimizer.apply(grads, loop_model.trainable_weights)
        return loss

    class Stamps(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    def fit_round() -> float:
        stamps = Stamps()
        fit_model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
                      callbacks=[stamps])
        return (stamps.times[-1] - stamps.times[0]) / (len(stamps.times) - 1)

    def loop_round() -> float:
        times = []
        for xb, yb in dataset:
            train_step(xb, yb).numpy()  # the step's end, as fit's batch-end callback sees it
            times.append(time.perf_counter())
        return (times[-1] - times[0]) / (len(times) - 1)

    fit_round(), loop_round()  # warm-up: tracing, first allocations
    fit_s, loop_s = [], []
    for _ in range(args.rounds):
        fit_s.append(fit_round())
        loop_s.append(loop_round())
    if tnt.is_master_rank():
        args.worker.write_text(json.dumps({"fit": fit_s, "loop": loop_s, "ranks": size}))


def main() -> int:
    args = parse()
    if args.worker is not None:
        worker(args)
        return 0
    tnt = shutil.which("tnt", path=str(Path(sys.executable).parent)) or "tnt"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [tnt, "run", "-n", str(args.ranks), "-x", "TNT_NUM_THREADS=1"]
        if args.ranks > 1:
            cmd += ["--backend", args.backend]
        cmd += ["--", __file__, "--model", args.model, "--micro-batch", str(args.micro_batch),
                "--steps", str(args.steps), "--rounds", str(args.rounds), "--worker", str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if p.returncode != 0 or not out.exists():
            print(p.stdout[-3000:], p.stderr[-3000:], sep="\n", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    fit_ms = statistics.median(result["fit"]) * 1e3
    loop_ms = statistics.median(result["loop"]) * 1e3
    ratios = [lo / f for f, lo in zip(result["fit"], result["loop"])]
    print(f"{args.model}, {result['ranks']} ranks ({args.backend}), micro-batch "
          f"{args.micro_batch}, {args.rounds} rounds of {args.steps} steps each")
    print(f"  fit          {fit_ms:8.2f} ms/step (median of rounds)")
    print(f"  custom loop  {loop_ms:8.2f} ms/step")
    print(f"  loop / fit   {loop_ms / fit_ms:8.3f}   (per round: "
          f"{min(ratios):.3f} .. {max(ratios):.3f}; target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
