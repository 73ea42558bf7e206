"""A global batch smaller than the number of ranks trains exactly as plain Keras does.

With a global batch of 1, every rank but rank 0 has no sample in any step: each takes one
stand-in sample weighed by 0 (``tarantella.datasets``), so every rank runs the same step
and the same collectives, and the step equals the serial one. ``fit``, a dataset batched by
1, a short last batch, validation, ``evaluate``, ``predict`` and ``train_on_batch`` are
compared with plain Keras in the same rank process (``workers/small_batch_worker.py``, in
the 3-rank launch of the suite worker, ``tnt_keras_helpers.NATIVE_PATH``: two ranks without
samples), float64, relative tolerance 1e-9 (observed: ~1e-16). So tarantella accepts such
batches (tnt_core's ``micro_batch_sizes`` alone, without ``allow_empty``, still refuses them).
"""

from __future__ import annotations

import json

import pytest

from tnt_keras_helpers import NATIVE_PATH, launch_params

RTOL = 1e-9
pytestmark = pytest.mark.timeout(1500)  # it may start the launch and wait for it


@pytest.mark.parametrize("launch", launch_params([NATIVE_PATH]))
def test_global_batch_of_one_equals_plain_keras(launch, suite_runs):
    out, nprocs, _ = suite_runs.get(launch)
    for rank in range(nprocs):
        result = json.loads((out / "small_batches" / f"rank{rank}.json").read_text())
        assert result["size"] == nprocs
        assert len(result["cases"]) == 8
        for case, diffs in result["cases"].items():
            assert diffs["weights"] <= RTOL and diffs["returned"] <= RTOL, (rank, case, diffs)
