"""The native gradient path against the Python path, and a peer's death under it.

Run on every rank of a launched job: ``python native_worker.py OUT_DIR CASE``.

* ``train``: trains small models with micro-batches of unequal size (global batch 7 on 2
  ranks: factors 4/7 and 3/7, so the scaled copy into the buckets is exercised), in
  float32 and float16, and on the native path the float32 one again with
  ``TNT_GRADIENT_COMPRESSION=fp16`` (``fp16wire``), and saves the weights and which path each step took
  (``OUT_DIR/<path>-rank<r>.npz``, path from ``TNT_NATIVE_OPS``). Then the replicas of a
  pipeline stage: one stage (the whole model, uncut) on both ranks, each training on its
  share of every global batch (4 and 3 of 7, in 2 micro-batches), its gradients summed over
  a group split from the job by the stage's ``GradientReducer``; saved with the weights of
  plain Keras ``fit`` on the same batches.
* ``kill``: rank 1 SIGKILLs itself at the start of a step of the second epoch; rank 0 must
  end with the peer's failure (a CommError, exit code 75), not hang.
* ``hang``: rank 1 stops (sleeps) at the start of step 3 of the first epoch, so it never
  reaches that step's gradient allreduce; run under ``tnt run``, whose last line must name
  it (the stall inspector sees the native allreduces).
* ``mismatch``: the ranks are given different fusion thresholds (an operator's mistake), so
  their bucket plans differ: every rank must raise CollectiveMismatchError before any
  gradient moves, and write what it raised to ``OUT_DIR/mismatch-rank<r>.txt``.
* ``p2p`` (2 ranks): tensors of several dtypes and shapes, random bits, sent both ways with
  the point-to-point graph ops (``native_ops.point_to_point``) inside one ``tf.function``
  called twice, two of them on one tag in order; each rank saves what it sent and received
  as bytes (``OUT_DIR/p2p-rank<r>.npz``). Then rank 1 SIGKILLs itself while rank 0 waits in
  a receive from it: rank 0 saves what that receive raised and when
  (``OUT_DIR/p2p-dead-peer.json``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

if sys.argv[2:3] == ["mismatch"] and os.environ.get("TNT_RANK") == "1":
    os.environ["TNT_FUSION_THRESHOLD_KB"] = "0"  # rank 0 keeps the default: other buckets

import keras
import numpy as np
import tensorflow as tf

import tarantella as tnt
import tnt_core
from tarantella.comm import Channel
from tarantella.comm import native as native_ops
from tarantella.comm.gradients import GradientReducer
from tarantella.comm.native import NativeReducer
from tarantella.pipeline.partition import partition
from tarantella.pipeline.stage import StageStep


def _model(dtype: str) -> keras.Model:
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="tanh", dtype=dtype),
                             keras.layers.Dense(10, dtype=dtype), keras.layers.Dense(3, dtype=dtype)])


def _data(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.normal(size=(61, 12)).astype(dtype), rng.normal(size=(61, 3)).astype(dtype)


def train(out: Path) -> None:
    path = "python" if os.environ.get("TNT_NATIVE_OPS", "true") == "false" else "native"
    saved = {}
    cases = [("float32", "float32"), ("float16", "float16")]
    if path == "native":  # the Python path is handed the same float16 tensors (test_compression)
        cases.append(("fp16wire", "float32"))
    for case, dtype in cases:
        if case == "fp16wire":  # read when the step is traced
            os.environ["TNT_GRADIENT_COMPRESSION"] = "fp16"
        model = tnt.Model(_model(dtype))
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, name="sgd"), loss="mse")
        x, y = _data(dtype)
        model.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
        os.environ.pop("TNT_GRADIENT_COMPRESSION", None)
        for i, w in enumerate(model.get_weights()):
            saved[f"{case}_{i}"] = w
        plans = list(model._tnt._reducers["train_sgd_0"]._plans.values())
        saved[f"{case}_native"] = np.array([isinstance(p, NativeReducer) for p in plans])
    saved.update(_stage_replicas())
    np.savez(out / f"{path}-rank{tnt.get_rank()}.npz", **saved)


def _functional() -> keras.Model:
    keras.utils.set_random_seed(7)
    inp = keras.Input((12,))
    h = keras.layers.Dense(24, activation="tanh")(inp)
    return keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(10)(h)))


def _stage_replicas() -> dict[str, np.ndarray]:
    runtime = tnt_core.init()
    rank, size = runtime.rank, runtime.size
    x, y = _data("float32")
    plain = _functional()
    plain.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    plain.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    group = runtime.backend.split(list(range(size)))
    reducer = GradientReducer(Channel(runtime, group), "stage0_replicas")
    step = StageStep(partition(_functional()), 0, group, loss=keras.losses.MeanSquaredError(),
                     optimizer=keras.optimizers.SGD(0.05, momentum=0.9), num_micro_batches=2,
                     replicas=reducer)
    signatures = set()  # the compiled step traces once per (local, global) batch size
    for _ in range(2):
        for start in range(0, len(x), 7):
            bx, by = x[start:start + 7], y[start:start + 7]
            share = tnt_core.micro_batch_slice(len(bx), rank, size, allow_empty=True)
            step.train(bx[share], by[share], global_batch=len(bx))
            signatures.add((share.stop - share.start, len(bx)))
    saved = {f"stage_{i}": w for i, w in enumerate(step.model.get_weights())}
    saved.update({f"serial_{i}": w for i, w in enumerate(plain.get_weights())})
    saved.update({f"initial_{i}": w for i, w in enumerate(_functional().get_weights())})
    saved["stage_native"] = np.array([isinstance(p, NativeReducer) for p in reducer._plans.values()])
    saved["stage_traces"] = np.array([step._train_fn.experimental_get_tracing_count(),
                                      len(signatures)])
    return saved


def kill(out: Path) -> None:
    class Die(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if tnt.get_rank() == 1 and self.epoch == 1 and batch == 3:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    model = tnt.Model(_model("float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.05, name="sgd"), loss="mse")
    x, y = _data("float32")
    model.fit(x, y, batch_size=7, epochs=3, shuffle=False, verbose=0, callbacks=[Die()])
    (out / f"finished-rank{tnt.get_rank()}").write_text("the job went on without rank 1\n")


def hang(out: Path) -> None:
    class Hang(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if tnt.get_rank() == 1 and batch == 2:
                time.sleep(600)  # tnt run ends it once rank 0 has failed waiting

    model = tnt.Model(_model("float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.05, name="sgd"), loss="mse")
    x, y = _data("float32")
    model.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0, callbacks=[Hang()])
    (out / f"finished-rank{tnt.get_rank()}").write_text("the job went on without rank 1\n")


def mismatch(out: Path) -> None:
    import tnt_core

    model = tnt.Model(_model("float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.05, name="sgd"), loss="mse")
    x, y = _data("float32")
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    except tnt_core.CollectiveMismatchError as exc:
        (out / f"mismatch-rank{tnt.get_rank()}.txt").write_text(f"{type(exc).__name__}: {exc}")
        return
    raise SystemExit("fit ran with different bucket plans on the ranks")


#: (dtype, shape) of the tensors the ``p2p`` case exchanges
P2P_CASES = [("float32", (3, 5)), ("float16", (17,)), ("bfloat16", (2, 3, 4)), ("float64", ()),
             ("int64", (0,)), ("int32", (512, 300)), ("uint8", (4099,)), ("bool", (9,))]


def _p2p_tensors(rank: int, round_: int) -> tuple[list, list]:
    """The tensors rank ``rank`` sends in round ``round_``: random bits of each case's size
    (NaN payloads and all), as TensorFlow tensors, and the same as bytes."""
    rng = np.random.default_rng(100 * rank + round_)
    tensors, raw = [], []
    for dtype, shape in P2P_CASES:
        width = 1 if dtype == "bool" else tf.as_dtype(dtype).size
        n = int(np.prod(shape, dtype=np.int64))
        if dtype == "bool":
            t = tf.constant(rng.integers(0, 2, size=shape).astype(bool))
        else:
            bits = rng.integers(0, 256, size=n * width, dtype=np.uint8).view(f"u{width}").reshape(shape)
            t = tf.constant(bits) if dtype == "uint8" else tf.bitcast(tf.constant(bits), tf.as_dtype(dtype))
        tensors.append(t)
        raw.append(_bytes_of(t))
    return tensors, raw


def _bytes_of(t) -> np.ndarray:
    if t.dtype == tf.bool:
        return tf.cast(t, tf.uint8).numpy().ravel().view(np.uint8)
    width = t.dtype.size
    unsigned = {1: tf.uint8, 2: tf.uint16, 4: tf.uint32, 8: tf.uint64}[width]
    return np.ascontiguousarray(tf.bitcast(t, unsigned).numpy()).ravel().view(np.uint8)


def p2p(out: Path) -> None:
    runtime = tnt_core.init()
    rank, peer = runtime.rank, 1 - runtime.rank
    pp = native_ops.point_to_point(runtime)
    assert pp is not None, native_ops.p2p_unavailable_reason(runtime)
    traces = []

    @tf.function
    def exchange(tensors, first, second):
        traces.append(1)
        tokens = [pp.send(t, peer, 100 + i) for i, t in enumerate(tensors)]
        # two messages on one tag: the sends (and the receives) ordered in the graph
        tokens.append(pp.send(first, peer, 7))
        with tf.control_dependencies(tokens[-1:]):
            tokens.append(pp.send(second, peer, 7))
        # the receives after the sends: each blocks a TensorFlow thread while it waits, and
        # the peer's receives wait for these sends
        with tf.control_dependencies(tokens):
            got = [pp.recv(shape, dtype, peer, 100 + i) for i, (dtype, shape) in enumerate(P2P_CASES)]
            a = pp.recv(first.shape, first.dtype, peer, 7)
        with tf.control_dependencies([a]):
            b = pp.recv(second.shape, second.dtype, peer, 7)
        with tf.control_dependencies([pp.wait(tokens)]):
            return [tf.identity(g) for g in got] + [tf.identity(a), tf.identity(b)]

    saved = {}
    for round_ in range(2):
        tensors, raw = _p2p_tensors(rank, round_)
        first = tf.fill([1000], tf.constant(rank + 10 * round_, tf.int64))
        second = tf.fill([3], tf.constant(-rank - 10 * round_, tf.int64))
        got = exchange(tensors, first, second)
        for i, (t, sent) in enumerate(zip(got, raw + [_bytes_of(first), _bytes_of(second)])):
            saved[f"sent_{round_}_{i}"] = sent
            saved[f"got_{round_}_{i}"] = _bytes_of(t)
            saved[f"dtype_{round_}_{i}"] = np.array(t.dtype.name)
            saved[f"shape_{round_}_{i}"] = np.array(t.shape.as_list(), np.int64)
    saved["traces"] = np.array(len(traces))
    np.savez(out / f"p2p-rank{rank}.npz", **saved)

    @tf.function
    def receive_from_the_dead():
        return pp.recv((4,), tf.float32, peer, 999)

    done = tf.function(lambda: pp.wait([pp.send(tf.zeros(1), peer, 998)]))
    done()  # both ranks are here
    pp.recv((1,), tf.float32, peer, 998)
    if rank == 1:
        time.sleep(1.0)  # rank 0 is waiting in its receive by now
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    report: dict = {}
    try:
        receive_from_the_dead()
    except tf.errors.OpError as exc:
        raised = native_ops.original(exc) or exc
        report = {"type": type(raised).__name__, "message": str(raised),
                  "seconds": time.monotonic() - t0}
    else:
        report = {"type": None, "seconds": time.monotonic() - t0}
    (out / "p2p-dead-peer.json").write_text(json.dumps(report))


if __name__ == "__main__":
    {"train": train, "kill": kill, "hang": hang, "mismatch": mismatch,
     "p2p": p2p}[sys.argv[2]](Path(sys.argv[1]))
