"""A global batch smaller than the number of ranks trains exactly as plain Keras does.

With a global batch of 1 on 2 ranks, rank 1 has no sample in any step: it takes one
stand-in sample weighed by 0 (``tarantella.datasets``), so every rank runs the same step
and the same collectives, and the step equals the serial one. ``fit``, a dataset batched by
1, a short last batch, validation, ``evaluate``, ``predict`` and ``train_on_batch`` are
compared with plain Keras in the same rank process (``workers/small_batch_worker.py``),
float64, relative tolerance 1e-9 (observed: ~1e-16). So tarantella accepts such batches
(tnt_core's ``micro_batch_sizes`` alone, without ``allow_empty``, still refuses them).
"""

from __future__ import annotations

import json

import pytest

from tnt_keras_helpers import BACKENDS, run_workers

RTOL = 1e-9
pytestmark = pytest.mark.timeout(600)


@pytest.mark.skipif(not BACKENDS, reason="no installed backend can serve launched ranks")
def test_global_batch_of_one_on_two_ranks_equals_plain_keras(tmp_path):
    run_workers("small_batch_worker.py", [str(tmp_path)], 2, BACKENDS[0], timeout=500)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["size"] == 2
        assert len(result["cases"]) == 8
        for case, diffs in result["cases"].items():
            assert diffs["weights"] <= RTOL and diffs["returned"] <= RTOL, (rank, case, diffs)
