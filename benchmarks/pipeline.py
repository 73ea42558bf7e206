"""Pipelining (``tnt.ParallelStrategy.PIPELINING``) against serial Keras, side by side in one run:
throughput and the bubble, then memory per phase, a model larger than one rank, a memory cap,
activation recomputation.

    python benchmarks/pipeline.py [--backend gloo|mpi] [--batch 256] [--rounds 5] [--no-big]
                                  [--priority N]
                                  [--cap] [--only throughput|memory|recompute|larger]
                                  [--schedules 1f1b,zb-h1,zb-fused,gpipe] [--schedule-micro-batches 4]

Ranks (one per partition, ``tnt run -n S``) against one plain Keras process, on the same
model and the same global batch; about 10 minutes on 2 cores. Machines are noisy: compare
the ratios of one run, read absolute numbers only as context.

**1. Throughput** (``mlp``: ``--layers`` Dense layers of ``--width`` units, one SplitLayer
where the two partitions' compute balances: each layer's forward pass, input gradient and
weight gradient are one matrix product each, and the first layer needs no input gradient,
so for 6 layers the cut goes after layer 3, 8 : 9 products; Adam, MSE). Every configuration
trains ``--warmup`` untimed steps, then ``--rounds`` rounds of ``--steps`` steps (the
configurations of one process take turns in every round); a step is timed from Keras'
``on_train_batch_begin`` to its ``on_train_batch_end``, and the median step gives
samples/s. Rows:

- ``keras fit``: one plain Keras process, ``compile`` defaults (``jit_compile="auto"``,
  XLA here), TensorFlow free to use both cores: the reference (``vs serial`` 1.00);
- ``keras fit, no XLA``, ``keras fit, XLA`` (``jit_compile=True``: Keras' ``"auto"`` leaves
  XLA off on a machine without accelerators) and ``keras fit, eager`` (``run_eagerly=True``):
  the same process and model;
- the same four held to 1 CPU with 1 intra-op thread (``, 1 CPU``; ratio ``vs 1 CPU``,
  against the fastest of the first three): the share of the machine each of the 2 ranks has;
- ``pipeline M=m``: 2 ranks, 1 intra-op thread each (``tnt run``'s default on 2 cores),
  ``m`` micro-batches, the default schedule of ``tnt.Model`` (printed). ``ideal`` is the
  speed-up over one stage's processor that GPipe's bubble allows, ``P * M / (M + P - 1)``,
  with the efficiency ``M / (M + P - 1)`` in brackets (1F1B has the same bubble): compare
  it with ``vs 1 CPU``;
- not in the table: serial Keras on 1 CPU training ``m`` micro-batches of ``batch / m`` per
  optimizer step in one graph (Keras' ``gradient_accumulation_steps`` and
  ``steps_per_execution``), for each ``m``: the compute of the micro-batches with no
  message, whose slope over ``m`` (printed after the table, and per stage) is what smaller
  matrix products and per-micro-batch ops cost by themselves.

**Schedules** (part of 1): the same pipeline at ``--schedule-micro-batches`` (4) under each
of ``--schedules`` (``tnt.Model(pipeline_schedule=...)``: 1F1B, ZB-H1, ZB-fused, GPipe), trained in
the same rounds as the rows above: samples/s against serial Keras on 1 CPU, and ``bound``
and ``of bound`` per schedule, as below. Each rank also times one micro-batch's ``F``,
``B`` and ``W`` on its stage alone (compiled, no message; ``B`` the input gradient, ``W``
the weights', by difference of F, F + B, F + B + W), and each schedule's dry run
(``tarantella.pipeline.schedule.dry_run``) with those times gives its bubble and the best
``of bound`` its order allows (``dry-run of bound``: the busier stage's compute over the
step). The line above the table gives each stage's ``M x (F + B + W)``, the cut's balance
as measured, and ``of passes`` the busier stage's over the step (no optimizer, no
message: where a rank's ``work`` below undercounts its compute, which runs while one of
its receives blocks, this one does not). ``check`` and ``sum`` are the time spent making the
step's ends before the step (the batch check's start, with the checksums, where the loop
makes it) and waiting for the loss's sum (both allreduces over the ranks, started and
waited for inside the step: ``tarantella.pipeline.step_ends``; the sum's wait is part of
``stage`` where the step logs the loss itself). The row ``zb-h1, blocking ends``
(``--no-loop-ab`` skips it and the rows after it) is ZB-H1 with the two as they ran
before, blocking, the check before the step and the sum after it (barriers between
steps), trained in the same rounds; the row ``zb-h1, calls apart`` is ZB-H1 with its loop
as it ran before the step started the check and logged the loss itself (Keras' own eager
step function, the checksums and the loss's tracker as calls of their own: four calls
into TensorFlow a step instead of two); the row
``zb-h1, F ungated`` is ZB-H1 with its forward passes left to the dataflow (each ``F`` not
waiting for the action before it); the row ``zb-h1, W in place`` is ZB-H1 with each ``W``
of its last stage where the schedule places it, the micro-batches' weight gradients added
one by one, as before that stage joined them after its last ``B`` where that holds less
memory (``StageStep._defers_weights``; the dry run of a row whose last stage joined them
runs its ``W`` there too, each timed as one micro-batch's); the row ``zb-fused, update as
TF ops`` is ZB-fused compiled with ``jit_compile=False``, its optimizer's update as
TensorFlow ops instead of one XLA-compiled function. Then the work bound: the shortest
step any schedule could make of the passes and the update ``U`` (each stage's optimizer
update, timed alone as the passes are) with each micro-batch's ``W`` a pass of its own,
messages free: the busiest stage's ``M x (F + B + W) + U`` plus the ``F`` of the stages
before it (its first input), against serial Keras on 1 CPU (a stage that joins its ``W``
into one pass over all micro-batches' rows does less work than that and can pass it;
each row's ``of bound`` is against its own ranks' measured work); once with the
passes timed on every rank at once (as the job runs them) and once with each rank timing
its own alone, held to one CPU while the others wait: their ratio is what the stages cost
each other by computing at the same time. Then ZB-H1's targets (1.35x serial on 1 CPU,
0.90 of its bound), for ZB-H1 and ZB-fused, the memory's sharing before and after the pipelined runs
(``machine_memory.memory_sharing``: on a VM two ranks may get half the bandwidth each), and the
load average.
The ranks run as ``tnt run`` binds them (``--bind-to core``, its default: a CPU each on
a 2-core machine; ``--bind-to none`` leaves them to the scheduler).
``--priority N`` runs every timed process (the serial ones and each rank) at nice ``N``
in a scheduling group of its own, so that other work on a shared machine starves it less
(``benchmarks/throughput_worker.set_priority``).

The columns after ``step`` say where a pipelined step goes, per rank (median ms per step;
``StageStep.train`` is wrapped with a timer, the training is unchanged): ``stage`` is the
time in the stage's own step (one compiled graph: all micro-batches' forward and backward
passes, the optimizer), ``wait`` the part of it blocked on a receive or on its sends'
completion (the bubble and the neighbour's transfer; counted by the step's message ops, in
the op library on the native path), ``work`` = stage - wait (this rank's own compute and
what posting its messages costs), ``loop`` = step - stage (Keras' loop, the check that all ranks
read the same batch, the broadcast of the outputs for the metrics, the loss allreduce).
``bound`` is the throughput if a step cost only the slower rank's ``work`` (no bubble, no
wait, no loop) as a ratio to serial: the compute-only bound. ``of bound`` = measured /
bound: compare it with the efficiency ``M / (M + P - 1)``. The row after the table compares
a rank's work at the smallest M with half the serial step on 1 CPU. The serial processes run
before and again after the pipelined job; each serial row is the faster of the two (a
machine shared with other work only slows a run down), and their ratio is printed.

**2. Memory** (``big``: ``--mem-layers`` Dense layers of ``--mem-width`` units, ``--mem-io``
in and out, Adam; by default 12 x 2048, 50.4 M parameters, 1 micro-batch): one plain Keras process
(``jit_compile=False`` and 1 intra-op thread, as a stage runs; the model built as usual),
then the pipelined model on S = 2 and S = 3 ranks, built without values
(``tnt.deferred_build()``). Each process resets its peak RSS (``/proc/self/clear_refs``
"5") before each phase and reads ``VmHWM`` after it: ``fit`` (``--mem-steps`` steps),
``checkpoint`` (one more epoch through ``ModelCheckpoint(.keras)`` and
``BackupAndRestore``), ``save`` (``model.save(.keras)``). A phase's growth is its peak
over the process's RSS after the imports; the ratio is to serial's growth in the same phase,
against the target 1/S + 0.15 (a rank trains 1/S of the model; the rest is what every
process pays, TensorFlow's own buffers and the batch).

**3. A model larger than one rank** (``--no-big`` skips it): ``--big-layers`` Dense layers
of ``--big-width`` units (by default 72 x 1536, 170 M parameters) on 3 ranks, built without
values, ``--big-micro-batches`` 1 (a stage then holds one gradient of its weights; each
further micro-batch adds the one being accumulated), through the same phases, then
``resume``: the model is deleted (``gc.collect()``; ``released`` is the RSS growth left
after it) and a new model built without values resumes from the backup
(``BackupAndRestore``) and saves again, in the same processes; then ``resume, new job``: a
second job does the same from a copy of the same backup, as a restart after a crash would.
Its weights and Adam state (12 bytes per parameter) are compared with twice the largest
per-rank peak growth of the run (every phase, both resumes), ``seconds`` is the time of
fit, checkpoint, save and resume together, ``save s`` that of ``save`` alone, and
``fit B/param`` is a rank's fit growth per parameter it trains; then a plain Keras process (no ``tnt.Model``;
``tarantella`` imported for its registered ``SplitLayer``) loads the saved file, and the
SHA-256 digests of its weights are compared with ``get_weights()`` of the pipelined model
(and those of the two resumed models with each other). ``--only larger`` runs this part
alone.

**4. Memory cap** (``--cap``): the big model under an address-space limit per process
(``RLIMIT_AS``, what ``ulimit -v`` sets; on each rank for the pipelined job on 2 ranks),
bisected on a ``--cap-step`` MB grid for serial and for the pipeline, every run printed: is
there a cap under which serial training fails and pipelined training succeeds?
``MALLOC_ARENA_MAX=2`` in parts 2 to 5: glibc's per-thread 64 MB arenas would otherwise
decide where threads fail under the cap, more than the model does.

**5. Recomputation** (with ``--only memory`` or ``--only recompute``; ``tnt.Model(recompute=True)``):
``--rc-layers`` blocks of a Dense layer of ``--rc-width`` units with GELU and a
LayerNormalization, cut in the middle, on 2 ranks, batch ``--rc-batch`` in
``--rc-micro-batches`` micro-batches, float32, Adam: for each of ``--rc-schedules``, one job
without and one with recomputation on every stage. Each rank resets its peak RSS before
the first fit (``--rc-steps`` steps, the step traced in it) and reads ``VmHWM`` after it
(``fit``: growth over the RSS after the imports), then again over a second fit (``steps``),
whose steps are timed (``step``: the median, the slower rank's; ``stage``: of it in the
stage's compiled step). The weights after both fits are compared with those of the job
without recomputation (``bitwise``, or the largest relative difference of a weight);
then per schedule the growth recomputation saves per rank, and the step time's cost: in the
job with recomputation, the same model without it fits in turns with it for ``--rc-rounds``
rounds of ``--rc-steps`` steps (after their memory is measured), so that both see the same
load; the ratio of their median steps (the slower rank's) and of each rank's stage time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from machine_memory import memory_sharing  # noqa: E402

P = 2  # pipeline stages = ranks
#: serial Keras on 1 CPU training M micro-batches per optimizer step in one graph
#: (``gradient_accumulation_steps=M``, ``steps_per_execution=M``): the compute of M
#: micro-batches without any message, whose slope over M is the compute's own fixed cost
ACCUMULATED = "keras, accumulated"


# -- the worker side: one process (serial) or one rank (pipeline) ------------------------------

def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, VmSize, VmPeak of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmSize", "VmPeak"):
            out[key] = int(value.split()[0]) * 1024
    return out


def stage_flops(layers: int, cut: int) -> tuple[int, int]:
    """The two stages' compute per sample of ``layers`` equal Dense layers cut before layer
    ``cut``, in matrix products of one layer: each layer's F, B (its input's gradient) and
    W (its weights'), but the first layer's B, which nothing needs."""
    return 3 * cut - 1, 3 * (layers - cut)


def balanced_cut(layers: int) -> int:
    """Where the one SplitLayer goes: before the layer that balances the two stages'
    compute (:func:`stage_flops`), the busier stage as light as it can be."""
    return min(range(1, layers), key=lambda c: (max(stage_flops(layers, c)), abs(c - layers / 2)))


def build(keras: Any, width: int, layers: int, d_in: int, d_out: int, split: bool) -> Any:
    """``layers`` Dense layers, ``d_in -> width -> ... -> d_out``, cut where the two
    stages' compute balances (:func:`balanced_cut`)."""
    keras.utils.set_random_seed(7)
    sizes = [width] * (layers - 1) + [d_out]
    inp = keras.Input((d_in,), name="x")
    h = inp
    for i, units in enumerate(sizes):
        if split and i == balanced_cut(layers):
            import tarantella as tnt

            h = tnt.keras.layers.SplitLayer(name="cut")(h)
        last = i == layers - 1
        h = keras.layers.Dense(units, activation=None if last else "relu", name=f"d{i}")(h)
    return keras.Model(inp, h, name="mlp")


def data(n: int, d_in: int, d_out: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(3)
    return (rng.standard_normal((n, d_in)).astype(np.float32),
            rng.standard_normal((n, d_out)).astype(np.float32))


class Timers:
    """Per-step wall times: the step (Keras' batch callbacks) and, on a pipeline rank, the
    time in ``StageStep.train``, in its blocking receives, and in the loop's two
    collectives around it (the batch check before the step, the loss's sum after it)."""

    PARTS = ("stage", "wait", "check", "sum")

    def __init__(self) -> None:
        self.step: list[float] = []
        self.parts: dict[str, list[float]] = {k: [] for k in self.PARTS}
        self.now: dict[str, float] = dict.fromkeys(self.PARTS, 0.0)
        self._t0 = 0.0

    @property
    def stage(self) -> list[float]:
        return self.parts["stage"]

    @property
    def wait(self) -> list[float]:
        return self.parts["wait"]

    def callback(self, keras: Any) -> Any:
        timers = self

        class _Cb(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                timers.now = dict.fromkeys(timers.PARTS, 0.0)
                timers._t0 = time.perf_counter()

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                timers.step.append(time.perf_counter() - timers._t0)
                for k in timers.PARTS:
                    timers.parts[k].append(timers.now[k])

        return _Cb()

    def reset(self) -> None:
        self.step, self.parts = [], {k: [] for k in self.PARTS}


ACTIVE: list[Timers] = []  # the timers of the model training now (a pipeline rank)


def instrument_stage_step() -> None:
    """Wrap ``StageStep.train`` with a timer, and read the time its receives waited
    (``StageStep.messages.waited``, kept by the step's receive ops); time the pipelined
    model's batch check (its start: ``StepEnds`` made; blocking: :func:`block_step_ends`'s)
    and its loss's sum (the wait: ``StepEnds.loss``; blocking: :func:`block_step_ends`'s);
    behaviour unchanged."""
    from tarantella.pipeline.stage import StageStep
    from tarantella.pipeline.step_ends import StepEnds

    train = StageStep.train

    def timed_train(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0, waited = time.perf_counter(), self.messages.waited
        try:
            return train(self, *args, **kwargs)
        finally:
            if ACTIVE:
                ACTIVE[0].now["stage"] += time.perf_counter() - t0
                ACTIVE[0].now["wait"] += self.messages.waited - waited

    def timed(method: Any, key: str) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                if ACTIVE:
                    ACTIVE[0].now[key] += time.perf_counter() - t0
        return run

    StageStep.train = timed_train  # type: ignore[method-assign]
    StepEnds.__init__ = timed(StepEnds.__init__, "check")  # type: ignore[method-assign]
    StepEnds.loss = timed(StepEnds.loss, "sum")  # type: ignore[method-assign]


def worker_throughput(args: argparse.Namespace) -> None:
    """Serial: three compiles of the model. Pipeline rank: one model per M. Rounds take turns."""
    if args.priority is not None:  # before TensorFlow starts its threads (they inherit it)
        sys.path.insert(0, str(HERE.parent))
        from throughput_worker import set_priority

        set_priority(args.priority)
    if args.role == "serial-1cpu":  # before TensorFlow starts its thread pools
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    import keras
    import tensorflow as tf

    if args.role == "serial-1cpu":
        tf.config.threading.set_intra_op_parallelism_threads(1)

    pipeline = args.role in ("pipe", "pipe-all")
    rank = 0
    if pipeline:
        import tarantella as tnt

        rank = tnt.get_rank()
        instrument_stage_step()
    b, steps = args.batch, args.steps
    x, y = data(b * steps, args.width, args.width)
    configs: dict[str, Any] = {}
    if pipeline:
        every = args.role == "pipe-all"  # ALL: 2 pipelines of P stages, the batch split
        for m in ([args.all_micro_batches] if every else args.micro_batches):
            model = tnt.Model(build(keras, args.width, args.layers, args.width, args.width, True),
                              parallel_strategy=tnt.ParallelStrategy.ALL if every
                              else tnt.ParallelStrategy.PIPELINING, num_micro_batches=m)
            model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
            configs[f"M={m}"] = model
        if not every:  # the schedules side by side at one M (1F1B: the row above, if there)
            m = args.schedule_micro_batches
            for schedule in args.schedules:
                if schedule_key(args, schedule) not in configs:
                    model = tnt.Model(build(keras, args.width, args.layers, args.width, args.width, True),
                                      parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                                      num_micro_batches=m, pipeline_schedule=schedule)
                    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
                    configs[schedule_key(args, schedule)] = model
            if args.loop_ab and "zb-fused" in args.schedules:  # its update as TensorFlow ops
                model = tnt.Model(build(keras, args.width, args.layers, args.width, args.width, True),
                                  parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                                  num_micro_batches=m, pipeline_schedule="zb-fused")
                model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=False)
                configs[schedule_key(args, TF_UPDATE)] = model
            if args.loop_ab and "zb-h1" in args.schedules:  # ZB-H1 as it was, same rounds
                variants = ((BLOCKING, block_step_ends),
                            (SEPARATE, lambda model: separate_calls(keras, model)),
                            (UNGATED, lambda model: ungate_forward_passes(model._tnt.step)),
                            (IN_PLACE, lambda model: keep_weights_in_place(model._tnt.step)))
                for row, before in variants:
                    model = tnt.Model(build(keras, args.width, args.layers, args.width, args.width, True),
                                      parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                                      num_micro_batches=m, pipeline_schedule="zb-h1")
                    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
                    before(model)  # before its step is first traced
                    configs[schedule_key(args, row)] = model
    else:
        for name, kwargs in (("keras fit", {}), ("keras fit, no XLA", {"jit_compile": False}),
                             ("keras fit, XLA", {"jit_compile": True}),
                             ("keras fit, eager", {"run_eagerly": True})):
            model = build(keras, args.width, args.layers, args.width, args.width, False)
            model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", **kwargs)
            configs[name] = model
        if args.role == "serial-1cpu":  # the compute's own cost of M micro-batches, no messages
            for m in args.micro_batches:
                model = build(keras, args.width, args.layers, args.width, args.width, False)
                accumulate = {"gradient_accumulation_steps": m} if m > 1 else {}  # Keras wants >= 2
                model.compile(optimizer=keras.optimizers.Adam(1e-4, **accumulate),
                              loss="mse", jit_compile=False, steps_per_execution=m)
                configs[f"{ACCUMULATED} M={m}"] = model
    timers = {name: Timers() for name in configs}
    def micro(name: str) -> int:  # the fit's batch: a micro-batch for the accumulated rows
        return b // int(name.split("M=")[1]) if name.startswith(ACCUMULATED) else b

    for name, model in configs.items():  # warm-up: tracing, XLA, the optimizer's slots
        ACTIVE[:] = [timers[name]]
        model.fit(x[:b * args.warmup], y[:b * args.warmup], batch_size=micro(name), epochs=1,
                  shuffle=False, verbose=0)
    result: dict[str, Any] = {"rank": rank, "threads": tf.config.threading.get_intra_op_parallelism_threads(),
                              "params": int(next(iter(configs.values())).count_params()), "configs": {}}
    for t in timers.values():
        t.reset()
    for _ in range(args.rounds):
        for name, model in configs.items():
            ACTIVE[:] = [timers[name]]
            model.fit(x, y, batch_size=micro(name), epochs=1, shuffle=False, verbose=0,
                      callbacks=[timers[name].callback(keras)])
    for name, model in configs.items():
        t = timers[name]
        entry: dict[str, Any] = {"step": statistics.median(t.step), "steps": len(t.step)}
        if pipeline:
            work = [s - w for s, w in zip(t.stage, t.wait)]
            loop = [st - s for st, s in zip(t.step, t.stage)]
            entry.update(stage=statistics.median(t.stage), wait=statistics.median(t.wait),
                         work=statistics.median(work), loop=statistics.median(loop),
                         check=statistics.median(t.parts["check"]),
                         sum=statistics.median(t.parts["sum"]),
                         local_params=int(model.local_param_count),
                         schedule=str(model.pipeline_schedule),
                         joined_weights=model._tnt.step.joined_weights)
        else:
            entry["jit_compile"] = bool(model.jit_compile)
        result["configs"][name] = entry
    if args.role == "pipe" and args.schedules:  # F, B and W of this stage, for the dry runs
        step = configs[schedule_key(args, args.schedules[0])]._tnt.step
        result["passes"] = pass_costs(step, x[:b], y[:b], args.schedule_micro_batches)
    Path(args.out, f"{args.role}.rank{rank}.json").write_text(json.dumps(result))


#: the ZB-H1 row whose batch check and loss sum block around the step, as before they
#: were started inside it (``--loop-ab``)
BLOCKING = "zb-h1, blocking ends"


def block_step_ends(model: Any) -> None:
    """``model``'s training step with the batch check before the stage's step and the loss's
    sum after it, each a blocking allreduce (barriers between steps), as the pipelined loop
    ran them before :mod:`tarantella.pipeline.step_ends`: the same training, for the A/B."""

    from tarantella.pipeline.batch_fingerprint import check_same_batch

    def timed(key: str, run: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return run()
        finally:
            if ACTIVE:
                ACTIVE[0].now[key] += time.perf_counter() - t0

    def train_step(data: Any) -> Any:
        state = model._tnt
        x, y, sample_weight, batch = model._tnt_unpack(data)
        timed("check", lambda: check_same_batch(state.reductions(), x, y, batch))
        share = model._tnt_share(batch)
        part = state.step.train(model._tnt_rows(x, share), model._tnt_rows(y, share),
                                model._tnt_rows(sample_weight, share), global_batch=batch)
        loss = timed("sum", lambda: float(state.reductions().allreduce([part])[0]))
        return model._tnt_logs(x, y, sample_weight, batch, 0.0, loss=loss)

    model.train_step = train_step


#: the ZB-H1 row whose loop makes its calls into TensorFlow apart, as before the step made its
#: batch check's start and its logs itself (``--loop-ab``)
SEPARATE = "zb-h1, calls apart"


def separate_calls(keras: Any, model: Any) -> None:
    """``model``'s loop as it ran before the stage's step started the batch check and logged
    the loss itself (``tarantella.pipeline.step_ends``): Keras' own eager step function (the
    batch through an ``Optional`` and the default strategy), the check's checksums and start
    as calls of their own before the stage's step, and the loss's tracker updated and read
    after it: four calls into TensorFlow a step instead of two. The same training, for the A/B."""
    from tarantella.pipeline.batch_fingerprint import checksums
    from tarantella.pipeline.step_ends import StepEnds

    class EagerEnds(StepEnds):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)  # timed as "check" (instrument_stage_step), and so is the start
            t0 = time.perf_counter()
            StepEnds.start_check(self, checksums(self.fingerprinted))
            if ACTIVE:
                ACTIVE[0].now["check"] += time.perf_counter() - t0

        def start_check(self, sums: Any) -> None:
            pass  # started above, before the step

    def train_step(data: Any) -> Any:
        state = model._tnt
        x, y, sample_weight, batch = model._tnt_unpack(data)
        ends = EagerEnds(state.reductions(), x, y, batch)
        share = model._tnt_share(batch)
        with ends.refusing_different_batches():
            state.step.train(model._tnt_rows(x, share), model._tnt_rows(y, share),
                             model._tnt_rows(sample_weight, share), global_batch=batch, ends=ends)
        return model._tnt_logs(x, y, sample_weight, batch, 0.0, loss=ends.loss())

    model.train_step = train_step
    model._tnt.step.log_step = None  # before its first trace: the loop logs
    model.make_train_function = lambda force=False: keras.Model.make_train_function(model, force)


#: the ZB-fused row whose optimizer update runs as TensorFlow ops (``compile(jit_compile=False)``),
#: not as one XLA-compiled function (``--loop-ab``)
TF_UPDATE = "zb-fused, update as TF ops"

#: the ZB-H1 row whose forward passes run as the dataflow allows (``--loop-ab``)
UNGATED = "zb-h1, F ungated"


def ungate_forward_passes(step: Any) -> None:
    """``step``'s forward passes no longer wait for the action before them in the
    schedule (as before they did): the same passes and messages, for the A/B of the gating."""
    from tarantella.pipeline.stage import StageStep

    def forward_pass(k: int, received: Any, x: Any, y: Any, sample_weight: Any, share: float,
                     after: Any = ()) -> Any:
        return StageStep._forward_pass(step, k, received, x, y, sample_weight, share)

    step._forward_pass = forward_pass


#: the ZB-H1 row whose last stage runs each ``W`` where the schedule places it (``--loop-ab``)
IN_PLACE = "zb-h1, W in place"


def keep_weights_in_place(step: Any) -> None:
    """``step``'s last stage no longer joins its ``W`` after its last ``B``
    (``StageStep._defers_weights``), as before: each ``W`` where ZB-H1 places it, the
    micro-batches' weight gradients added up one by one. The same training, for the A/B."""
    step._defers_weights = lambda *args: False


def schedule_key(args: argparse.Namespace, schedule: str) -> str:
    """The config of ``schedule`` at ``--schedule-micro-batches`` (the default schedule's is
    that M's row of the table, when it has one)."""
    m = args.schedule_micro_batches
    return f"M={m}" if schedule == "1f1b" and m in args.micro_batches else f"M={m} {schedule}"


@contextlib.contextmanager
def one_cpu(cpu: int) -> Iterator[None]:
    """Every thread of this process (TensorFlow's pools included) held to CPU ``cpu``,
    and given back its own CPUs after."""
    before: dict[int, set[int]] = {}
    for t in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError):  # the thread ended
            before[t] = os.sched_getaffinity(t)
            os.sched_setaffinity(t, {cpu})
    try:
        yield
    finally:
        for t, cpus in before.items():
            with contextlib.suppress(OSError):  # the thread ended
                os.sched_setaffinity(t, cpus)


def pass_costs(step: Any, x: Any, y: Any, m: int, repeats: int = 30) -> dict[str, float]:
    """Seconds of one micro-batch's F, B and W on this rank's stage, and of the stage's
    optimizer update U, with no message and no other pass beside it: each a compiled
    function, median of ``repeats`` calls, B and W by difference (F; F + B, the weights'
    gradient ops unused and so not run; F + B + W). On the first stage B is empty (no input
    gradient): its whole backward pass is W.

    Timed twice: with the other ranks timing theirs at the same time (the keys as they are:
    what the stages' compute costs while every CPU works, as in the job), and one rank at a
    time while the others wait in a barrier, every thread of the process held to one CPU
    (``alone`` keys; unheld, a rank alone would run a pass's independent products on both
    CPUs): their ratio is what the stages cost each other by computing at once (caches and
    memory bandwidth shared). The update runs on zero gradients after training (its time
    does not depend on them)."""
    import tensorflow as tf

    import tarantella as tnt

    passes, parts, stage = step.passes, step.parts, step.stage
    rows = x.shape[0] // m
    xk = x[:rows] if parts.reads_x(stage) else None
    yk = y[:rows] if step.last else None
    received = [tf.random.normal((rows, *s.shape[1:]), dtype=s.dtype) for s in parts.received[stage]]

    def run(upto: str) -> Any:
        flight = passes.forward(received, xk, yk, None, 1.0 / m, regularise=False)
        made = [*flight.outputs, *([] if flight.loss is None else [flight.loss])]
        if upto == "F":
            return made
        returned = None if step.last else [tf.ones_like(o) for o in flight.outputs]
        seed = None if flight.loss is None else tf.ones_like(flight.loss)
        weights, back = passes.backward_apart(flight, returned, seed)
        return [*made, *(back or [])] if upto == "B" else [*made, *(back or []), *weights.grads]

    zeros = [tf.zeros_like(w) for w in step.weights]

    def update() -> Any:
        step._apply(zeros)  # the stage's own update, as its step runs it (compiled or ops)
        return tf.constant(0)

    fns = {upto: tf.function(lambda upto=upto: run(upto), autograph=False) for upto in "FBW"}
    fns["U"] = tf.function(update, autograph=False)
    for fn in fns.values():
        fn()

    def timed() -> dict[str, float]:
        times: dict[str, list[float]] = {upto: [] for upto in fns}
        for _ in range(repeats):  # in turn: a change of the machine's load hits each alike
            for upto, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[upto].append(time.perf_counter() - start)
        t = {upto: statistics.median(v) for upto, v in times.items()}
        return {"F": t["F"], "B": max(t["B"] - t["F"], 0.0), "W": max(t["W"] - t["B"], 0.0),
                "U": t["U"]}

    barrier = tnt.Barrier()
    barrier()
    together = timed()
    alone: dict[str, float] = {}
    for turn in range(tnt.get_size()):
        barrier()
        if turn == tnt.get_rank():
            cpus = sorted(os.sched_getaffinity(0))
            with one_cpu(cpus[turn % len(cpus)]):
                alone = timed()
    barrier()
    return {**together, **{f"{k} alone": v for k, v in alone.items()}}


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (``/proc/self/clear_refs`` "5"); False
    where the kernel does not allow it (the peaks are then since the process started)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def mem_build(keras: Any, args: argparse.Namespace, stages: int) -> Any:
    """The memory model: ``--mem-layers`` Dense layers of ``--mem-width`` units (``--mem-io``
    in and out), cut into ``stages`` partitions of equal layer counts."""
    keras.utils.set_random_seed(7)
    w, d, n = args.mem_width, args.mem_io, args.mem_layers
    inp = keras.Input((d,), name="x")
    h = inp
    for i in range(n):
        if stages > 1 and i and i % (n // stages) == 0 and i // (n // stages) < stages:
            import tarantella as tnt

            h = tnt.keras.layers.SplitLayer(name=f"cut{i}")(h)
        last = i == n - 1
        h = keras.layers.Dense(d if last else w, activation=None if last else "relu", name=f"d{i}")(h)
    return keras.Model(inp, h, name="big")


def worker_memory(args: argparse.Namespace) -> None:
    """Peak RSS growth per phase (fit; fit through ModelCheckpoint and BackupAndRestore;
    save; with ``--mem-resume`` a new model resuming from the backup in the same process;
    with ``--mem-backup`` only that, from the given backup, in a new job): VmHWM is reset
    before each phase and read after it, the growth is over the RSS after the imports."""
    marks = {"start": proc_status()}
    import keras
    import numpy as np
    import tensorflow as tf

    pipeline = args.role in ("mem-pipe", "mem-resume")
    stages = args.mem_stages if pipeline else 1
    rank = 0
    if pipeline:
        import tarantella as tnt

        rank = tnt.get_rank()
    else:  # the threads of a rank (tnt run gives each of 2 ranks on 2 cores 1 intra-op thread)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    marks["imported"] = proc_status()
    resets = []
    out = Path(args.out) / f"files-{args.role}-{stages}"
    out.mkdir(exist_ok=True)
    d = args.mem_io
    x, y = data(args.mem_batch * args.mem_steps, d, d)
    fit = {"batch_size": args.mem_batch, "shuffle": False, "verbose": 0}

    def make() -> Any:
        if pipeline:
            with tnt.deferred_build():  # no value on any rank until tnt.Model gives them
                model = mem_build(keras, args, stages)
            model = tnt.Model(model, parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                              num_micro_batches=args.mem_micro_batches)
            model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        else:
            model = mem_build(keras, args, 1)
            model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=False)
        return model

    def phase(name: str, run: Any) -> Any:
        resets.append(reset_peak())
        t0 = time.perf_counter()
        result = run()
        marks[name] = {**proc_status(), "seconds": time.perf_counter() - t0}
        return result

    def resume(backup: str) -> Any:
        again = make()  # a new model, built without values, resuming from the backup
        again.fit(x, y, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup)], **fit)
        again.save(str(out / "final.keras"))
        return again

    def digests(model: Any) -> list[str]:
        weights = model.get_weights()  # the explicit gather, after every measurement
        return [hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest() for w in weights]

    if args.mem_backup:  # a new job resumes from another job's backup
        model = phase("resume", lambda: resume(args.mem_backup))
        resumed = {"rank": rank, "params": int(model.count_params()), "digests": digests(model),
                   "local_params": int(model.local_param_count), "stages": stages,
                   "marks": marks, "peaks_reset": all(resets)}
        Path(args.out, f"{args.role}-{stages}.rank{rank}.json").write_text(json.dumps(resumed))
        return

    model = phase("build", make)
    params = int(model.count_params())
    local = int(model.local_param_count) if pipeline else params
    history = phase("fit", lambda: model.fit(x, y, epochs=1, **fit))
    checkpoints = [keras.callbacks.ModelCheckpoint(str(out / "checkpoint.keras")),
                   keras.callbacks.BackupAndRestore(str(out / "backup"), delete_checkpoint=False)]
    phase("checkpoint", lambda: model.fit(x, y, epochs=1, callbacks=checkpoints, **fit))
    phase("save", lambda: model.save(str(out / "saved.keras")))
    result: dict[str, Any] = {"rank": rank, "params": params, "local_params": local,
                              "stages": stages, "loss": float(history.history["loss"][-1])}
    if args.mem_resume:
        del model, checkpoints, history  # (History holds the model)
        gc.collect()
        marks["released"] = proc_status()
        if rank == 0:  # the same backup for a new job (this resume moves it on)
            shutil.copytree(out / "backup", out / "backup-for-new-job")
        result["backup"] = str(out / "backup-for-new-job")
        model = phase("resume", lambda: resume(str(out / "backup")))
        result["final"] = str(out / "final.keras")
        result["digests"] = digests(model)
    result.update(marks=marks, peaks_reset=all(resets),
                  threads=tf.config.threading.get_intra_op_parallelism_threads())
    Path(args.out, f"{args.role}-{stages}.rank{rank}.json").write_text(json.dumps(result))


