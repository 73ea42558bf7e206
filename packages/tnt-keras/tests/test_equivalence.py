"""Data-parallel training equals serial training with the same global batch.

An MLP with Ftrl, LeNet-5 with SGD, a small Sequential CNN with RMSprop, a sub-classed
model with SGD+momentum and a two-input functional model (fed NumPy dicts with
``batch_size=``) with Adam: each model once, each optimizer once, since the optimizer only
sees the reduced gradient (``workers/train_worker.py``). 2 epochs, on the launches of
``rank_suite`` (conftest.py); the global batch sizes (10, 8, 7, 5, 6) are not divided by 2
or 3 ranks everywhere, every epoch ends with a partial batch, and the MLP's last batch has
one sample, so ranks 1 and 2 have none. Checked: the weights on every rank, ``History``
with validation data, ``evaluate`` and ``predict``.

Tolerance: relative difference <= 1e-5, measured as ``max|a - s| / max|s|`` per tensor
(and per logged value). The workers compute in float64 (see ``workers/train_worker.py``
for why float32 cannot show 1e-5 honestly after Adam/RMSprop); observed differences are
~1e-16..1e-13, i.e. float64 round-off of a different summation order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from train_worker import tags

RTOL = 1e-5
TAGS = tags()
pytestmark = pytest.mark.timeout(1500)  # the first test of a launch waits for it


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1e-12)
    return float(np.max(np.abs(a - b))) / scale if a.size else 0.0


@pytest.fixture(scope="session")
def serial_results(serial_suite) -> Path:
    return serial_suite / "train"


@pytest.fixture(scope="session")
def distributed_results(rank_suite) -> tuple[Path, int]:
    out, nprocs, *_ = rank_suite
    return out / "train", nprocs


def _load(path: Path) -> dict:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _compare_logs(dist: dict, serial: dict, what: str) -> float:
    assert dist.keys() == serial.keys(), f"{what}: keys {sorted(dist)} != {sorted(serial)}"
    worst = 0.0
    for key in serial:
        d = rel_diff(np.array(dist[key]), np.array(serial[key]))
        assert d <= RTOL, f"{what}[{key}]: {dist[key]} vs serial {serial[key]} (rel {d:.2e})"
        worst = max(worst, d)
    return worst


@pytest.mark.parametrize("tag", TAGS)
def test_every_rank_equals_serial(tag, serial_results, distributed_results, record_property):
    out, nprocs = distributed_results
    serial = _load(serial_results / f"{tag}.serial.npz")
    weights = sorted(k for k in serial if k.startswith("w"))
    worst = {"weights": 0.0, "history": 0.0, "evaluate": 0.0, "predict": 0.0}
    for rank in range(nprocs):
        dist = _load(out / f"{tag}.rank{rank}.npz")
        assert sorted(k for k in dist if k.startswith("w")) == weights
        for key in weights:
            d = rel_diff(dist[key], serial[key])
            assert d <= RTOL, f"rank {rank}, weight {key}: relative difference {d:.3e} > {RTOL}"
            worst["weights"] = max(worst["weights"], d)
        worst["history"] = max(worst["history"], _compare_logs(
            json.loads(str(dist["history"])), json.loads(str(serial["history"])), f"rank {rank} history"))
        assert "val_loss" in json.loads(str(serial["history"]))
        worst["evaluate"] = max(worst["evaluate"], _compare_logs(
            json.loads(str(dist["evaluate"])), json.loads(str(serial["evaluate"])),
            f"rank {rank} evaluate"))
        d = rel_diff(dist["predict"], serial["predict"])  # full result, in order, on every rank
        assert d <= RTOL, f"rank {rank} predict: relative difference {d:.3e}"
        worst["predict"] = max(worst["predict"], d)
    for key, value in worst.items():
        record_property(f"max_rel_diff_{key}", value)
    print(f"{tag} on {nprocs} ranks: max relative differences {worst}")
