"""How a pipeline cuts a global batch (``tarantella.pipeline.micro_batches``), single process: the
pipelines' rows cover the batch once, micro-batches differ by at most one sample and are
never empty, a nest of tensors splits and joins back whole, and each micro-batch's mean
loss weighted by its share of the batch adds up to Keras' loss of the whole batch, with
sample weights and uneven micro-batches, in float64."""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest

from tarantella.pipeline.micro_batches import concat, micro_batch_sizes, pipeline_rows, shares, split


def test_micro_batches_differ_by_one_sample_at_most_the_larger_first_and_never_empty():
    assert micro_batch_sizes(16, 3) == [6, 5, 5]
    assert micro_batch_sizes(17, 4) == [5, 4, 4, 4]
    assert micro_batch_sizes(3, 8) == [1, 1, 1]
    assert micro_batch_sizes(0, 4) == []
    for batch in range(1, 40):
        for count in range(1, 9):
            sizes = micro_batch_sizes(batch, count)
            assert sum(sizes) == batch and len(sizes) == min(batch, count)
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_the_pipelines_rows_cover_the_global_batch_once():
    for batch, pipelines in ((10, 3), (8, 2), (2, 3), (1, 2)):
        rows = [pipeline_rows(batch, r, pipelines) for r in range(pipelines)]
        assert rows[0].start == 0 and rows[-1].stop == batch
        assert all(a.stop == b.start for a, b in itertools.pairwise(rows))
    assert [r.stop - r.start for r in (pipeline_rows(2, i, 3) for i in range(3))] == [1, 1, 0]


def test_shares_weigh_each_micro_batch_by_its_part_of_the_global_batch():
    assert shares([6, 5, 5], 16) == [6 / 16, 5 / 16, 5 / 16]
    # a pipeline of two (ALL) with 8 of 16 rows: its micro-batches weigh half the batch
    assert sum(shares(micro_batch_sizes(8, 3), 16)) == pytest.approx(0.5)


def test_a_nest_of_tensors_splits_into_micro_batches_and_joins_back():
    rng = np.random.default_rng(1)
    x = {"a": rng.random((7, 3)), "b": (rng.random((7,)), rng.random((7, 2, 2)))}
    parts = split(x, [3, 2, 2])
    assert [p["b"][1].shape[0] for p in parts] == [3, 2, 2]
    np.testing.assert_array_equal(parts[1]["a"], x["a"][3:5])
    joined = concat(parts)
    keras.tree.map_structure(np.testing.assert_array_equal, joined, x)
    assert split(None, [2, 2]) == [None, None]
    assert concat([]) is None


@pytest.mark.parametrize("loss", [keras.losses.MeanSquaredError(dtype="float64"),
                                  keras.losses.CategoricalCrossentropy(from_logits=True, dtype="float64")],
                         ids=["mse", "crossentropy"])
def test_shares_of_micro_batch_losses_add_up_to_the_batch_loss_with_sample_weights(loss):
    rng = np.random.default_rng(2)
    batch = 13
    y = rng.random((batch, 4))
    y /= y.sum(axis=1, keepdims=True)
    predictions = rng.standard_normal((batch, 4))
    weights = rng.random(batch)
    weights[[2, 7]] = 0.0  # a sample weighed out counts in the batch's size, as in Keras
    whole = float(loss(y, predictions, sample_weight=weights))
    for count in (1, 3, 4, 13):
        sizes = micro_batch_sizes(batch, count)
        pieces = zip(split(y, sizes), split(predictions, sizes), split(weights, sizes), shares(sizes, batch))
        total = sum(float(loss(yk, pk, sample_weight=wk)) * share for yk, pk, wk, share in pieces)
        assert total == pytest.approx(whole, rel=1e-12), count
