"""Cutting models into partitions (single process), at SplitLayers or automatically: the
partitions run one after another compute exactly what the whole model computes, every
weight is in exactly one partition, tensors that skip partitions and late inputs are
routed, automatic cuts balance the parameters as a brute-force search does, and a cut that
cannot work is refused naming the layer or the reason."""

from __future__ import annotations

import itertools
import math

import keras
import numpy as np
import pytest

import tarantella as tnt
from tarantella.pipeline.partition import PartitionError, partition

SplitLayer = tnt.keras.layers.SplitLayer


def _x(*shape: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal(shape).astype(np.float32)


def _same_weights_once(model: keras.Model, parts) -> None:
    ids = [id(w) for m in parts.models for w in m.weights]
    assert len(ids) == len(set(ids)), "a weight is in two partitions"
    assert set(ids) == {id(w) for w in model.weights}, "a weight is in no partition"
    assert sum(parts.param_count(p) for p in range(parts.num_partitions)) == model.count_params()


def _assert_runs_as_the_whole(model: keras.Model, parts, x) -> None:
    whole = keras.tree.map_structure(np.asarray, model(x))
    piecewise = keras.tree.map_structure(np.asarray, parts.run(x))
    keras.tree.map_structure(np.testing.assert_array_equal, piecewise, whole)


def test_an_mlp_cut_twice_gives_three_partitions_that_compose_to_the_model():
    inp = keras.Input((6,), name="features")
    x = keras.layers.Dense(16, activation="relu", name="d1")(inp)
    x = SplitLayer(name="split1")(x)
    x = keras.layers.Dense(8, activation="relu", name="d2")(x)
    x = keras.layers.Dense(8, activation="relu", name="d3")(x)
    x = SplitLayer(name="split2")(x)
    out = keras.layers.Dense(3, name="head")(x)
    model = keras.Model(inp, out, name="mlp")
    parts = partition(model)
    assert parts.num_partitions == 3
    assert parts.cuts == [["split1"], ["split2"]]
    assert [[layer.name for layer in m.layers if not isinstance(layer, keras.layers.InputLayer)]
            for m in parts.models] == [["d1"], ["split1", "d2", "d3"], ["split2", "head"]]
    assert [parts.param_count(p) for p in range(3)] == [6 * 16 + 16, 16 * 8 + 8 + 8 * 8 + 8, 8 * 3 + 3]
    _same_weights_once(model, parts)
    _assert_runs_as_the_whole(model, parts, _x(5, 6))


def test_branches_with_a_split_each_and_several_tensors_through_one_split():
    inp = keras.Input((4,))
    a = keras.layers.Dense(5, name="a")(inp)
    b = keras.layers.Dense(3, name="b")(inp)
    c = keras.layers.Dense(2, name="c")(inp)
    a = SplitLayer(name="cut_a")(a)
    b, c = SplitLayer(name="cut_bc")([b, c])
    joined = keras.layers.Concatenate(name="join")([a, b, c])
    out = keras.layers.Dense(1, name="out")(joined)
    model = keras.Model(inp, out)
    parts = partition(model)
    assert parts.num_partitions == 2 and sorted(parts.cuts[0]) == ["cut_a", "cut_bc"]
    assert len(parts.models[0].outputs) == 3 and len(parts.models[1].inputs) == 3
    _same_weights_once(model, parts)
    _assert_runs_as_the_whole(model, parts, _x(4, 4))


def test_one_tensor_through_two_splits_crosses_once():
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, name="h")(inp)
    left = SplitLayer(name="left")(h)
    right = SplitLayer(name="right")(h)
    o1 = keras.layers.Dense(2, name="o1")(left)
    o2 = keras.layers.Dense(3, name="o2")(right)
    model = keras.Model(inp, [o1, o2])
    parts = partition(model)
    assert len(parts.models[0].outputs) == 1 and len(parts.received[1]) == 1, "sent once"
    _assert_runs_as_the_whole(model, parts, _x(3, 4))


