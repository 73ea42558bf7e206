"""The pipelined training step (``tarantella.pipeline.stage.StageStep``) against plain Keras.

Every stage a real process (the ``store`` backend, which has point-to-point), 3 partitions
(a first, a middle and a last stage; 2 would show nothing more), SGD with momentum and
Adam, 1 micro-batch, micro-batch counts that divide the batch of 16 and one that does not
(3, with the 1F1B and the GPipe schedule), ZB-H1 on a model whose last stage joins its
weight gradients after its last backward pass, and a last batch of 8: after 6 steps the
weights of every stage and the loss of every step equal ``train_on_batch`` of the whole
model on the same batches within float round-off. Single-process: what the step refuses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import keras
import numpy as np
import pytest

import tnt_core
from tarantella.errors import NotSupportedError
from tarantella.keras.layers import SplitLayer
from tarantella.pipeline.partition import partition
from tarantella.pipeline.stage import StageStep, micro_batch_sizes
from tnt_keras_helpers import EchoPeerBackend, run_serial, run_workers

pytestmark = pytest.mark.timeout(600)

TOLERANCE = 1e-5


STAGES = 3


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> Iterator[tuple[Path, Path, list[Future]]]:
    """The serial run and the launch, side by side (the stages wait on each other much of the
    time): ``(serial out, pipelined out, futures)``."""
    serial_out = tmp_path_factory.mktemp("pipeline-serial")
    pipelined_out = tmp_path_factory.mktemp(f"pipeline-{STAGES}")
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="pipeline-step") as pool:
        yield serial_out, pipelined_out, [
            pool.submit(run_serial, "pipeline_worker.py", ["--mode", "serial", "--out", str(serial_out)]),
            pool.submit(run_workers, "pipeline_worker.py", ["--mode", "pipeline", "--out",
                                                            str(pipelined_out)], STAGES, "store",
                        timeout=300)]


@pytest.fixture(scope="module")
def serial(started) -> Path:
    started[2][0].result()
    return started[0]


@pytest.fixture(scope="module", params=[STAGES], ids=[f"{STAGES}-stages"])
def pipelined(request, started) -> tuple[int, Path]:
    started[2][1].result()
    return request.param, started[1]


def test_every_stage_ends_with_the_serial_weights_and_losses(serial, pipelined):
    stages, out = pipelined
    cases = sorted(p.name.split(".")[0] for p in out.glob("*.rank0.json"))
    assert len(cases) == 9, cases
    for case in cases:
        joined = [json.loads((out / f"{case}.rank{rank}.json").read_text())["joined_weights"]
                  for rank in range(stages)]
        # only ZB-H1 has W apart; of its stages only the last (of wide layers) joins them
        expected = [False] * (stages - 1) + [True] if "zb-h1" in case else [None] * stages
        assert joined == expected, (case, joined)
        ref = dict(np.load(serial / f"{case}.npz"))
        got: dict[str, np.ndarray] = {}
        params = 0
        for rank in range(stages):
            local = dict(np.load(out / f"{case}.rank{rank}.npz"))
            assert not set(local) & set(got), f"{case}: a weight on two stages"
            got.update(local)
            params += json.loads((out / f"{case}.rank{rank}.json").read_text())["params"]
        assert set(got) == set(ref), f"{case}: weights differ in name: {set(got) ^ set(ref)}"
        assert params == sum(v.size for v in ref.values())
        for name, value in ref.items():
            rel = np.linalg.norm(got[name] - value) / np.linalg.norm(value)
            assert rel <= TOLERANCE, f"{case}: {name} differs from serial by {rel:.2e}"
        losses = json.loads((out / f"{case}.rank0.json").read_text())["losses"]
        ref_losses = json.loads((serial / f"{case}.json").read_text())["losses"]
        np.testing.assert_allclose(losses, ref_losses, rtol=TOLERANCE, err_msg=case)
        assert not np.allclose(ref_losses[0], ref_losses[-1]), "the model did not train"


def test_schedules_make_every_pass_once_in_an_order_the_neighbours_share():
    from tarantella.pipeline.stage import SCHEDULES

    class Stage(StageStep):
        def __init__(self, stage, stages, schedule):  # the order only
            self.stage, self.schedule = stage, schedule
            self.parts = type("Parts", (), {"num_partitions": stages})()

    for schedule in SCHEDULES:
        for stages, count in ((2, 4), (3, 3), (4, 2), (3, 1)):
            orders = [Stage(p, stages, schedule).order(count) for p in range(stages)]
            for order in orders:
                kinds = ("forward", "backward", "weight") if schedule.startswith("zb-") else \
                    ("forward", "backward")
                assert sorted(order) == sorted([(kind, k) for kind in kinds for k in range(count)])
                assert all(order.index((a, k)) < order.index((b, k)) for k in range(count)
                           for a, b in pairwise(kinds))
            # what a stage sends, its neighbour receives in the same order
            for p in range(stages - 1):
                sent = [k for kind, k in orders[p] if kind == "forward"]
                assert sent == [k for kind, k in orders[p + 1] if kind == "forward"]
                back = [k for kind, k in orders[p + 1] if kind == "backward"]
                assert back == [k for kind, k in orders[p] if kind == "backward"]
    one_f_one_b = Stage(0, 2, "1f1b").order(3)
    assert one_f_one_b == [("forward", 0), ("forward", 1), ("backward", 0), ("forward", 2),
                           ("backward", 1), ("backward", 2)]


def test_micro_batches_split_the_batch_larger_first_and_never_empty():
    assert micro_batch_sizes(16, 3) == [6, 5, 5]
    assert micro_batch_sizes(8, 4) == [2, 2, 2, 2]
    assert micro_batch_sizes(2, 4) == [1, 1]
    assert micro_batch_sizes(0, 4) == []



def _cut_model(middle: keras.layers.Layer) -> keras.Model:
    inp = keras.Input((4,))
    x = SplitLayer()(keras.layers.Dense(4)(inp))
    return keras.Model(inp, keras.layers.Dense(2)(middle(x)))


def _local() -> tnt_core.CommBackend:
    return tnt_core.LocalBackend(tnt_core.Config(rank=0, size=1, local_rank=0, local_size=1))


def _step(model, backend=None, loss=None):
    return StageStep(partition(model), 1, backend or _local(),
                     loss=loss or keras.losses.MeanSquaredError(), optimizer=keras.optimizers.SGD(),
                     num_micro_batches=2)


def test_a_backend_without_point_to_point_is_refused_naming_it():
    with pytest.raises(NotSupportedError, match="'collectives-only' backend does not provide"):
        _step(_cut_model(keras.layers.Dense(3)), EchoPeerBackend())


def test_micro_batch_statistics_and_activity_regularisers_are_refused_naming_the_layer():
    with pytest.raises(NotSupportedError, match=r"BatchNormalization layer 'bn' \(partition 1\)"):
        _step(_cut_model(keras.layers.BatchNormalization(name="bn")))
    with pytest.raises(NotSupportedError, match=r"layer 'act' \(partition 1\) has an activity_regularizer"):
        _step(_cut_model(keras.layers.Dense(3, name="act", activity_regularizer="l2")))


def test_a_loss_function_instead_of_a_loss_object_is_refused():
    with pytest.raises(TypeError, match=r"takes a keras\.losses\.Loss"):
        _step(_cut_model(keras.layers.Dense(3)), loss="mse")


def test_a_sparse_gradient_reaches_the_optimizer_as_the_batchs_rows_in_batch_order():
    """What a stage hands its optimizer (tarantella.pipeline.batch_gradients): the micro-batches'
    sparse gradients as one tf.IndexedSlices, rows in micro-batch order whatever order the
    backward passes ran in (GPipe runs the last first); dense ones summed; a gradient sparse
    in one micro-batch and dense in another summed densely, as TensorFlow aggregates a mix;
    no row (of the right dtypes) for a stage's replica with no sample of the batch."""
    import tensorflow as tf

    from tarantella.pipeline.batch_gradients import MicroBatchGradients, Rows

    table, kernel = tf.Variable(tf.zeros((5, 2))), tf.Variable(tf.zeros((2,)))
    rows = [tf.IndexedSlices(tf.fill((2, 2), float(k + 1)), tf.constant([k, 4]), tf.constant([5, 2]))
            for k in range(3)]
    grads = MicroBatchGradients([table, kernel])
    for k in (2, 0, 1):
        grads.add(k, [rows[k], tf.constant([1.0, float(k)])])
    assert grads.rows() == [Rows(tf.int32, tf.float32, tf.int32), None]
    sparse, dense = grads.whole()
    assert isinstance(sparse, tf.IndexedSlices)
    assert sparse.indices.numpy().tolist() == [0, 4, 1, 4, 2, 4]
    assert sparse.values.numpy()[:, 0].tolist() == [1, 1, 2, 2, 3, 3]
    assert dense.numpy().tolist() == [3.0, 3.0]
    mixed = MicroBatchGradients([table])
    mixed.add(0, [tf.ones((5, 2))])  # micro-batch 0 with the weight regulariser's gradient
    mixed.add(1, [rows[1]])
    assert mixed.rows() == [None]
    np.testing.assert_array_equal(mixed.whole()[0], np.ones((5, 2)) + tf.convert_to_tensor(rows[1]))
    empty = MicroBatchGradients([table, kernel]).whole([Rows(tf.int64, tf.float32, tf.int64), None])
    assert empty[0].indices.dtype == tf.int64 and empty[0].values.shape == (0, 2)
    assert empty[1].numpy().tolist() == [0.0, 0.0]
    with pytest.raises(NotSupportedError, match=r"is sparse \(tf\.IndexedSlices\) in the stage's "
                       r"structure but dense in this step"):
        mixed.whole([Rows(tf.int32, tf.float32, tf.int32)])
