"""The native gradient path (tarantella's TensorFlow ops over the backend's native table)
gives the Python path's bits, for DATA's step and for a pipeline stage's replicas (a group
of the job), and a failing or hung peer ends it as it ends the Python path. The
point-to-point ops move every dtype bit for bit, and a receive from a dead peer fails with
CommError.

Runs on the launchable backends that offer the native hand-off (gloo); with none, the
module is skipped and says why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

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


def test_compressed_gradients_take_the_native_path(trained):
    """TNT_GRADIENT_COMPRESSION=fp16: the float32 model's buckets are float16 and go through
    the native ops (the float16 model above shows both paths give such buckets the same
    bits); both ranks get the same float32 weights, near the uncompressed run's, not equal."""
    native = trained[("native", 0)]
    assert native["fp16wire_native"].tolist() == trained[("native", 1)]["fp16wire_native"].tolist() == [True]
    for i in range(6):
        key = f"fp16wire_{i}"
        assert native[key].dtype == np.float32
        np.testing.assert_array_equal(native[key], trained[("native", 1)][key], err_msg=key)
        rel = np.linalg.norm(native[key] - native[f"float32_{i}"]) / np.linalg.norm(native[f"float32_{i}"])
        assert 0 < rel < 1e-2, f"{key}: {rel:.2e} from the uncompressed run"


def test_a_pipeline_stages_replicas_sum_through_the_same_reducer(trained):
    """The stage's gradients go through DATA's reducer over a group of the job, inside the
    stage's compiled step: on the path asked for, the step traced once per batch size, the
    same bits on both paths and ranks, and the weights of plain Keras."""
    keys = sorted(k for k in trained[("native", 0)] if re.fullmatch(r"stage_\d+", k))
    assert len(keys) == 6
    for (path, rank), got in trained.items():
        assert got["stage_native"].tolist() == [path == "native"]
        traces, signatures = got["stage_traces"].tolist()
        assert traces == signatures, f"the step traced {traces} times for {signatures} sizes"
        for key in keys:
            np.testing.assert_array_equal(got[key], trained[("native", 0)][key], err_msg=key)
            serial = got[key.replace("stage_", "serial_")]
            rel = np.linalg.norm(got[key] - serial) / np.linalg.norm(serial)
            assert rel <= 1e-5, f"{path} rank {rank}: {key} differs from plain Keras by {rel:.2e}"
    assert not np.allclose(trained[("native", 0)]["serial_0"], trained[("native", 0)]["initial_0"]), \
        "the model did not train"


def _killed_ranks_env(tmp: Path) -> dict[str, str]:
    """The ranks of a job that ends by a kill: their temporary files (TensorFlow's autograph
    writes one per converted function and removes it at exit, which a killed rank or one
    ending with ``os._exit`` never reaches) go to the test's folder, not /tmp."""
    return {**QUIET, "TMPDIR": str(tmp)}


def test_a_peer_killed_mid_training_ends_the_job_with_its_failure(tmp_path):
    result = launch_ranks([str(WORKERS / "native_worker.py"), str(tmp_path), "kill"], 2,
                          backend=NATIVE[0], timeout=300, tnt_timeout_s=60, env=_killed_ranks_env(tmp_path))
    assert not result.timed_out, result.describe()
    rank0, rank1 = result.ranks
    assert rank1.returncode == -9, result.describe()
    assert rank0.returncode == 75, result.describe()  # tnt_core.PEER_FAILURE_EXIT_CODE
    assert "CommError" in rank0.stderr, result.describe()
    assert not (tmp_path / "finished-rank0").exists()


