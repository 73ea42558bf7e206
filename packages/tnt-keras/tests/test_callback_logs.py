"""The logs a callback wrapped in ``tnt.keras.callbacks.Callback`` receives, against the logs
plain Keras passes (``workers/callback_logs_worker.py``, in the 2-rank launch of the suite
worker): with ``aggregate_logs=True`` the serial run's, with ``aggregate_logs=False`` what
plain Keras computes on this rank's own micro-batches; with ``run_on_all_ranks=False`` on the
master only. In a model's first ``fit``/``evaluate``/``predict`` and in later ones (whose
steps Keras traced before a callback wanted rank-local logs: they once received zeros).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tnt_keras_helpers import PYTHON_PATH, launch_params

pytestmark = pytest.mark.timeout(1500)  # the first test of a launch waits for it
RTOL = 1e-7  # float64 workers: observed differences are float64 round-off

#: (aggregate_logs, run_on_all_ranks) of the worker's recorders, in its order
COMBINATIONS = [(True, True), (True, False), (False, True), (False, False)]


@pytest.fixture(scope="session", params=launch_params([PYTHON_PATH]))
def reports(request, suite_runs) -> list[dict]:
    out, nprocs, _ = suite_runs.get(request.param)
    return [json.loads((out / "callback_logs" / f"rank{r}.json").read_text()) for r in range(nprocs)]


def _assert_same_logs(got: list, want: list, where: str) -> None:
    assert [(kind, step) for kind, step, _ in got] == [(kind, step) for kind, step, _ in want], where
    for (kind, step, logs), (_, _, expected) in zip(got, want):
        assert logs.keys() == expected.keys(), f"{where} {kind} {step}: {sorted(logs)} vs {sorted(expected)}"
        for key, value in expected.items():
            np.testing.assert_allclose(logs[key], value, rtol=RTOL, atol=1e-12,
                                       err_msg=f"{where} {kind} {step} {key}")


@pytest.mark.parametrize("scenario", ["first", "later"])
@pytest.mark.parametrize("aggregate", [True, False], ids=["aggregated", "rank_local"])
def test_callback_logs_are_plain_keras_logs(reports, scenario, aggregate):
    assert len(reports) == 2
    for report in reports:
        rank = report["rank"]
        # the serial logs, or plain Keras' on this rank's own shard
        reference = report["serial" if aggregate else "own"]
        for call in ("fit", "evaluate", "predict"):
            for index, (agg, everywhere) in enumerate(COMBINATIONS):
                if agg != aggregate:
                    continue
                got = report[scenario][call][index]
                where = (f"rank {rank}, {scenario} {call}, aggregate_logs={agg}, "
                         f"run_on_all_ranks={everywhere}")
                if not everywhere and rank != 0:
                    assert got == [], f"{where}: ran on a rank other than the master"
                    continue
                assert got, f"{where}: the callback was not called"
                _assert_same_logs(got, reference[call], where)
    if not aggregate:  # the ranks' shards differ: so do their own logs
        first, second = (r["own"]["fit"][-1][2]["loss"] for r in reports)
        assert first != pytest.approx(second)
