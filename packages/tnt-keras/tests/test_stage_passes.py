"""A stage's own compute on one micro-batch (``tarantella.pipeline.passes``), single process,
float64, no messages: the forward passes of three partitions run one after another and
their backward passes chained back, micro-batch by micro-batch, give the whole model's
loss and gradients, a tensor that skips a partition (a residual across two cuts) has its
gradient passed straight back through the stage between, and the weight regularisation
is added once."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tarantella.keras.layers import SplitLayer
from tarantella.pipeline.micro_batches import micro_batch_sizes, shares, split
from tarantella.pipeline.partition import partition
from tarantella.pipeline.passes import StagePasses


@pytest.fixture
def float64():
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)


def _model() -> keras.Model:
    keras.utils.set_random_seed(5)
    inp = keras.Input((4,))
    skip = keras.layers.Dense(3, activation="tanh", name="d0",
                              kernel_regularizer=keras.regularizers.L2(0.1))(inp)
    h = keras.layers.Dense(5, activation="tanh", name="d1")(SplitLayer(name="cut1")(skip))
    h = keras.layers.Dense(3, name="d2")(SplitLayer(name="cut2")(h))
    return keras.Model(inp, keras.layers.Add(name="residual")([h, skip]))


def test_passes_chained_by_hand_give_the_whole_models_loss_and_gradients(float64):
    model = _model()
    parts = partition(model)
    assert parts.num_partitions == 3
    loss = keras.losses.MeanSquaredError()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((7, 4)), rng.standard_normal((7, 3))
    with tf.GradientTape() as tape:
        serial_loss = loss(y, model(x, training=True)) + tf.add_n(model.losses)
    serial = dict(zip([w.path for w in model.trainable_weights],
                      tape.gradient(serial_loss, model.trainable_weights)))

    stages = [StagePasses(parts, p, loss) for p in range(3)]
    sizes = micro_batch_sizes(7, 3)
    total, grads = 0.0, {w.path: 0.0 for w in model.trainable_weights}
    for k, (xk, yk, share) in enumerate(zip(split(x, sizes), split(y, sizes), shares(sizes, 7))):
        flights, received = [], []
        for stage in stages:  # forward, each stage fed what the one before emitted
            flight = stage.forward(received, xk if stage.first else None, yk, None, share,
                                   regularise=k == 0)
            flights.append(flight)
            received = flight.outputs
        assert sorted(kind for kind, _ in parts.emits[1]) == ["computed", "received"], \
            "the residual passes through the middle stage"
        returned = None
        for stage, flight in zip(reversed(stages), reversed(flights)):  # and backward
            if flight.loss is not None:
                total += float(flight.loss)
            seed = None if flight.loss is None else tf.ones_like(flight.loss)
            weight_grads, returned = stage.backward(flight, returned, seed)
            for w, g in zip(stage.weights, weight_grads):
                grads[w.path] = grads[w.path] + np.asarray(g)
        assert returned is None, "the first stage sends nothing back"
    # the regularisation term is added in float32 (the step reports its loss in float32)
    assert total == pytest.approx(float(serial_loss), rel=1e-7)
    assert grads.keys() == serial.keys()
    for path, g in serial.items():
        np.testing.assert_allclose(grads[path], np.asarray(g), rtol=1e-12, atol=1e-15, err_msg=path)


def test_a_weight_pass_apart_is_the_backward_passs_own_weight_gradient_ops(float64):
    """``backward_apart`` splits one gradient computation: on the middle stage ``W`` starts
    with each Dense layer's kernel and bias gradient ops (what B does not need), and waits
    for the op it is told to; the gradients are ``backward``'s, bit for bit."""
    parts = partition(_model())
    stage = StagePasses(parts, 1, keras.losses.MeanSquaredError())
    rng = np.random.default_rng(1)
    received = [tf.constant(rng.standard_normal((5, 3)))]
    seen = {}

    def step(apart: bool):
        flight = stage.forward(received, None, None, None, 1.0, regularise=False)
        returned = [tf.sin(tf.reshape(tf.range(tf.size(o), dtype=o.dtype), o.shape))
                    for o in flight.outputs]  # what the next stage sends back
        if not apart:
            return stage.backward(flight, returned, None)
        weight_pass, back = stage.backward_apart(flight, returned, None)
        gate = tf.constant(0.0).op
        weight_pass.start_after([gate])
        seen.update(first=weight_pass.first_ops, gate=gate, back=back)
        return weight_pass.grads, back

    whole, apart = tf.function(lambda: step(False))(), tf.function(lambda: step(True))()
    for a, b in zip(tf.nest.flatten(whole), tf.nest.flatten(apart)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sorted(op.type for op in seen["first"]) == ["BiasAddGrad", "MatMul"]  # layer d1
    assert all(seen["gate"] in op.control_inputs for op in seen["first"])
    first = set(seen["first"])

    def upstream(op, stack=None):  # every op the input gradients need
        stack, found = [op], set()
        while stack:
            o = stack.pop()
            if o not in found:
                found.add(o)
                stack += [t.op for t in o.inputs] + list(o.control_inputs)
        return found

    assert not any(first & upstream(t.op) for t in seen["back"]), "B waits for W"


def test_a_recomputed_forward_pass_draws_its_dropout_masks_again_and_changes_no_bit(float64):
    """Recomputation: each micro-batch's forward pass keeps no tape, the seed states move on
    as without it, and the backward passes, run after every forward pass (as GPipe orders
    them), compute each again from its inputs and the seeds it drew: the gradients and the
    outputs are those of the forward passes recorded on tapes, bit for bit, and the Dropout
    masks are really drawn (the same input twice, two outputs)."""
    keras.utils.set_random_seed(9)
    inp = keras.Input((6,))
    h = keras.layers.Dropout(0.5)(keras.layers.Dense(8, activation="tanh", name="d0")(inp))
    h = keras.layers.Dense(4, name="d1")(keras.layers.Dropout(0.3)(h))
    parts = partition(keras.Model(inp, keras.layers.Dense(2, name="d2")(SplitLayer(name="cut")(h))))
    stage = StagePasses(parts, 0, keras.losses.MeanSquaredError())
    seeds = list(stage.model.non_trainable_variables)  # the two seed states
    assert len(seeds) == 2, seeds
    start = [v.numpy() for v in seeds]
    x = tf.constant(np.random.default_rng(2).standard_normal((5, 6)))  # both micro-batches
    returned = [tf.constant(np.random.default_rng(3).standard_normal((5, 4)))]

    def step(recompute: bool):
        flights = [stage.forward([], x, None, None, 0.5, regularise=False, recompute=recompute)
                   for k in range(2)]
        out = []
        for flight in flights:
            assert (flight.tape is None) == recompute
            replayed = stage.replay(flight) if recompute else flight
            grads, _ = stage.backward(replayed, returned, None)
            out.append((flight.outputs, replayed.outputs, grads))
        return out

    results = []
    for recompute in (False, True):
        for v, value in zip(seeds, start):
            v.assign(value)
        results.append(tf.function(lambda r=recompute: step(r))())
        moved = [v.numpy() for v in seeds]
        assert all((m != s).any() for m, s in zip(moved, start)), "the seeds move on"
        results.append(moved)
    (plain, plain_seeds), (again, again_seeds) = results[:2], results[2:]
    for a, b in zip(tf.nest.flatten(plain) + plain_seeds, tf.nest.flatten(again) + again_seeds):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    first, second = (np.asarray(again[k][0][0]) for k in range(2))
    assert not np.array_equal(first, second), "each micro-batch its own masks"


def test_weight_passes_of_several_micro_batches_are_one_op_over_their_rows(float64):
    """``fused_weights.fused``: the kernel (``MatMul``) and bias (``BiasAddGrad``) gradients
    of three micro-batches become one op each over their rows joined, equal to the whole
    batch's gradient (the serial step's product) and to the sum of the three within
    round-off; the three per-micro-batch products are left without a consumer (pruned); a
    gradient of another kind (a ``Conv1D`` filter's) is not fused."""
    from tarantella.pipeline.fused_weights import fused

    keras.utils.set_random_seed(3)
    dense, conv = keras.layers.Dense(4, activation="tanh"), keras.layers.Conv1D(2, 3)
    x = np.random.default_rng(0).standard_normal((9, 6, 5))
    variables = None

    def grads(rows):
        nonlocal variables
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dense(tf.reshape(rows, (-1, 5)))) + tf.reduce_sum(conv(rows))
        variables = dense.trainable_weights + conv.trainable_weights
        return tape.gradient(loss, variables)

    seen = {}

    @tf.function(autograph=False)
    def joined():
        parts = [grads(tf.constant(x[i:i + 3])) for i in (0, 3, 6)]
        out = fused(parts)
        seen.update(kinds=[None if o is None else o.op.type for o in out],
                    kernels=[p[0].op for p in parts])
        return [tf.zeros(()) if o is None else o for o in out]

    @tf.function(autograph=False)
    def summed():
        return [tf.add_n(list(g)) for g in zip(*[grads(tf.constant(x[i:i + 3])) for i in (0, 3, 6)])]

    out, sums, whole = joined(), summed(), grads(tf.constant(x))
    assert seen["kinds"] == ["MatMul", "BiasAddGrad", None, None]  # the Dense kernel, bias
    for got, sum_, ref in zip(out[:2], sums[:2], whole[:2]):
        np.testing.assert_allclose(got, ref, rtol=1e-14)
        np.testing.assert_allclose(got, sum_, rtol=1e-12)
    assert all(op.type == "MatMul" and op.get_attr("transpose_a") and not op.outputs[0].consumers()
               for op in seen["kernels"])
    assert fused([[tf.constant(1.0)]]) == [None]  # one micro-batch: nothing to join


