"""Training loops of one's own (``tnt.distribute_dataset``, ``tnt.DistributedOptimizer``,
``tnt.DistributedGradientTape``, ``tnt.broadcast_variables``) and Horovod scripts
(``tarantella.horovod``) equal plain Keras running the same loop on the global batches
(``workers/loop_worker.py``, in the suite's 3-rank launches: uneven shares and a last batch
smaller than the job). float64; relative tolerance 1e-5 (observed ~1e-16).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from loop_worker import CASES, RANKS

RTOL = 1e-5
pytestmark = pytest.mark.timeout(1500)  # the first test of a launch waits for it


def _load(path: Path) -> dict:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


@pytest.fixture(scope="session")
def loops(rank_suite) -> Path:
    out, nprocs, *_ = rank_suite
    if nprocs != RANKS:
        pytest.skip(f"the custom-loop checks run in the {RANKS}-rank launches")
    return out / "loops"


@pytest.fixture(scope="session")
def facts(loops) -> list[dict]:
    return [json.loads((loops / f"facts.rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.mark.parametrize("case", CASES)
def test_equals_plain_keras(case, loops, serial_suite, record_property):
    serial = _load(serial_suite / "loops" / f"{case}.serial.npz")
    weights = sorted(k for k in serial if k.startswith("w"))
    assert weights
    worst = 0.0
    for rank in range(RANKS):
        dist = _load(loops / f"{case}.rank{rank}.npz")
        for key in weights:
            d = _rel(dist[key], serial[key])
            assert d <= RTOL, f"{case}, rank {rank}, {key}: relative difference {d:.3e}"
            worst = max(worst, d)
        if "history" in serial:  # MetricAverageCallback: the averaged logs are serial's
            got, ref = json.loads(str(dist["history"])), json.loads(str(serial["history"]))
            assert sorted(got) == sorted(ref)
            for key in ref:
                assert _rel(got[key], ref[key]) <= RTOL, f"{case}, rank {rank}, history {key}"
        if "iterations" in serial:
            assert int(dist["iterations"]) == int(serial["iterations"])
    record_property("max_rel_diff", worst)


def test_the_gloo_job_takes_the_native_path(facts):
    for f in facts:
        if f["backend"] == "gloo":
            assert f["native"], "gloo offers the native hand-off: the loop must take it"


def test_gradients_handed_to_a_loop_stay_as_returned(loops):
    """The tape's gradients are the user's: later reductions do not change them (the Python
    path's reused buckets are copied out); sparse gradients stay sparse."""
    for rank in range(RANKS):
        got = _load(loops / f"guide_eager_tape.rank{rank}.npz")
        np.testing.assert_array_equal(got["held"], got["copied"])
        assert str(got["sparse"]) == "IndexedSlices"


def test_horovod_names_keep_horovods_meaning(facts):
    for rank, f in enumerate(facts):
        assert f["ranks"] == [rank, RANKS, *f["tnt_ranks"][2:], True]
        assert f["tnt_ranks"][:2] == [rank, RANKS]
        assert f["allreduce_average"] == [1.0, 3.0]  # ranks 0, 1, 2: [r, 2r + 1]
        assert f["allreduce_sum"] == f["allreduce_average_false"] == [3.0, 9.0]
        assert f["allreduce_max_int"] == [2, 0]
        assert f["allreduce_fp16"] == ["float32"]
        # divided before the float16 sum (30000 + 40000 + 50000 would overflow it)
        assert f["allreduce_fp16_average"] == pytest.approx([4e4], rel=1e-3)
        assert f["allgather_rows"] == [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]
        assert f["broadcast"] == [12]
        assert f["graph_allreduce_sum"] == [3.0, 9.0]
        assert f["graph_allgather"] == [[0.0, 1.0], [1.0, 3.0], [2.0, 5.0]]
        assert f["graph_broadcast_variables"] == [1.0, 5.0]
        assert f["optimizer_is_sgd"] == [True, "SGD", "SGD"], "saved as the plain optimizer"
        # Keras 2's opt.variables() gives Keras 3's list (horovod_loop broadcasts it so)
        # iteration, learning rate, and Adam's 2 slots for each of the 4 weights
        assert f["variables_spellings"] == [True, 10, "list", True]


def test_learning_rate_warmup_is_horovods(facts):
    """Horovod's warmup: ``lr / size * (e * (size - 1) / warmup + 1)`` at the fractional
    epoch ``e`` reached after the batch; 0.3 over 2 epochs of 4 batches, then constant."""
    expected = [0.3 / RANKS * ((epoch + (batch + 1) / 4) * (RANKS - 1) / 2 + 1)
                for epoch in range(2) for batch in range(4)] + [0.3] * 4
    for f in facts:
        np.testing.assert_allclose(f["warmup_lrs"], expected, rtol=1e-12)


def test_bad_arguments_say_what_to_do(facts):
    errors = facts[0]["errors"]
    assert errors["tape_of_a_list"].startswith("TypeError: DistributedGradientTape wraps a tf.GradientTape")
    assert errors["optimizer_of_a_name"].startswith(
        "TypeError: tnt.DistributedOptimizer wraps a Keras optimizer")
    assert "dataset.batch(global_batch_size)" in errors["unbatched_dataset"]
    assert errors["allreduce_adasum"].startswith("NotSupportedError: hvd.allreduce(op='adasum')")
    assert "gradient_accumulation_steps=2" in errors["backward_passes"]
