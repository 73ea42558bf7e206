"""Keras workflows as users write them equal plain Keras, or refuse clearly
(``workers/fidelity_worker.py``; 1, 2 and 3 ranks, uneven last batches everywhere).

Each row runs the same script in plain Keras and with ``tnt.Model``: weights, History and
the case's extra results (evaluate, predict, on-batch logs) are compared with a relative
tolerance of 1e-5 (``max|a - s| / max|s|``, float64; observed ~1e-16..1e-14). Mixed
precision computes in float16, whose round-off of a different summation order is amplified
over the run; there the step count and the loss-scale decisions must be equal, and the
weights within float16 reach (measured up to 0.12 relative on 3 ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fidelity_worker import CASES

RTOL = 1e-5
FLOAT16_RTOL = 0.25
pytestmark = pytest.mark.timeout(1500)  # the first test of a launch waits for it


def _flat(value) -> list:
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _flat(value[k])]
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    return [value]


def _numbers(leaves: list) -> tuple[list[float], list]:
    """The numeric leaves, and the others (a step's text or None logs: compared exactly)."""
    numeric = [isinstance(x, (int, float)) and not isinstance(x, bool) for x in leaves]
    return ([float(x) for x, n in zip(leaves, numeric) if n],
            [x for x, n in zip(leaves, numeric) if not n])


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12)) if b.size else 0.0


def _load(path: Path) -> dict:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="session")
def fidelity(rank_suite):
    out, nprocs, _, launch = rank_suite
    return out / "fidelity", nprocs, launch


@pytest.fixture(scope="session")
def serial_fidelity(serial_suite) -> Path:
    return serial_suite / "fidelity"


@pytest.mark.parametrize("case", CASES)
def test_equals_plain_keras(case, fidelity, serial_fidelity, record_property):
    out, nprocs, launch = fidelity
    if not launch.runs_case(case):
        pytest.skip(f"{case} runs in the other launches: the {launch.id} launch runs "
                    f"{', '.join(launch.fidelity_cases)} (tnt_keras_helpers.SUITE_LAUNCHES)")
    serial = _load(serial_fidelity / f"{case}.serial.npz")
    worst = 0.0
    for rank in range(nprocs):
        dist = _load(out / f"{case}.rank{rank}.npz")
        assert sorted(dist) == sorted(serial), f"rank {rank}: results {sorted(dist)} vs {sorted(serial)}"
        for key, ref in serial.items():
            got = dist[key]
            if ref.dtype.kind in "US":  # JSON: History, evaluate, logs
                got_j, ref_j = json.loads(str(got)), json.loads(str(ref))
                if isinstance(ref_j, dict):
                    assert sorted(got_j) == sorted(ref_j), f"{case} {key}: keys differ"
                (got, got_other), (ref, ref_other) = _numbers(_flat(got_j)), _numbers(_flat(ref_j))
                assert got_other == ref_other, f"{case} {key}: {got_other} vs {ref_other}"
            if case == "mixed_precision":
                if key in ("iterations", "loss_scale"):
                    assert float(got) == float(ref), f"rank {rank} {key}: {got} vs serial {ref}"
                    continue
                tolerance = FLOAT16_RTOL
            else:
                tolerance = RTOL
            d = _rel(got, ref)
            assert d <= tolerance, f"{case}, rank {rank}, {key}: relative difference {d:.3e}"
            worst = max(worst, d)
    record_property("max_rel_diff", worst)


@pytest.fixture(scope="session")
def facts(fidelity):
    out, nprocs, _ = fidelity
    return [json.loads((out / f"facts.rank{r}.json").read_text()) for r in range(nprocs)], nprocs


def test_tnt_model_is_a_keras_model(facts):
    ranks, _ = facts
    for f in ranks:
        assert f["same_object"] and f["isinstance"] == [True, True, True]
        assert f["nested_output_shape"] == [3, 1] and f["model_is_m"]
        assert f["tnt_saved_class"] == "Sequential", "the file is a plain Keras model"
        assert f["export_exists"] and f["tmp_left"] == []
    assert ranks[0]["saved_class"] == "Sequential"
    # Keras' report of the export names the user's path (it named the temporary one)
    printed = ranks[0]["export_printed"]
    assert printed.startswith(f"Saved artifact at '{ranks[0]['export_dir']}'."), printed[:300]
    assert "tnt-tmp" not in printed
    assert all(f["export_printed"] == "" for f in ranks[1:]), "the master writes and reports"


def test_each_rank_draws_its_own_random_stream(facts):
    ranks, nprocs = facts
    states = [tuple(map(tuple, f["seed_states"])) for f in ranks]
    assert len(set(states)) == nprocs, f"ranks share dropout seed states: {states}"


def test_a_model_that_differs_between_ranks_is_refused_on_every_rank(facts):
    ranks, nprocs = facts
    if nprocs == 1:
        assert ranks[0]["differing_model"] == "trained"
        return
    for f in ranks:
        assert f["differing_model"].startswith(
            "the model differs between ranks: rank 0 has 6 variables (23 values), rank 1 has 6 "
            "(28 values)"), f["differing_model"]


def test_errors_name_the_users_path(facts):
    ranks, _ = facts
    assert "no_such_dir/model.keras" in ranks[0]["save_error"]
    assert all("tnt-tmp" not in f["save_error"] for f in ranks)


def test_what_cannot_equal_serial_is_refused_naming_it(facts):
    """A metric state that is not a sum (a maximum, a recomputed ratio) or whose increment
    pairs every sample with every other (Keras' guide's CategoricalTruePositives compares
    (n,) labels with (n, 1) predictions), and an add_loss term that is neither a mean nor a
    sum over the samples: refused on every rank, in one line naming the state or the layer
    (on one rank too: the state handling is the same)."""
    ranks, _ = facts
    for f in ranks:
        for key, named in (("metric_max", "metric state 'running_max/peak'"),
                           ("metric_ratio", "metric state 'ratio/rate'"),
                           ("metric_pairs", "metric state 'categorical_true_positives/ctp'"),
                           ("added_loss_square", "layer 'squared_mean' adds a loss with add_loss()")):
            assert f[key].startswith(named), f"{key}: {f[key]}"
            assert "\n" not in f[key]
