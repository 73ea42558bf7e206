"""Cutting models at SplitLayers (single process): the partitions run one after another
compute exactly what the whole model computes, every weight is in exactly one partition,
and a cut that cannot work is refused naming the layer."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tarantella as tnt
from tarantella.partition import PartitionError, partition

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
            for m in parts.models] == [["d1"], ["d2", "d3"], ["head"]]
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


def test_one_tensor_through_two_splits_crosses_once_and_multiple_outputs_stay_in_order():
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, name="h")(inp)
    left = SplitLayer(name="left")(h)
    right = SplitLayer(name="right")(h)
    o1 = keras.layers.Dense(2, name="o1")(left)
    o2 = keras.layers.Dense(3, name="o2")(right)
    model = keras.Model(inp, [o1, o2])
    parts = partition(model)
    assert len(parts.models[0].outputs) == 1, "the same tensor is sent once"
    assert parts.routes == [[0, 0]]
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


def test_a_branch_that_bypasses_the_cut_is_refused_naming_the_layer():
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="h")(inp)
    x = SplitLayer(name="cut")(h)
    x = keras.layers.Dense(4, name="g")(x)
    out = keras.layers.Add(name="residual")([x, h])  # h skips the cut
    with pytest.raises(PartitionError, match=r"layer 'residual' takes tensors of different "
                       r"partitions: 'g' \(partition 1\), 'h' \(partition 0\)"):
        partition(keras.Model(inp, out))


def test_a_layer_shared_across_the_cut_is_refused_naming_it():
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    x = SplitLayer(name="cut")(shared(inp))
    with pytest.raises(PartitionError, match=r"Dense 'shared' is used in partitions \[0, 1\]"):
        partition(keras.Model(inp, shared(x)))


def test_an_output_before_the_last_cut_is_refused_naming_it():
    inp = keras.Input((4,))
    early = keras.layers.Dense(2, name="early")(inp)
    late = keras.layers.Dense(2, name="late")(SplitLayer(name="cut")(early))
    with pytest.raises(PartitionError, match=r"model output .* is computed in partition 0"):
        partition(keras.Model(inp, [early, late]))


def test_sequential_and_subclassed_models_are_refused_with_what_to_do():
    seq = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), SplitLayer(),
                            keras.layers.Dense(1)])
    with pytest.raises(PartitionError, match=r"keras\.Sequential model: .* functional API"):
        partition(seq)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(PartitionError, match="not a functional Keras model"):
        partition(Sub())


def test_two_cuts_with_nothing_between_are_refused_naming_them():
    inp = keras.Input((4,))
    x = SplitLayer(name="cut_a")(keras.layers.Dense(4)(inp))
    x = SplitLayer(name="cut_b")(x)
    with pytest.raises(PartitionError, match=r"partition 1 of model .* holds no layer: nothing is "
                       r"computed between SplitLayers 'cut_a', 'cut_b'"):
        partition(keras.Model(inp, keras.layers.Dense(2)(x)))