def rc_build(keras: Any, args: argparse.Namespace) -> Any:
    """The recomputation model: ``--rc-layers`` blocks of a Dense layer of ``--rc-width``
    units with GELU and a LayerNormalization (a transformer's feed-forward blocks: most of
    what a backward pass keeps is their activations, not their weights), cut in the middle."""
    import tarantella as tnt

    keras.utils.set_random_seed(7)
    w, n = args.rc_width, args.rc_layers
    inp = keras.Input((w,), name="x")
    h = inp
    for i in range(n):
        if i == n // 2:
            h = tnt.keras.layers.SplitLayer(name="cut")(h)
        h = keras.layers.Dense(w, activation="gelu", name=f"d{i}")(h)
        h = keras.layers.LayerNormalization(name=f"ln{i}")(h)
    return keras.Model(inp, keras.layers.Dense(w, name="out")(h), name="recompute")


def worker_recompute(args: argparse.Namespace) -> None:
    """One rank of the recomputation experiment: the model pipelined on 2 ranks under
    ``--rc-schedule``, with or without ``recompute``; VmHWM reset before the first fit
    (traced, ``--rc-steps`` steps) and read after it, then ``--rc-steps`` more steps timed.
    With recomputation, the same model without it is then built in the same job, and the
    two fit in turns for ``--rc-rounds`` rounds: their step times under the same load."""
    marks = {"start": proc_status()}
    import keras

    import tarantella as tnt

    instrument_stage_step()
    marks["imported"] = proc_status()
    w = args.rc_width
    x, y = data(args.rc_batch * args.rc_steps, w, w)

    def make(recompute: bool) -> Any:
        made = tnt.Model(rc_build(keras, args), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                         num_micro_batches=args.rc_micro_batches,
                         pipeline_schedule=args.rc_schedule, recompute=recompute)
        made.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        return made

    model = make(bool(args.rc_recompute))
    marks["built"] = proc_status()
    fit = {"batch_size": args.rc_batch, "shuffle": False, "verbose": 0, "epochs": 1}
    reset = reset_peak()
    model.fit(x, y, **fit)
    marks["fit"] = proc_status()
    timers = Timers()
    ACTIVE[:] = [timers]
    reset_peak()
    model.fit(x, y, callbacks=[timers.callback(keras)], **fit)
    marks["steps"] = proc_status()
    result = {"rank": tnt.get_rank(), "local_params": int(model.local_param_count),
              "marks": marks, "peaks_reset": reset, "step": statistics.median(timers.step),
              "stage": statistics.median(timers.stage), "wait": statistics.median(timers.wait)}
    weights = model.get_weights()  # whole-model on every rank: rank 0 writes them
    if result["rank"] == 0:
        import numpy as np

        np.savez(Path(args.out, "weights.npz"), *weights)
    if args.rc_recompute:  # the step time's cost, both models in turns under the same load
        models = {True: model, False: make(False)}
        models[False].fit(x, y, **fit)  # traced
        turns: dict[bool, Timers] = {True: Timers(), False: Timers()}
        for _ in range(args.rc_rounds):
            for recompute, m in models.items():
                ACTIVE[:] = [turns[recompute]]
                m.fit(x, y, callbacks=[turns[recompute].callback(keras)], **fit)
        result["turns"] = {str(r): {"step": statistics.median(t.step),
                                    "stage": statistics.median(t.stage)} for r, t in turns.items()}
    Path(args.out, f"mem-recompute.rank{result['rank']}.json").write_text(json.dumps(result))


