"""An elastic job's ``fit`` goes on over the survivors when ranks die, and its result is
still plain Keras' running the same script (``workers/elastic_fit_worker.py``).

One launch, ``tnt run -n 3 --min-np 1``, two failures: rank 2 is SIGKILLed as a validation
step begins in the first epoch (3 -> 2 ranks: two survivors connect anew in mid-validation),
rank 1 as a train step begins in the second (2 -> 1); then ``evaluate``, ``predict`` and
``predict_on_batch`` on the survivor.
Float64, so a difference beyond round-off is a wrong step, not noise.

A rank one operation ahead of another (its last collective completed, the other's failed)
is placed there by ``workers/elastic_agree_worker.py`` in the suite's 2-rank launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tnt_keras_helpers import BACKENDS, PYTHON_PATH, QUIET, WORKERS, launch_params, run_serial

NO_GLOO = pytest.mark.skipif("gloo" not in BACKENDS,
                             reason=f"elastic jobs need the gloo backend (launchable: {BACKENDS})")

TNT = Path(sys.executable).with_name("tnt")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@NO_GLOO
def test_ranks_die_and_fit_still_gives_plain_keras_results(tmp_path):
    run_serial("elastic_fit_worker.py", ["serial", str(tmp_path)])
    before = _shm()
    env = {**os.environ, **QUIET, "TNT_TIMEOUT_S": "30"}
    proc = subprocess.run(
        [str(TNT), "run", "-n", "3", "--min-np", "1", "--backend", "gloo", "--",
         str(WORKERS / "elastic_fit_worker.py"), "tnt", str(tmp_path), "2:test:0:1,1:train:1:3"],
        env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    for says in ("going on with 2 rank(s), generation 1", "going on with 1 rank(s), generation 2",
                 "training goes on with 2 rank(s) after", "the test step in flight redone",
                 "training goes on with 1 rank(s) after", "the train step in flight redone"):
        assert says in output, output[-4000:]
    recoveries = json.loads((tmp_path / "recoveries.json").read_text())
    assert recoveries["size"] == 1 and len(recoveries["recoveries"]) == 2, recoveries

    serial = dict(np.load(tmp_path / "result-serial.npz"))
    elastic = dict(np.load(tmp_path / "result-tnt.npz"))
    assert sorted(serial) == sorted(elastic)
    assert {"h_loss", "h_accuracy", "h_auc", "h_val_loss", "h_val_auc", "e_loss", "predicted",
            "on_batch"} <= set(serial)
    for key in sorted(serial):
        np.testing.assert_allclose(elastic[key], serial[key], rtol=1e-9, atol=1e-12, err_msg=key)
    assert _shm() <= before, sorted(_shm() - before)


@pytest.fixture(scope="module", params=launch_params([PYTHON_PATH]))
def agreed(request, suite_runs) -> list[dict]:
    out, nprocs, _ = suite_runs.get(request.param)
    return [json.loads((out / "elastic_agree" / f"rank{r}.json").read_text()) for r in range(nprocs)]


@pytest.mark.timeout(1500)  # the first test of a launch waits for it
def test_a_rank_behind_takes_the_state_and_logs_of_the_rank_ahead(agreed):
    behind, ahead = agreed
    assert behind["finished_for_me"] is True and ahead["finished_for_me"] is False
    assert behind["done"] == ahead["done"] == 5
    assert behind["state"] == ahead["state"] == ahead["ahead"]  # weights, slots, metric states
    assert behind["last"] == ahead["last"] == {"loss": 0.25, "mae": 0.5}
    assert behind["again"] is False and ahead["again"] is False  # level: both redo
    assert behind["state_again"] == behind["state"] and ahead["state_again"] == ahead["state"]