def test_a_skip_across_two_cuts_passes_through_the_stage_between():
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="h")(inp)
    x = keras.layers.Dense(4, name="g")(SplitLayer(name="cut1")(h))
    x = keras.layers.Dense(4, name="k")(SplitLayer(name="cut2")(x))
    out = keras.layers.Add(name="residual")([x, h])  # h skips partition 1
    model = keras.Model(inp, out)
    parts = partition(model)
    assert parts.num_partitions == 3
    assert [parts.param_count(p) for p in range(3)] == [20, 20, 20]
    assert len(parts.received[1]) == 1 and len(parts.received[2]) == 2, \
        "h goes to partition 1 once (for cut1 and the skip), then on with g's output"
    assert sorted(kind for kind, _ in parts.emits[1]) == ["computed", "received"]
    _same_weights_once(model, parts)
    _assert_runs_as_the_whole(model, parts, _x(5, 4))


def test_an_input_used_late_is_read_by_its_stage_not_routed():
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    x = keras.layers.Dense(3, name="d0")(a)
    x = keras.layers.Dense(3, name="d1")(SplitLayer()(x))
    x = keras.layers.Dense(3, name="d2")(SplitLayer()(x))
    out = keras.layers.Dense(1, name="out")(keras.layers.Concatenate()([x, b]))
    model = keras.Model({"a": a, "b": b}, out)
    parts = partition(model)
    assert [len(r) for r in parts.received] == [0, 1, 1], "b is sent nowhere"
    assert parts.feeds[2] == [("received", 0), ("x", 1)] and not parts.reads_x(1)
    _assert_runs_as_the_whole(model, parts, {"a": _x(3, 4), "b": _x(3, 2) + 1})


def test_outputs_of_every_partition_travel_to_the_last_in_the_models_structure():
    inp = keras.Input((4,))
    early = keras.layers.Dense(2, name="early")(inp)
    middle = keras.layers.Dense(3, name="middle")(SplitLayer()(early))
    late = keras.layers.Dense(2, name="late")(SplitLayer()(middle))
    model = keras.Model(inp, {"late": late, "early": early, "middle": middle})
    parts = partition(model)
    assert parts.num_partitions == 3
    assert [kind for kind, _ in parts.emits[2]].count("received") == 2
    _assert_runs_as_the_whole(model, parts, _x(3, 4))


def test_a_model_without_split_layers_is_one_partition_and_split_is_the_identity_elsewhere():
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Dense(2)(inp))
    assert partition(model).num_partitions == 1
    layer = SplitLayer()
    x = _x(2, 3)
    np.testing.assert_array_equal(np.asarray(layer(x)), x)


def test_a_saved_model_with_split_layers_loads_and_computes_the_same(tmp_path):
    inp = keras.Input((3,))
    x = SplitLayer(name="cut")(keras.layers.Dense(4)(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(x))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.get_layer("cut"), SplitLayer)
    np.testing.assert_array_equal(np.asarray(loaded(_x(2, 3))), np.asarray(model(_x(2, 3))))
    assert partition(loaded).num_partitions == 2


def test_a_layer_shared_across_the_cut_is_refused_naming_it():
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    x = SplitLayer(name="cut")(shared(inp))
    with pytest.raises(PartitionError, match=r"Dense 'shared' is used in partitions \[0, 1\]"):
        partition(keras.Model(inp, shared(x)))


def test_sequential_models_are_cut_and_unbuilt_or_subclassed_ones_refused():
    seq = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), SplitLayer(),
                            keras.layers.Dense(1)])
    parts = partition(seq)
    assert parts.num_partitions == 2
    _assert_runs_as_the_whole(seq, parts, _x(4, 3))
    with pytest.raises(PartitionError, match=r"Sequential model 'unbuilt' has no input shape "
                       r"yet, .*: start it with keras\.Input\(shape=\.\.\.\)"):
        partition(keras.Sequential([keras.layers.Dense(2)], name="unbuilt"))

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(PartitionError, match="not a functional or Sequential Keras model"):
        partition(Sub())


def test_two_cuts_with_nothing_between_are_refused_naming_them():
    inp = keras.Input((4,))
    x = SplitLayer(name="cut_a")(keras.layers.Dense(4)(inp))
    x = SplitLayer(name="cut_b")(x)
    with pytest.raises(PartitionError, match=r"partition 1 of model .* holds no layer: nothing is "
                       r"computed between SplitLayers 'cut_a', 'cut_b'"):
        partition(keras.Model(inp, keras.layers.Dense(2)(x)))