def test_a_weight_pass_footprint_counts_its_inputs_once_and_its_gradients(float64):
    """``fused_weights.footprint``, what a last stage weighs to join its ``W``: a ``Dense``
    layer's ``W`` keeps its input and its output's gradient alive (the bias gradient reads
    the same output gradient: counted once) and makes the kernel and bias gradients; a
    gradient that cannot be joined (a ``Conv1D`` filter's) or has no static shape gives
    no footprint."""
    from tarantella.pipeline.fused_weights import Footprint, footprint

    dense, conv = keras.layers.Dense(7, activation="tanh"), keras.layers.Conv1D(2, 3)
    found = {}

    def grads(layer, rows):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(rows))
        return tape.gradient(loss, layer.trainable_weights)

    @tf.function(autograph=False)
    def probe(rows, unknown, series):
        found.update(dense=footprint(grads(dense, rows)), unknown=footprint(grads(dense, unknown)),
                     conv=footprint(grads(conv, series)))
        return tf.zeros(())

    probe.get_concrete_function(tf.TensorSpec((4, 5), tf.float64), tf.TensorSpec((None, 5), tf.float64),
                                tf.TensorSpec((4, 6, 5), tf.float64))
    assert found["dense"] == Footprint(held=(4 * 5 + 4 * 7) * 8, made=(5 * 7 + 7) * 8)
    assert found["unknown"] is None and found["conv"] is None
