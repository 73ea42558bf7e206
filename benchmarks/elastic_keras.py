"""Elastic Keras training: recovery time of ``fit`` when a rank dies, and what the elastic
mode costs a step that nothing disturbs.

    python benchmarks/elastic_keras.py [--repeats 3] [--ranks 3]

* **recovery** (``tnt run -n RANKS --min-np RANKS-1``): an MLP (784-256-256-10, global batch
  256, float32) trains 60 steps; member 1 writes the time and SIGKILLs itself as step 20
  begins. Seconds after the kill, on the master: the survivor's collective fails, the new
  communicator is bound and the ranks agreed (``tnt_core.rejoin``, one allgather), the
  step redone is complete (Keras traces the step anew for the new communicator: most of
  the time); beside them, the master's median undisturbed step.
* **replacement** (``tnt run -n 2 --min-np 2 --max-restarts 1``): the same training, member
  1 SIGKILLed as step 20 begins; the survivor waits for the replacement, which runs the
  script from the top and joins the running fit. Seconds after the kill: the replacement's
  process started, its TensorFlow and Keras imported (the part of a new TensorFlow
  process's start-up, also given apart: Python start to ``import keras`` done), it joined the
  communicator (``import tarantella`` returned), the master gave it the state, and the
  master's next step complete.
* **pipelined restart** (``tnt run -n 2 --max-restarts 1``, ``--pipelined``): the same MLP
  cut into 2 stages, ``keras.callbacks.BackupAndRestore(save_freq=5)``; member 1 SIGKILLed as
  step 22 begins (the backup written as step 20 began: 2 steps redone). ``tnt run`` ends
  every rank and starts them all again; their fit replays the steps before the backup as
  data and resumes there. Seconds after the kill, on the new master process: it started,
  its TensorFlow and Keras imported (TensorFlow's start-up, also given apart), tarantella
  imported (the communicator bound), the backup loaded at its step (the replay done), and
  the first step complete.
* **pipelined under ALL** (``tnt run -n 4 --max-restarts 1``: 2 stages x 2 pipelines), the
  same kill: the survivors write their copies of the step in flight, and the restarted fit
  resumes at step 22 itself (nothing but the step in flight redone); the same times after
  the kill. Beside it, the cost of keeping those copies: the master's median step before
  the kill against the same fit not elastic (``tnt run -n 4``, no copies), interleaved.
* **steady state**: the same training (5 epochs) on RANKS-1 ranks, elastic (``--min-np``),
  elastic that ranks may join (``--max-restarts 1``: an allreduce of one number before each
  step, where the ranks agree on taking new ranks in) and not elastic, interleaved;
  samples/s of each (the global batch over the median step) and their ratios to the plain
  run (the elastic step takes each global batch whole from the input, splits it on the host
  and keeps a copy of the metric and non-trainable variables).

Prints the median and every sample.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.time()  # before the heavy imports: a process's start-up is measured from here
KILL_STEP, STEPS, BATCH = 20, 60, 256
#: the pipelined restart: the step member 1 dies at, and the backups' interval
PIPELINED_KILL_STEP, SAVE_FREQ = 22, 5


def rank_main(out: Path, kill: bool, epochs: int) -> None:
    import keras  # TensorFlow with it
    import numpy as np

    imported = time.time()
    import tarantella as tnt

    joined = time.time()
    member = int(os.environ.get("TNT_MEMBER_ID", os.environ.get("TNT_RANK", "0")))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 784)).astype("float32")
    y = rng.integers(0, 10, size=(STEPS * BATCH,))
    model = tnt.Model(keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                                        keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    ends: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if kill and member == 1 and batch == KILL_STEP:
                (out / "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.time())

    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, callbacks=[Clock()], verbose=0)
    if "TNT_MEMBER_ID" in os.environ:  # a process started for the running job
        (out / f"joiner-{member}.json").write_text(json.dumps(
            {"started": STARTED, "imported": imported, "joined": joined}))
    if tnt.get_rank() == 0:
        elastic = model._tnt.elastic  # the benchmark reads the loop's clock
        (out / "master.json").write_text(json.dumps(
            {"ends": ends, "events": [] if elastic is None else elastic.events}))


def pipelined_main(out: Path, replicated: bool, kill: bool) -> None:
    """A rank of the pipelined restart, under ALL when ``replicated`` (see the module doc)."""
    import keras  # TensorFlow with it
    import numpy as np

    imported = time.time()
    import tarantella as tnt

    joined = time.time()
    first_run = not (out / "killed").exists()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 784)).astype("float32")
    y = rng.integers(0, 10, size=(STEPS * BATCH,))
    model = tnt.Model(keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                                        keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]),
                      parallel_strategy=tnt.ParallelStrategy.ALL if replicated else
                      tnt.ParallelStrategy.PIPELINING, num_pipeline_stages=2, num_micro_batches=4)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    times: dict[str, float] = {}
    ends: list[float] = []

    class Clock(keras.callbacks.Callback):  # its hooks do not run while the fit replays
        def on_train_batch_begin(self, batch, logs=None):
            times.setdefault("resumed", time.time())
            times.setdefault("resumed_at", batch)
            if kill and first_run and tnt.get_rank() == 1 and batch == PIPELINED_KILL_STEP:
                (out / "killed").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            times.setdefault("first_step", time.time())
            ends.append(time.time())

    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(str(out / "backup"), save_freq=SAVE_FREQ), Clock()])
    if tnt.get_rank() == 0:
        (out / "master.json").write_text(json.dumps(
            {"started": STARTED, "imported": imported, "joined": joined, "ends": ends, **times}))


def launch(args: list[str], out: Path, kill: bool, epochs: int = 1, pipelined: bool = False,
           replicated: bool = False) -> dict:
    tnt = Path(sys.executable).with_name("tnt")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TNT_TIMEOUT_S": "60"}
    cmd = [str(tnt), "run", *args, "--", __file__, "--rank", str(out), "--epochs", str(epochs)] \
        + (["--kill"] if kill else []) + (["--pipelined"] if pipelined else []) \
        + (["--replicated"] if replicated else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((out / "master.json").read_text())


def _line(name: str, samples: list[float], unit: str = "s") -> str:
    shown = ", ".join(f"{s:.3f}" for s in samples)
    return f"  {name:<40} median {statistics.median(samples):8.3f} {unit}   samples [{shown}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--rank", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--pipelined", action="store_true",
                        help="the pipelined restarts alone")
    parser.add_argument("--replicated", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.rank is not None:
        (pipelined_main(options.rank, options.replicated, options.kill) if options.pipelined
         else rank_main(options.rank, options.kill, options.epochs))
        return
    names = ("restarted master process started", "its TensorFlow and Keras imported",
             "tarantella imported (communicator bound)", "state loaded at its step",
             "the master's next step complete", "TensorFlow start-up alone (context)")
    restart: dict[bool, dict[str, list[float]]] = {r: {n: [] for n in names} for r in (False, True)}
    steps: dict[str, list[float]] = {"ALL, elastic (copies kept)": [], "ALL, not elastic": []}
    for _ in range(options.repeats):
        for replicated, ranks in ((False, "2"), (True, "4")):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                master = launch(["-n", ranks, "--max-restarts", "1"], out, kill=True,
                                pipelined=True, replicated=replicated)
                killed = float((out / "killed").read_text())
                at = PIPELINED_KILL_STEP if replicated else PIPELINED_KILL_STEP // SAVE_FREQ * SAVE_FREQ
                assert master["resumed_at"] == at, master
                for name, key in zip(names, ("started", "imported", "joined", "resumed", "first_step")):
                    restart[replicated][name].append(master[key] - killed)
                restart[replicated][names[-1]].append(master["imported"] - master["started"])
        for name, extra in (("ALL, elastic (copies kept)", ["--max-restarts", "1"]),
                            ("ALL, not elastic", [])):
            with tempfile.TemporaryDirectory() as tmp:
                ends = launch(["-n", "4", *extra], Path(tmp), kill=False, pipelined=True,
                              replicated=True)["ends"]
                steps[name].append(statistics.median(
                    [b - a for a, b in itertools.pairwise(ends[5:PIPELINED_KILL_STEP])]))
    for replicated, ranks in ((False, 2), (True, 4)):
        at = PIPELINED_KILL_STEP if replicated else PIPELINED_KILL_STEP // SAVE_FREQ * SAVE_FREQ
        source = "the survivors' copies" if replicated else "the backup"
        print(f"pipelined restart{' under ALL' if replicated else ''}: tnt run -n {ranks} "
              f"--max-restarts 1, 2 stages, BackupAndRestore(save_freq={SAVE_FREQ}), member 1 "
              f"SIGKILLed as step {PIPELINED_KILL_STEP} begins, resumed at step {at} "
              f"({source}; seconds after the kill)")
        for name, samples in restart[replicated].items():
            print(_line(name, samples))
    print("a step of the pipelined fit under ALL on 4 ranks (steps 5-22, interleaved runs)")
    for name, samples in steps.items():
        print(_line(name, samples))
    print(_line("elastic / not elastic", [e / p for e, p in zip(*steps.values())], "x"))
    if options.pipelined:
        print(f"load average (1, 5, 15 min): {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
        return
    n = options.ranks
    failed, agreed, redone, step = [], [], [], []
    joins: dict[str, list[float]] = {name: [] for name in (
        "replacement process started", "its TensorFlow and Keras imported",
        "it joined the communicator", "the master gave it the state",
        "the master's next step complete", "TensorFlow start-up alone (context)")}
    rates: dict[str, list[float]] = {"elastic": [], "elastic, joins": [], "not elastic": []}
    for _ in range(options.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            master = launch(["-n", str(n), "--min-np", str(n - 1)], out, kill=True)
            killed = float((out / "killed").read_text())
            seen, bound = master["events"][0]
            failed.append(seen - killed)
            agreed.append(bound - killed)
            redone.append(next(t for t in master["ends"] if t > bound) - killed)
            gaps = [b - a for a, b in zip(master["ends"], master["ends"][1:])]
            step.append(statistics.median(gaps))
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            master = launch(["-n", "2", "--min-np", "2", "--max-restarts", "1"], out, kill=True)
            killed = float((out / "killed").read_text())
            joiner = json.loads(next(out.glob("joiner-*.json")).read_text())
            _, given = master["events"][0]
            for name, at in zip(joins, (joiner["started"], joiner["imported"], joiner["joined"],
                                        given, next(t for t in master["ends"] if t > given))):
                joins[name].append(at - killed)
            joins["TensorFlow start-up alone (context)"].append(joiner["imported"] - joiner["started"])
        for name, extra in (("elastic", ["--min-np", str(n - 1)]),
                            ("elastic, joins", ["--min-np", str(n - 1), "--max-restarts", "1"]),
                            ("not elastic", [])):
            with tempfile.TemporaryDirectory() as tmp:
                ends = launch(["-n", str(n - 1), *extra], Path(tmp), kill=False, epochs=5)["ends"]
                gaps = [b - a for a, b in itertools.pairwise(ends[5:])]  # after the trace
                rates[name].append(BATCH / statistics.median(gaps))
    print(f"recovery: tnt run -n {n} --min-np {n - 1}, member 1 SIGKILLed as step {KILL_STEP} begins "
          "(seconds after the kill, on the master)")
    print(_line("collective failed", failed))
    print(_line("new communicator bound, ranks agreed", agreed))
    print(_line("the step redone, complete", redone))
    print(_line("an undisturbed step (context)", step))
    print(f"replacement: tnt run -n 2 --min-np 2 --max-restarts 1, member 1 SIGKILLed as step "
          f"{KILL_STEP} begins (seconds after the kill)")
    for name, samples in joins.items():
        print(_line(name, samples))
    print(f"steady state: {n - 1} ranks, samples/s (interleaved runs)")
    for name, samples in rates.items():
        print(_line(name, samples, "/s"))
    for name in ("elastic", "elastic, joins"):
        ratios = [e / p for e, p in zip(rates[name], rates["not elastic"])]
        print(_line(f"{name} / not elastic", ratios, "x"))
    print(f"load average (1, 5, 15 min): {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