def test_split_layers_decide_and_a_different_stage_count_is_refused():
    inp = keras.Input((4,))
    x = SplitLayer(name="cut")(keras.layers.Dense(4)(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(x), name="cut_once")
    parts = partition(model, 2)
    assert parts.num_partitions == 2 and not parts.automatic
    with pytest.raises(PartitionError, match=r"model 'cut_once' has SplitLayers for 2 partitions "
                       r"\(1 cuts: 'cut'\), but num_pipeline_stages=3"):
        partition(model, 3)


def _chain(widths, extra=()) -> keras.Sequential:
    layers = [keras.Input((widths[0],))]
    for i, w in enumerate(widths[1:]):
        layers.append(keras.layers.Dense(w, name=f"d{i}"))
        if i in extra:
            layers.append(keras.layers.Activation("relu", name=f"act{i}"))  # no parameters
    return keras.Sequential(layers, name="chain")


@pytest.mark.parametrize("widths,stages", [((4, 8, 32, 4, 16, 16, 2), 3),
                                           ((6, 64, 4, 4, 4, 4, 4, 64, 3), 4),
                                           ((3, 5, 5, 5, 5, 5), 5)])
def test_automatic_cuts_balance_parameters_as_a_brute_force_search_does(widths, stages):
    model = _chain(widths, extra={1, 3})
    parts = partition(model, stages)
    assert parts.automatic and parts.num_partitions == stages
    got = [parts.param_count(p) for p in range(stages)]
    costs = [layer.count_params() for layer in model.layers]
    best = min((max(seg), sum(c * c for c in seg)) for seg in (
        [sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, len(costs)))]
        for cut in itertools.combinations(range(1, len(costs)), stages - 1)))
    assert (max(got), sum(c * c for c in got)) == best, (got, best)
    _same_weights_once(model, parts)
    _assert_runs_as_the_whole(model, parts, _x(3, widths[0]))


def test_automatic_cuts_fall_between_residual_blocks_and_too_many_stages_are_refused():
    inp = keras.Input((4,))
    x = keras.layers.Dense(8, name="stem")(inp)
    for b in range(2):
        y = keras.layers.Dense(8, name=f"block{b}_a")(x)
        y = keras.layers.Dense(8, name=f"block{b}_b")(y)
        x = keras.layers.Add(name=f"block{b}_add")([x, y])
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(x), name="resnet")
    parts = partition(model, 3)
    for p in (1, 2):
        assert len(parts.received[p]) == 1, "a cut inside a block would send two tensors"
    _assert_runs_as_the_whole(model, parts, _x(3, 4))
    # stem | block0 | block1 | head: three places, so at most four partitions
    assert partition(model, 4).num_partitions == 4
    with pytest.raises(PartitionError, match=r"model 'resnet' cannot be cut into 5 partitions "
                       r"automatically: .* it has only 3 \(after 'stem', 'block0_add', "
                       r"'block1_add'\); use num_pipeline_stages=4 or fewer"):
        partition(model, 5)


def test_an_automatic_cut_never_separates_two_uses_of_a_layer():
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    x = shared(keras.layers.Dense(4, name="a")(inp))
    x = shared(keras.layers.Dense(4, name="b")(x))
    model = keras.Model(inp, keras.layers.Dense(2, name="c")(x))
    parts = partition(model, 2)
    names = [{layer.name for layer in m.layers} for m in parts.models]
    assert sum("shared" in n for n in names) == 1
    _assert_runs_as_the_whole(model, parts, _x(2, 4))


def test_a_deferred_model_is_cut_without_reading_a_variable():
    calls = []

    class Counted(keras.initializers.Initializer):
        """Records every value made (Keras makes a deferred variable's value on a read)."""

        def __call__(self, shape, dtype=None):
            calls.append(shape)
            return keras.ops.zeros(shape, dtype=dtype)

    with keras.StatelessScope(initialize_variables=False):
        model = keras.Sequential([keras.Input((6,))] + [
            keras.layers.Dense(w, kernel_initializer=Counted(), bias_initializer=Counted())
            for w in (32, 32, 8, 3)])
    assert calls == [], "the premise: the model was built without values"
    parts = partition(model, 2)
    assert calls == [], "partitioning read a variable"
    counts = [parts.param_count(p) for p in range(2)]
    assert sum(counts) == sum(math.prod(w.shape) for w in model.weights) and min(counts) > 0