def _hang(out: Path) -> subprocess.CompletedProcess:
    """``tnt run`` of 2 ranks whose rank 1 stops before step 3's gradients."""
    tnt = shutil.which("tnt", path=str(Path(sys.executable).parent))
    assert tnt, "the tnt command (tnt-cli) is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(_killed_ranks_env(out))
    # 20 s: room for the ranks' TensorFlow start-ups and first traces to differ
    return subprocess.run([tnt, "run", "-n", "2", "--backend", NATIVE[0], "--timeout", "20",
                           "-x", "TNT_STALL_WARN_S=2", "--", str(WORKERS / "native_worker.py"),
                           str(out), "hang"], env=env, cwd=out, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module", autouse=True)
def hang_job(request, tmp_path_factory) -> Iterator[tuple[Path, Future | None]]:
    """The hung-rank job, started with the module's first test when the session runs its
    test: most of its time is rank 0 waiting out the 20 s timeout, which the other tests'
    launches use."""
    out = tmp_path_factory.mktemp("hang")
    wanted = any(item.name == "test_a_rank_that_never_reaches_a_gradient_allreduce_is_named"
                 for item in request.session.items)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hang") as pool:
        yield out, pool.submit(_hang, out) if wanted else None


def test_a_rank_that_never_reaches_a_gradient_allreduce_is_named(hang_job):
    """Rank 1 stops before step 3's gradients; rank 0 waits in the op library's finish.
    The stall inspector sees that wait (the op library numbers its allreduces in the
    ledger and marks the wait, tnt_stall_ledger.h): it warns, and when the wait fails,
    tnt run's last line names rank 1, as on the Python path (tnt-cli's
    test_the_hung_rank_is_named)."""
    tmp_path, job = hang_job
    assert job is not None, "started with the module's first test"
    proc = job.result()
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-4000:]
    verdict = re.match(r"tnt run: rank 1 did not arrive at allreduce #(\d+) within 20s \(hung or "
                       r"too slow\?\); rank 0 on localhost failed waiting for it; last seen: rank 1 "
                       r"\(epoch 1, step 3, fit, outside any collective, after #(\d+); alive, ", last)
    assert verdict, proc.stderr[-4000:]
    # one numbering over both paths and both ranks: rank 1 stopped right before the
    # allreduce rank 0 waits in (step 3's first gradient bucket)
    waited_in, hung_after = int(verdict[1]), int(verdict[2])
    assert waited_in == hung_after + 1, last
    # the inspector saw the wait while it lasted, not only when it failed
    assert re.search(rf"\[tnt 0\] WARNING tnt.stall: stall: rank 0 has waited \d+s in allreduce "
                     rf"#{waited_in} .*; not arrived: rank 1 \(epoch 1, step 3, fit", proc.stderr), \
        proc.stderr[-4000:]
    # rank 0 failed in the op library's wait (the backend's native allreduce, or the finish)
    assert re.search(r"CommError: .*(native allreduce #\d+\]|allreduce of gradient bucket)",
                     proc.stderr), proc.stderr[-4000:]
    assert not (tmp_path / "finished-rank0").exists()


def test_ranks_with_different_bucket_plans_both_raise_the_mismatch(tmp_path):
    """Different fusion thresholds per rank: the plans differ, the agreement before the
    first allreduce says so on every rank, as the Python path's does."""
    run_workers("native_worker.py", [str(tmp_path), "mismatch"], 2, NATIVE[0], timeout=300)
    for rank in (0, 1):
        text = (tmp_path / f"mismatch-rank{rank}.txt").read_text()
        assert text.startswith("CollectiveMismatchError: "), text
        assert "fused allreduce plan" in text, text


def test_point_to_point_ops_move_the_bits_and_a_dead_peer_fails_the_receive(tmp_path):
    """One 2-rank job: tensors of 8 dtypes (random bits, NaN payloads included) and shapes
    (a scalar, an empty one, 600 KB) both ways inside one tf.function, called twice; then a
    receive from a rank that SIGKILLs itself raises CommError, long before TNT_TIMEOUT_S."""
    timeout_s = 60
    result = launch_ranks([str(WORKERS / "native_worker.py"), str(tmp_path), "p2p"], 2,
                          backend=NATIVE[0], timeout=300, tnt_timeout_s=timeout_s,
                          env=_killed_ranks_env(tmp_path))
    assert not result.timed_out, result.describe()
    rank0, rank1 = result.ranks
    assert rank1.returncode == -9, result.describe()
    assert rank0.returncode == 0, result.describe()
    got = {r: dict(np.load(tmp_path / f"p2p-rank{r}.npz")) for r in (0, 1)}
    for r in (0, 1):
        assert got[r]["traces"].tolist() == 1
        sent_keys = sorted(k for k in got[r] if k.startswith("sent_"))
        assert len(sent_keys) == 2 * 10
        for key in sent_keys:
            received = got[1 - r][key.replace("sent_", "got_")]
            np.testing.assert_array_equal(received, got[r][key], err_msg=f"rank {r}'s {key}")
            assert got[r][key].size or "_4" in key  # only the empty int64 case has no bytes
    dtypes = {str(got[0][f"dtype_0_{i}"]) for i in range(10)}
    assert dtypes == {"float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool"}
    dead = json.loads((tmp_path / "p2p-dead-peer.json").read_text())
    assert dead["type"] == "CommError", dead
    assert "native recv from 1 tag 999" in dead["message"], dead
    assert dead["seconds"] < timeout_s / 2, dead