def worker_load(args: argparse.Namespace) -> None:
    """Plain Keras loads a saved file (``keras.saving.load_model``, in a process that makes no
    tnt.Model; SplitLayer is a registered Keras layer, so tarantella must be importable, as
    for any custom layer): the digests of its weights."""
    import keras
    import numpy as np

    import tarantella.keras.layers  # noqa: F401 - registers SplitLayer with Keras

    model = keras.saving.load_model(args.load)
    digests = [hashlib.sha256(np.ascontiguousarray(w).tobytes()).hexdigest()
               for w in model.get_weights()]
    Path(args.out, "load.json").write_text(json.dumps({"digests": digests,
                                                       "params": int(model.count_params())}))


# -- the driver ----------------------------------------------------------------------------------

def worker_args(args: argparse.Namespace, role: str, out: Path) -> list[str]:
    return [str(HERE), "--role", role, "--out", str(out), "--batch", str(args.batch),
            "--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--micro-batches", ",".join(map(str, args.micro_batches)),
            "--schedules", ",".join(args.schedules),
            "--schedule-micro-batches", str(args.schedule_micro_batches),
            *([] if args.loop_ab else ["--no-loop-ab"]),
            "--all-micro-batches", str(args.all_micro_batches),
            *([] if args.priority is None else ["--priority", str(args.priority)]),
            "--mem-width", str(args.mem_width), "--mem-layers", str(args.mem_layers),
            "--mem-io", str(args.mem_io), "--mem-batch", str(args.mem_batch),
            "--mem-steps", str(args.mem_steps), "--mem-micro-batches", str(args.mem_micro_batches),
            "--mem-stages", str(args.mem_stages),
            "--rc-width", str(args.rc_width), "--rc-layers", str(args.rc_layers),
            "--rc-batch", str(args.rc_batch), "--rc-micro-batches", str(args.rc_micro_batches),
            "--rc-steps", str(args.rc_steps), "--rc-rounds", str(args.rc_rounds),
            "--rc-schedule", args.rc_schedule,
            "--rc-recompute", str(int(args.rc_recompute)), *(["--mem-resume"] if args.mem_resume else []),
            *(["--mem-backup", args.mem_backup] if args.mem_backup else []),
            *(["--load", args.load] if args.load else [])]


