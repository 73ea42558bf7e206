"""The native gradient path (tarantella's TensorFlow ops over the backend's native table)
gives the Python path's bits, and a failing peer ends it as it ends the Python path.

Runs on the launchable backends that offer the native hand-off (gloo); with none, the
module is skipped and says why.
"""

from __future__ import annotations

import numpy as np
import pytest

from tnt_core.testing import launch_ranks
from tnt_keras_helpers import BACKENDS, QUIET, WORKERS, run_workers

NATIVE = [b for b in BACKENDS if b == "gloo"]
pytestmark = pytest.mark.skipif(not NATIVE, reason="no launchable backend with a native table "
                                                   f"(launchable: {BACKENDS})")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("native")
    for flag in ("true", "false"):
        run_workers("native_worker.py", [str(out), "train"], 2, NATIVE[0],
                    env={"TNT_NATIVE_OPS": flag})
    return {(path, rank): dict(np.load(out / f"{path}-rank{rank}.npz"))
            for path in ("native", "python") for rank in (0, 1)}


def test_each_path_is_the_one_asked_for(trained):
    for rank in (0, 1):
        for dtype in ("float32", "float16"):
            assert trained[("native", rank)][f"{dtype}_native"].tolist() == [True]
            assert trained[("python", rank)][f"{dtype}_native"].tolist() == [False]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_native_and_python_paths_train_the_same_bits(trained, dtype):
    """Unequal micro-batches (4 and 3 of 7): the scaled copy into the buckets is exercised."""
    native, python = trained[("native", 0)], trained[("python", 0)]
    keys = sorted(k for k in native if k.startswith(dtype + "_") and not k.endswith("native"))
    assert len(keys) == 6
    for key in keys:
        assert native[key].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(native[key], python[key], err_msg=key)
        np.testing.assert_array_equal(native[key], trained[("native", 1)][key], err_msg=key)


def test_a_peer_killed_mid_training_ends_the_job_with_its_failure(tmp_path):
    result = launch_ranks([str(WORKERS / "native_worker.py"), str(tmp_path), "kill"], 2,
                          backend=NATIVE[0], timeout=300, tnt_timeout_s=60, env=QUIET)
    assert not result.timed_out, result.describe()
    rank0, rank1 = result.ranks
    assert rank1.returncode == -9, result.describe()
    assert rank0.returncode == 75, result.describe()  # tnt_core.PEER_FAILURE_EXIT_CODE
    assert "CommError" in rank0.stderr, result.describe()
    assert not (tmp_path / "finished-rank0").exists()


def test_ranks_with_different_bucket_plans_both_raise_the_mismatch(tmp_path):
    """Different fusion thresholds per rank: the plans differ, the agreement before the
    first allreduce says so on every rank, as the Python path's does."""
    run_workers("native_worker.py", [str(tmp_path), "mismatch"], 2, NATIVE[0], timeout=300)
    for rank in (0, 1):
        text = (tmp_path / f"mismatch-rank{rank}.txt").read_text()
        assert text.startswith("CollectiveMismatchError: "), text
        assert "fused allreduce plan" in text, text