def launch(args: argparse.Namespace, role: str, out: Path, ranks: int,
           as_limit: int | None = None) -> tuple[int, str]:
    """One serial process (``ranks`` 0) or a ``tnt run`` job; returns (exit code, output)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if role.startswith("mem"):
        # glibc reserves 64 MB of address space per thread arena (8 x cores of them): under an
        # address-space cap, those reservations and not the model decide when threads fail
        env["MALLOC_ARENA_MAX"] = "2"
    if ranks:
        tnt = shutil.which("tnt", path=str(Path(sys.executable).parent)) or "tnt"
        cmd = [tnt, "run", "-n", str(ranks), "--backend", args.backend, "--timeout", "120",
               "--bind-to", args.bind_to,
               "--output-on-all-devices", "--", *worker_args(args, role, out)]
    else:
        cmd = [sys.executable, *worker_args(args, role, out)]

    def limit() -> None:
        if as_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))

    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout,
                           preexec_fn=limit)
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, output + f"\n(timed out after {args.timeout} s)"
    return p.returncode, p.stdout + p.stderr


def results(out: Path, role: str, n: int, tag: str = "") -> list[dict]:
    files = [out / f"{role}{tag}.rank{r}.json" for r in range(n)]
    return [json.loads(f.read_text()) for f in files if f.exists()]


def run(args: argparse.Namespace, role: str, out: Path, ranks: int, tag: str = "") -> list[dict]:
    rc, output = launch(args, role, out, ranks)
    got = results(out, role, max(ranks, 1), tag)
    if rc != 0 or len(got) != max(ranks, 1):
        raise SystemExit(f"{role} failed (exit {rc}):\n{output[-4000:]}")
    return got


def mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def print_throughput(args: argparse.Namespace, serial: dict, serial1: dict, ranks: list[dict]) -> None:
    b = args.batch
    base = b / serial["configs"]["keras fit"]["step"]
    base1 = b / best_serial(serial1)
    print(f"\n1. Throughput: mlp, {args.layers} Dense layers of {args.width} units "
          f"({serial['params'] / 1e6:.1f} M params, cut after layer {balanced_cut(args.layers)}), "
          f"global batch {b}, "
          f"Adam, {args.backend}, {P} stages; {args.rounds} rounds x {args.steps} steps, median step")
    schedule = ranks[0]["configs"][f"M={args.micro_batches[0]}"]["schedule"]
    print(f"   serial: 1 process, TensorFlow's default threads (both cores), and held to 1 CPU with 1 "
          f"intra-op thread; pipeline: {P} ranks, {ranks[0]['threads']} intra-op thread each, "
          f"schedule {schedule}")
    print("   ms per step; stage, wait, work, loop per rank: r0 / r1; 'vs 1 CPU': against the "
          "fastest serial row on 1 CPU (compile's default, no XLA, XLA)")
    print(f"{'':26s} {'samples/s':>9s} {'vs serial':>9s} {'vs 1 CPU':>8s} {'ideal (eff.)':>12s} "
          f"{'step':>6s} {'stage':>13s} {'wait':>11s} {'work':>13s} {'loop':>11s} {'bound':>5s} "
          f"{'of bound':>8s}")
    for tag, ser in (("", serial), (", 1 CPU", serial1)):
        for name, c in ser["configs"].items():
            if name.startswith(ACCUMULATED):
                continue
            rate = b / c["step"]
            print(f"{name + tag:26s} {rate:9.0f} {rate / base:9.2f} {rate / base1:8.2f} {'':12s} "
                  f"{c['step'] * 1e3:6.1f}")
    for m in args.micro_batches:
        cs = [r["configs"][f"M={m}"] for r in ranks]
        step = statistics.median([c["step"] for c in cs])
        rate = b / step
        eff = m / (m + P - 1)
        bound = b / max(c["work"] for c in cs)

        def pair(key: str, cs: list[dict] = cs) -> str:
            return " / ".join(f"{c[key] * 1e3:.1f}" for c in cs)

        print(f"{'pipeline M=' + str(m):26s} {rate:9.0f} {rate / base:9.2f} {rate / base1:8.2f} "
              f"{P * eff:5.2f} ({eff:.2f}) {step * 1e3:6.1f} {pair('stage'):>13s} {pair('wait'):>11s} "
              f"{pair('work'):>13s} {pair('loop'):>11s} {bound / base:5.2f} {rate / bound:8.2f}")
    ms = list(args.micro_batches)
    if len(ms) > 1:  # work(M) = compute + M x fixed: the least-squares slope is the fixed cost
        mean_m = statistics.mean(ms)
        slopes = []
        for r in ranks:
            works = [r["configs"][f"M={m}"]["work"] for m in ms]
            mean_w = statistics.mean(works)
            slopes.append(sum((m - mean_m) * (w - mean_w) for m, w in zip(ms, works))
                          / sum((m - mean_m) ** 2 for m in ms))
        print("   fixed cost per extra micro-batch (slope of a rank's work over M): "
              + " / ".join(f"{sl * 1e3:.2f} ms" for sl in slopes))
        steps = [serial1["configs"][f"{ACCUMULATED} M={m}"]["step"] for m in ms]
        mean_s = statistics.mean(steps)
        own = sum((m - mean_m) * (s - mean_s) for m, s in zip(ms, steps)) \
            / sum((m - mean_m) ** 2 for m in ms)
        print(f"   the compute's own cost of micro-batches: serial Keras on 1 CPU, M micro-batches "
              f"of {b}/M accumulated in one graph (no messages), ms per step for M = "
              f"{', '.join(map(str, ms))}: {', '.join(f'{s * 1e3:.1f}' for s in steps)}; slope "
              f"{own * 1e3:.2f} ms per micro-batch, {own * 1e3 / P:.2f} ms per stage")
    half = {name: c["step"] * 1e3 / P for name, c in serial1["configs"].items()}
    m1 = [r["configs"][f"M={args.micro_batches[0]}"] for r in ranks]
    print(f"   half the serial step on 1 CPU: fit {half['keras fit']:.1f} ms, eager "
          f"{half['keras fit, eager']:.1f} ms; a rank's work at M={args.micro_batches[0]}: "
          + " / ".join(f"{c['work'] * 1e3:.1f} ms" for c in m1))


def schedule_module() -> Any:
    """``tarantella.pipeline.schedule``, loaded from its file: it imports neither TensorFlow
    nor the rest of tarantella, which the driver then does not start either."""
    import importlib.util

    found = importlib.util.find_spec("tarantella")
    assert found is not None and found.origin is not None, "tarantella is not installed"
    spec = importlib.util.spec_from_file_location(
        "tnt_pipeline_schedule", Path(found.origin).parent / "pipeline" / "schedule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # for its dataclasses
    spec.loader.exec_module(module)
    return module


def best_serial(serial1: dict) -> float:
    """The step of serial Keras on 1 CPU at its fastest: compile's default, without and
    with XLA (eager excluded)."""
    return min(c["step"] for name, c in serial1["configs"].items()
               if name in ("keras fit", "keras fit, no XLA", "keras fit, XLA"))


def work_bound(costs: list[dict], m: int, suffix: str = "") -> float:
    """The shortest step any schedule can make of these passes: stage ``p`` does all its
    ``M x (F + B + W)`` and its update ``U``, and cannot start before the first micro-batch
    has passed the stages before it (their ``F``); messages free."""
    def at(c: dict, key: str) -> float:
        return c[f"{key}{suffix}"]

    return max(m * (at(c, "F") + at(c, "B") + at(c, "W")) + at(c, "U")
               + sum(at(q, "F") for q in costs[:p]) for p, c in enumerate(costs))


def print_work_bound(costs: list[dict], m: int, serial_step: float) -> None:
    """What the machine allows any schedule, from the passes and updates measured with the
    stages computing at once and one at a time, against serial Keras on 1 CPU: a target
    above the first is beyond this machine, and the two differ by what the CPUs cost each
    other when both compute (the VM's memory bandwidth; ``memory shared`` below)."""
    if "U alone" not in costs[0]:
        return
    together, alone = work_bound(costs, m), work_bound(costs, m, " alone")
    each = "; ".join(
        f"r{i} U {c['U'] * 1e3:.1f} ms, F+B+W together / alone "
        f"{(c['F'] + c['B'] + c['W']) / (c['F alone'] + c['B alone'] + c['W alone']):.2f}, "
        f"U {c['U'] / c['U alone']:.2f}" for i, c in enumerate(costs))
    print(f"   the work bound (the busiest stage's M x (F + B + W) + its update U + the F of the "
          f"stages before it; messages free; each micro-batch's W a pass of its own: W joined "
          f"over the micro-batches can pass it): {together * 1e3:.1f} ms = "
          f"{serial_step / together:.2f}x serial on 1 CPU with the stages timed at once, "
          f"{alone * 1e3:.1f} ms = {serial_step / alone:.2f}x with each stage timed alone on one CPU; "
          f"{each}")


def print_schedules(args: argparse.Namespace, serial1: dict, ranks: list[dict]) -> None:
    """The schedules at one M, trained in the same rounds: measured against serial Keras on
    1 CPU and against each one's own work-only bound, and each one's dry run
    (:func:`tarantella.pipeline.schedule.dry_run`) timed with the F, B and W measured on
    each stage alone."""
    schedules = schedule_module()
    b, m = args.batch, args.schedule_micro_batches
    base1 = b / best_serial(serial1)
    costs = [r["passes"] for r in ranks]
    print(f"\n   Schedules, M={m} (the same rounds): F / B / W of one micro-batch alone, ms, per "
          "rank: " + "; ".join(f"r{i} {c['F'] * 1e3:.1f} / {c['B'] * 1e3:.1f} / {c['W'] * 1e3:.1f}"
                               for i, c in enumerate(costs))
          + " (the first stage's B is empty: no input gradient)")
    passes = [m * (c["F"] + c["B"] + c["W"]) for c in costs]
    cut = balanced_cut(args.layers)
    flops = stage_flops(args.layers, cut)
    print(f"   the cut: after layer {cut} of {args.layers}, where the stages' compute balances "
          f"(F + B + W per layer, the first layer without B: {flops[0]} : {flops[1]} matrix "
          f"products); measured, M x (F + B + W) per step: "
          + " / ".join(f"{p * 1e3:.1f} ms" for p in passes)
          + f" (r1 / r0 {passes[1] / passes[0]:.2f}); 'of passes' = the busier stage's "
          "M x (F + B + W) / step (no optimizer)")
    print(f"{'schedule':15s} {'samples/s':>9s} {'vs 1 CPU':>8s} {'step':>6s} {'work':>13s} "
          f"{'wait':>11s} {'loop':>11s} {'check':>11s} {'sum':>11s} {'bound':>5s} {'of bound':>8s} "
          f"{'of passes':>9s} {'dry-run bubble':>14s} {'dry-run of bound':>16s}")
    measured = schedules.Costs(forward=[c["F"] for c in costs], backward=[c["B"] for c in costs],
                               weight=[c["W"] for c in costs])
    rows = [*args.schedules, *[v for v in (TF_UPDATE, BLOCKING, SEPARATE, UNGATED, IN_PLACE)
                               if schedule_key(args, v) in ranks[0]["configs"]]]
    for s in rows:
        cs = [r["configs"][schedule_key(args, s)] for r in ranks]
        step = statistics.median([c["step"] for c in cs])
        rate, bound = b / step, b / max(c["work"] for c in cs)
        lists = schedules.build("zb-h1" if s in (BLOCKING, SEPARATE, UNGATED, IN_PLACE) else
                                "zb-fused" if s == TF_UPDATE else s, P, m)
        # a stage that joined its W ran them after its last action (as one pass; timed here
        # as M passes of its W: the dry run does not count what joining saves)
        lists = [schedules.weights_last(a) if c.get("joined_weights") else a for a, c in zip(lists, cs)]
        dry = schedules.dry_run(lists, measured)
        pair = {key: " / ".join(f"{c[key] * 1e3:.1f}" for c in cs)
                for key in ("work", "wait", "loop", "check", "sum")}
        print(f"{s:15s} {rate:9.0f} {rate / base1:8.2f} {step * 1e3:6.1f} {pair['work']:>13s} "
              f"{pair['wait']:>11s} {pair['loop']:>11s} {pair['check']:>11s} {pair['sum']:>11s} "
              f"{bound / base1:5.2f} {rate / bound:8.2f} {max(passes) / step:9.2f} "
              f"{dry.bubble:14.3f} {max(dry.busy) / dry.step_time:16.2f}")
    print_work_bound(costs, m, best_serial(serial1))
    for name in ("zb-h1", "zb-fused"):
        if name not in args.schedules:
            continue
        zb = [r["configs"][schedule_key(args, name)] for r in ranks]
        step = statistics.median([c["step"] for c in zb])
        vs, of = (b / step) / base1, max(c["work"] for c in zb) / step
        print(f"   {name} against ZB-H1's targets: >= 1.35x serial on 1 CPU (its fastest row): "
              f"{vs:.2f} ({'met' if vs >= 1.35 else 'NOT met'}); >= 0.90 of its work-only bound: "
              f"{of:.2f} ({'met' if of >= 0.90 else 'NOT met'})")


def print_all(args: argparse.Namespace, every: list[dict], ranks: list[dict]) -> None:
    """The ALL row: 2 pipelines of P stages on 2P ranks (oversubscribed: 2P processes on
    the cores), against PIPELINING's P ranks at the same M, run just before."""
    m = args.all_micro_batches
    step = statistics.median([r["configs"][f"M={m}"]["step"] for r in every])
    pipe = statistics.median([r["configs"][f"M={m}"]["step"] for r in ranks]) \
        if f"M={m}" in ranks[0]["configs"] else None
    ratio = f"{pipe / step:.2f}" if pipe else "n/a (M not in --micro-batches)"
    print(f"   ALL, {2 * P} ranks (2 pipelines x {P} stages, {os.cpu_count()} cores), M={m}: "
          f"{args.batch / step:.0f} samples/s, step {step * 1e3:.1f} ms; samples/s / "
          f"PIPELINING {P} at M={m}: {ratio}")


PHASES = ("fit", "checkpoint", "save")


def growth(r: dict, phase: str) -> int:
    """A process's peak RSS in ``phase`` over its RSS after the imports."""
    return r["marks"][phase]["VmHWM"] - r["marks"]["imported"]["VmRSS"]


def print_memory(args: argparse.Namespace, serial: dict, runs: dict[int, list[dict]]) -> None:
    params = serial["params"]
    state = 16 * params  # float32 weights, Adam's two slots, a gradient
    print(f"\n2. Memory: big, {args.mem_layers} Dense layers of {args.mem_width} units "
          f"({params / 1e6:.1f} M params: {mb(4 * params)} MB of float32 weights, {mb(12 * params)} MB "
          f"with Adam's state), batch {args.mem_batch}, {args.mem_steps} steps per fit, "
          f"M={args.mem_micro_batches}; pipelined models built without values "
          f"(tnt.deferred_build), serial as usual; MB (2^20 bytes)")
    print("   peak RSS growth (VmHWM, reset before each phase, over the RSS after the imports) in "
          "fit, in a fit through ModelCheckpoint(.keras) + BackupAndRestore, and in model.save(.keras); "
          "ratio to serial's growth in the same phase; target 1/S + 0.15")
    print(f"{'':22s} {'trains':>8s} {'16 B x trains':>13s} "
          + " ".join(f"{p:>10s} {'ratio':>6s}" for p in PHASES) + f" {'target':>6s}  within")
    print(f"{'serial':22s} {params / 1e6:6.1f} M {mb(state):>13s} "
          + " ".join(f"{mb(growth(serial, p)):>10s} {'':>6s}" for p in PHASES))
    verdicts = []
    for stages, ranks in runs.items():
        target = 1 / stages + 0.15
        for r in ranks:
            ratios = [growth(r, p) / growth(serial, p) for p in PHASES]
            ok = all(q <= target for q in ratios)
            verdicts.append(ok)
            name = f"S={stages} rank {r['rank']}"
            print(f"{name:22s} {r['local_params'] / 1e6:6.1f} M "
                  f"{mb(16 * r['local_params']):>13s} "
                  + " ".join(f"{mb(growth(r, p)):>10s} {q:6.2f}" for p, q in zip(PHASES, ratios))
                  + f" {target:6.2f}  {'yes' if ok else 'NO'}")
    if not all(r["peaks_reset"] for rs in runs.values() for r in [serial, *rs]):
        print("   (VmHWM could not be reset here: each peak is since the process started)")
    print(f"   every rank within its target in every phase: {'yes' if all(verdicts) else 'NO'}")


def weights_difference(a: Path, b: Path) -> float:
    """The largest relative difference (norm) between the weights two rows saved."""
    import numpy as np

    wa, wb = np.load(a), np.load(b)
    return max(float(np.linalg.norm(wa[k] - wb[k]) / (np.linalg.norm(wa[k]) or 1.0)) for k in wa.files)


def print_recompute(args: argparse.Namespace, rows: dict[tuple[str, bool], list[dict]],
                    out: Path) -> None:
    params = sum(r["local_params"] for r in next(iter(rows.values())))
    micro = args.rc_batch // args.rc_micro_batches
    print(f"\n5. Recomputation: {args.rc_layers} blocks of Dense({args.rc_width}, gelu) + "
          f"LayerNormalization ({params / 1e6:.1f} M params), 2 stages, batch {args.rc_batch}, "
          f"M={args.rc_micro_batches} (micro-batches of {micro}), float32, Adam; one job per row; "
          "MB (2^20 bytes)")
    print("   fit: peak RSS growth in the first fit (traced, VmHWM reset before it, over the RSS "
          f"after the imports); steps: the same in a second fit; step: median step of that "
          f"second fit ({args.rc_steps} steps), stage: of it in the stage's compiled step")
    print(f"{'schedule':19s} " + " ".join(
        f"{'r' + str(r) + ' fit':>9s} {'r' + str(r) + ' steps':>9s}" for r in range(P))
        + f" {'step ms':>8s} " + " ".join(f"{'r' + str(r) + ' stage':>9s}" for r in range(P))
        + f"  {'weights vs without':>18s}")
    for (schedule, recompute), ranks in rows.items():
        ranks = sorted(ranks, key=lambda r: r["rank"])
        same = ""
        if recompute and (schedule, False) in rows:
            diff = weights_difference(out / f"rc-{schedule}-0" / "weights.npz",
                                      out / f"rc-{schedule}-1" / "weights.npz")
            same = "bitwise" if diff == 0.0 else f"{diff:.1e} relative"
        print(f"{schedule + (' recompute' if recompute else ''):19s} " + " ".join(
            f"{mb(growth(r, 'fit')):>9s} {mb(growth(r, 'steps')):>9s}" for r in ranks)
            + f" {max(r['step'] for r in ranks) * 1e3:8.1f} "
            + " ".join(f"{r['stage'] * 1e3:9.1f}" for r in ranks) + f"  {same:>18s}")
    for schedule in dict.fromkeys(s for s, _ in rows):
        if (schedule, False) in rows and (schedule, True) in rows:
            off, on = rows[schedule, False], rows[schedule, True]
            saved = [f"rank {a['rank']} {mb(growth(a, 'fit') - growth(b, 'fit'))} MB "
                     f"({growth(b, 'fit') / growth(a, 'fit'):.2f}x)"
                     for a, b in zip(sorted(off, key=lambda r: r["rank"]),
                                     sorted(on, key=lambda r: r["rank"]))]
            turns = [r["turns"] for r in on]
            step = max(t["True"]["step"] for t in turns) / max(t["False"]["step"] for t in turns)
            stage = " / ".join(f"{t['True']['stage'] / t['False']['stage']:.2f}" for t in turns)
            print(f"   {schedule}: recomputation saves {', '.join(saved)} of the fit's peak "
                  f"growth; with / without, fitting in turns in one job ({args.rc_rounds} "
                  f"rounds): step time x{step:.2f}, stage time per rank x{stage}")
    print(f"   load average (1, 5, 15 min) at the end: "
          f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}")


def print_larger(args: argparse.Namespace, ranks: list[dict], resumed: list[dict],
                 loaded: dict) -> None:
    params = ranks[0]["params"]
    state = 12 * params  # float32 weights and Adam's two slots
    phases = (*PHASES, "resume")
    new = {r["rank"]: r for r in resumed}
    worst = max([growth(r, p) for r in ranks for p in phases]
                + [growth(r, "resume") for r in resumed])
    print(f"\n3. A model larger than one rank: {args.big_layers} Dense layers of {args.big_width} "
          f"units ({params / 1e6:.1f} M params), {len(ranks)} stages, M={args.big_micro_batches}, "
          "built without values; it "
          "trains, checkpoints (ModelCheckpoint + BackupAndRestore), saves, and a new model resumes "
          "from the backup and saves again, in the same processes and in a new job; peak RSS "
          "growth, MB")
    print(f"{'':10s} {'trains':>8s} " + " ".join(f"{p:>10s}" for p in PHASES)
          + f" {'released':>9s} {'resume':>7s} {'resume, new job':>16s} {'seconds':>8s} "
          f"{'save s':>6s} {'fit B/param':>11s}")
    for r in ranks:
        seconds = sum(r["marks"][p]["seconds"] for p in phases)
        released = r["marks"]["released"]["VmRSS"] - r["marks"]["imported"]["VmRSS"]
        print(f"{'rank ' + str(r['rank']):10s} {r['local_params'] / 1e6:6.1f} M "
              + " ".join(f"{mb(growth(r, p)):>10s}" for p in PHASES)
              + f" {mb(released):>9s} {mb(growth(r, 'resume')):>7s}"
              f" {mb(growth(new[r['rank']], 'resume')):>16s} {seconds:8.1f}"
              f" {r['marks']['save']['seconds']:6.1f}"
              f" {growth(r, 'fit') / r['local_params']:11.1f}")
    print(f"   weights + Adam state: {mb(state)} MB; 2 x the largest per-rank peak growth: "
          f"{mb(2 * worst)} MB: {'larger' if state > 2 * worst else 'NOT larger'} "
          f"({state / worst:.2f} x the largest growth)")
    same = loaded["digests"] == ranks[0]["digests"] and loaded["params"] == params
    print(f"   plain Keras (keras.saving.load_model in a process without tnt.Model) loads the saved file: "
          f"{len(loaded['digests'])} weights, {'all bitwise equal to' if same else 'NOT equal to'} "
          "get_weights() of the pipelined model")
    twins = resumed[0]["digests"] == ranks[0]["digests"]
    print(f"   the new job's resumed weights are {'bitwise equal to' if twins else 'NOT equal to'} "
          "those of the model resumed in the same processes")


def cap_experiment(args: argparse.Namespace, out: Path, serial: dict, ranks: list[dict]) -> None:
    """Bisect, for serial and for the pipelined job, the lowest RLIMIT_AS (per process) under
    which the big model trains, on a grid of ``--cap-step`` MB; print every run."""
    step = args.cap_step * 2**20
    lo = max(r["marks"]["fit"]["VmHWM"] for r in ranks) // step * step  # below any RSS peak
    top = max(r["marks"]["save"]["VmPeak"] for r in [serial, *ranks])
    hi = -(-top // step) * step + step  # above every peak virtual size measured in part 2
    tried: dict[tuple[str, int], str] = {}

    def attempt(role: str, cap: int) -> bool:
        n = args.mem_stages if role == "mem-pipe" else 0
        cap_out = out / f"cap-{role}-{cap}"
        cap_out.mkdir()
        rc, output = launch(args, role, cap_out, n, as_limit=cap)
        got = results(cap_out, role, max(n, 1), f"-{max(n, 1)}")
        ok = rc == 0 and len(got) == max(n, 1)
        if ok:
            tried[role, cap] = "trained (peak RSS " + " / ".join(
                mb(max(r["marks"][p]["VmHWM"] for p in PHASES)) for r in got) + ")"
        else:
            kinds = [k for k in ("ResourceExhaustedError", "MemoryError", "bad_alloc", "SIGABRT",
                                 "Resource temporarily unavailable") if k in output]
            if rc in (-6, 134) and "SIGABRT" not in kinds:
                kinds.append("SIGABRT")
            tried[role, cap] = f"failed, exit {rc}" + (f": {', '.join(kinds)}" if kinds else "")
        return ok

    lowest = {}
    for role in ("mem-serial", "mem-pipe"):
        a, b = lo, hi  # a fails (below the peak RSS), b: trains or the search ends there
        while b - a > step:
            mid = (a + b) // 2 // step * step
            if attempt(role, mid):
                b = mid
            else:
                a = mid
        lowest[role] = b
    # the demonstration: both at the pipelined job's lowest cap
    for role in ("mem-serial", "mem-pipe"):
        if (role, lowest["mem-pipe"]) not in tried:
            attempt(role, lowest["mem-pipe"])
    print(f"\n3. Memory cap: the big model under RLIMIT_AS (ulimit -v), per process, bisected on a "
          f"{args.cap_step} MB grid; MB")
    print(f"{'cap':>7s}  {'serial (1 process)':34s}  {'pipeline (limit on each rank)':34s}")
    for cap in sorted({c for _, c in tried}):
        cells = [tried.get((role, cap), "") for role in ("mem-serial", "mem-pipe")]
        print(f"{mb(cap):>7s}  {cells[0]:34s}  {cells[1]:34s}".rstrip())
    ls, lp = lowest["mem-serial"], lowest["mem-pipe"]

    def lowest_text(role: str) -> str:
        return mb(lowest[role]) if tried.get((role, lowest[role]), "").startswith("trained") \
            else f"none up to {mb(hi)}"

    print(f"   lowest cap that trained in the bisection: serial {lowest_text('mem-serial')}, "
          f"pipeline {lowest_text('mem-pipe')} MB")
    at_lp = (tried.get(("mem-serial", lp), ""), tried.get(("mem-pipe", lp), ""))
    if at_lp[0].startswith("failed") and at_lp[1].startswith("trained"):
        print(f"   at {mb(lp)} MB serial training failed and pipelined training succeeded")
    else:
        print(f"   at {mb(lp)} MB: serial {at_lp[0]}, pipeline {at_lp[1]}: no demonstration")
    if any(tried.get(("mem-serial", c), "").startswith("trained") for c in range(lo, ls, step)):
        print("   (not monotonic: serial trained under a cap below its bisected lowest)")


def source_version() -> str:
    """Where ``tarantella`` is imported from: its commit, and whether its sources differ."""
    import importlib.util

    spec = importlib.util.find_spec("tarantella")
    where = Path(spec.origin).parent if spec and spec.origin else None
    if where is None:
        return "(not found)"
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"from {where}"
    return f"at {commit}" + (" (its sources modified)" if dirty else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--bind-to", choices=("core", "none"), default="core",
                   help="tnt run's binding of the ranks (core, its default: a CPU each here)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--micro-batches", default="1,2,4,8")
    p.add_argument("--schedules", default="1f1b,zb-h1,zb-fused,gpipe",
                   help="the schedules compared at --schedule-micro-batches")
    p.add_argument("--schedule-micro-batches", type=int, default=4)
    p.add_argument("--no-loop-ab", dest="loop_ab", action="store_false",
                   help="skip the A/B rows: ZB-H1's loop exchanging a header before each of "
                        "its collectives, its forward passes ungated, and ZB-fused's update "
                        "as TensorFlow ops")
    p.add_argument("--all-micro-batches", type=int, default=4,
                   help="M of the ALL row (2 pipelines x P stages on 2P ranks)")
    p.add_argument("--no-all", action="store_true", help="skip the ALL row")
    p.add_argument("--mem-width", type=int, default=2048)
    p.add_argument("--mem-layers", type=int, default=12)
    p.add_argument("--mem-io", type=int, default=2048, help="input and output width of the big model")
    p.add_argument("--mem-batch", type=int, default=32)
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--mem-micro-batches", type=int, default=1)
    p.add_argument("--mem-stages", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--mem-resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mem-backup", help=argparse.SUPPRESS)
    p.add_argument("--load", help=argparse.SUPPRESS)
    p.add_argument("--rc-width", type=int, default=512,
                   help="the recomputation model (part 2b): its width ...")
    p.add_argument("--rc-layers", type=int, default=8, help="... its blocks ...")
    p.add_argument("--rc-batch", type=int, default=2048, help="... its batch ...")
    p.add_argument("--rc-micro-batches", type=int, default=4, help="... its micro-batches ...")
    p.add_argument("--rc-steps", type=int, default=4, help="... its steps per fit ...")
    p.add_argument("--rc-rounds", type=int, default=3,
                   help="... and the rounds in which it fits with and without recomputation in turns")
    p.add_argument("--rc-schedules", default="1f1b,zb-h1,gpipe",
                   help="the schedules of part 2b, each with and without recomputation")
    p.add_argument("--rc-schedule", default="1f1b", help=argparse.SUPPRESS)
    p.add_argument("--rc-recompute", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--big-width", type=int, default=1536,
                   help="the model larger than one rank: its width (--mem-io in and out)")
    p.add_argument("--big-layers", type=int, default=72, help="... and its Dense layers")
    p.add_argument("--big-micro-batches", type=int, default=1,
                   help="... and its micro-batches (each one more adds a gradient per stage)")
    p.add_argument("--no-big", action="store_true", help="skip the model larger than one rank")
    p.add_argument("--cap", action="store_true", help="run the memory-cap experiment (2 stages)")
    p.add_argument("--cap-step", type=int, default=128, help="MB: the grid of the cap bisection")
    p.add_argument("--only", choices=["throughput", "memory", "recompute", "larger"],
                   help="run one part only (larger: the model larger than one rank)")
    p.add_argument("--priority", type=int, default=None,
                   help="throughput part: every timed process (serial, each rank) at this nice "
                        "value in a scheduling group of its own (root for < 0): other work on a "
                        "shared machine then starves the runs less")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launched process or job")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.micro_batches = [int(m) for m in str(args.micro_batches).split(",") if m]
    args.schedules = [s for s in str(args.schedules).split(",") if s]
    if args.role in ("serial", "serial-1cpu", "pipe", "pipe-all"):
        worker_throughput(args)
        return 0
    if args.role in ("mem-serial", "mem-pipe", "mem-resume"):
        worker_memory(args)
        return 0
    if args.role == "mem-recompute":
        worker_recompute(args)
        return 0
    if args.role == "mem-load":
        worker_load(args)
        return 0
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    print(f"pipeline benchmark, {os.cpu_count()} CPUs, backend {args.backend}, ranks bound "
          f"{'to cores of their own' if args.bind_to == 'core' else 'to nothing'}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, tarantella {source_version()}, "
          f"load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}"
          + ("" if args.priority is None else f", timed processes at priority {args.priority}"),
          flush=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        out = Path(tmp_name)
        if args.only not in ("memory", "recompute", "larger"):
            serial = run(args, "serial", out, 0)[0]
            serial1 = run(args, "serial-1cpu", out, 0)[0]
            shared = [memory_sharing(P)]
            ranks = run(args, "pipe", out, P)
            shared.append(memory_sharing(P))
            (out / "again").mkdir()  # the serial processes again: the machine may have changed
            again = run(args, "serial", out / "again", 0)[0]
            again1 = run(args, "serial-1cpu", out / "again", 0)[0]
            drifts = [f"{name}{tag} {a['configs'][name]['step'] / b['configs'][name]['step']:.2f}"
                      for tag, a, b in (("", serial, again), (", 1 CPU", serial1, again1))
                      for name in a["configs"]]
            for first, second in ((serial, again), (serial1, again1)):  # the less disturbed run
                for name, c in first["configs"].items():
                    c["step"] = min(c["step"], second["configs"][name]["step"])
            print_throughput(args, serial, serial1, ranks)
            print("   serial rows: the faster of a run before and one after the pipelined runs; "
                  "after / before step time: " + ", ".join(drifts))
            if args.schedules:
                print_schedules(args, serial1, ranks)
            print(f"   memory shared (the bandwidth each of {P} CPUs keeps copying at once, of "
                  f"its own alone: benchmarks/machine_memory.py) before the pipelined runs "
                  f"{shared[0]:.2f}, after them {shared[1]:.2f}: a 2-rank step slows where it is "
                  f"low, the serial rows on 1 CPU do not")
            print(f"   load average (1, 5, 15 min) at the end: "
                  f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}")
            if not args.no_all:
                print_all(args, run(args, "pipe-all", out, 2 * P), ranks)
        if args.only == "memory" or args.only is None:
            mserial = run(args, "mem-serial", out, 0, "-1")[0]
            runs = {}
            for stages in (2, 3):
                staged = copy.copy(args)
                staged.mem_stages = stages
                runs[stages] = run(staged, "mem-pipe", out, stages, f"-{stages}")
            print_memory(args, mserial, runs)
        if args.only == "larger" or (args.only not in ("throughput", "recompute") and not args.no_big):
            big = copy.copy(args)
            big.mem_stages, big.mem_resume = 3, True
            big.mem_width, big.mem_layers, big.mem_io = args.big_width, args.big_layers, args.big_width
            big.mem_micro_batches = args.big_micro_batches
            (out / "big").mkdir()
            ranks = run(big, "mem-pipe", out / "big", 3, "-3")
            again = copy.copy(big)
            again.mem_resume, again.mem_backup = False, ranks[0]["backup"]
            resumed = run(again, "mem-resume", out / "big", 3, "-3")
            big.mem_resume, big.load = False, ranks[0]["final"]
            rc, output = launch(big, "mem-load", out / "big", 0)
            if rc != 0:
                raise SystemExit(f"plain Keras failed to load {big.load}:\n{output[-4000:]}")
            loaded = json.loads((out / "big" / "load.json").read_text())
            print_larger(args, ranks, resumed, loaded)
        if args.cap and args.only in (None, "memory"):
            two = copy.copy(args)
            two.mem_stages = 2
            cap_experiment(two, out, mserial, runs[2])
        if args.only in (None, "memory", "recompute"):
            rows = {}
            for schedule in [s for s in str(args.rc_schedules).split(",") if s]:
                for recompute in (False, True):
                    one = copy.copy(args)
                    one.rc_schedule, one.rc_recompute = schedule, recompute
                    (out / f"rc-{schedule}-{int(recompute)}").mkdir()
                    rows[schedule, recompute] = run(one, "mem-recompute",
                                                    out / f"rc-{schedule}-{int(recompute)}", P)
            print_recompute(args, rows, out)
    left = sorted(set(os.listdir("/dev/shm")) - shm_before) if shm_before or os.path.isdir("/dev/shm") else []
    if left:
        print(f"\nnote: new entries in /dev/shm during the run (this run's or other jobs'): {left}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
