"""Callbacks, save/load, weight broadcast and clear errors (``workers/features_worker.py``).

* checkpoint, CSV, backup and TensorBoard files appear once (the master's directory), and
  with ``TNT_TENSORBOARD_ON_ALL_DEVICES=true`` once per rank in ``rank_<r>`` sub-directories;
* EarlyStopping stops at the same epoch as serial training, ReduceLROnPlateau reaches the
  same learning rate, and a user callback sees the serial logs on every rank;
* a master-only callback that stops training stops every rank;
* the progress bar prints on the master only;
* save/load round trips return ``tnt.Model`` objects, compiled when saved so;
* weights set on the master alone are used by every rank before the next step;
* unsupported uses raise errors that say what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(1500)  # the first test of a launch waits for it
RTOL = 1e-5  # float64 workers: observed differences are float64 round-off


@pytest.fixture(scope="session")
def serial_features(serial_suite) -> dict:
    return json.loads((serial_suite / "features" / "serial.json").read_text())


@pytest.fixture(scope="session")
def features(rank_suite):
    out, nprocs, launch, planned = rank_suite
    planned.skip_unless_it_runs("features")
    ranks = [json.loads(Path(out, "features", f"rank{r}.json").read_text()) for r in range(nprocs)]
    return ranks, nprocs, launch


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(b), 1e-12)


def test_files_are_written_once(features):
    """(TensorBoard's files are checked when the tensorboard package is installed; its
    placement is checked without it in test_units.)"""
    ranks, nprocs, _ = features
    tensorboard = ranks[0]["tensorboard_installed"]
    master = set(ranks[0]["files"])
    expected = ["ckpt/epoch1.keras", "ckpt/epoch2.keras", "ckpt/w1.weights.h5", "ckpt/w2.weights.h5",
                "log.csv", "marker_master", "marker_all", "backup"]
    expected += ["tb_master", "tb_all/rank_0"] if tensorboard else []
    for name in expected:
        assert any(f == name or f.startswith(name + "/") for f in master), (name, sorted(master))
    for rank in range(1, nprocs):
        files = set(ranks[rank]["files"])
        # only what runs everywhere: the all-ranks marker and this rank's TensorBoard folder
        assert "marker_all" in files
        others = {f for f in files if f != "marker_all" and not f.startswith(f"tb_all/rank_{rank}/")}
        assert not others, f"rank {rank} wrote {sorted(others)}"
        if tensorboard:
            assert any(f.startswith(f"tb_all/rank_{rank}/") for f in files)


def test_decisions_equal_serial(features, serial_features):
    ranks, _, _ = features
    serial = serial_features["early_stopping"]
    assert serial["epochs_run"] < 30, "the reference run must stop early for the test to mean something"
    for rank, result in enumerate(ranks):
        mine = result["early_stopping"]
        assert mine["epochs_run"] == serial["epochs_run"], f"rank {rank} stopped after {mine['epochs_run']}"
        assert mine["stopped_epoch"] == serial["stopped_epoch"]
        assert _close(mine["lr"], serial["lr"]), (mine["lr"], serial["lr"])
        for kind in ("epoch_logs", "batch_logs"):
            assert len(mine[kind]) == len(serial[kind])
            for got, want in zip(mine[kind], serial[kind]):
                assert got.keys() == want.keys()
                for key in want:
                    assert _close(got[key], want[key]), f"rank {rank} {kind} {key}: {got[key]} vs {want[key]}"


def test_master_only_callback_stops_every_rank(features):
    ranks, _, _ = features
    assert [r["master_stop_epochs"] for r in ranks] == [2] * len(ranks)


def test_progress_bar_only_on_master(features):
    _, nprocs, launch = features
    assert "Epoch 1/2" in launch.ranks[0].stdout and "step" in launch.ranks[0].stdout
    for rank in range(1, nprocs):
        out = launch.ranks[rank].stdout
        assert "Epoch" not in out and "step" not in out, out[-2000:]


def test_save_and_load(features):
    ranks, _, _ = features
    for rank, result in enumerate(ranks):
        loaded = result["load_model"]
        assert loaded["type"].endswith("/tnt") and loaded["compiled"] and loaded["optimizer"] == "SGD"
        assert loaded["weights_equal"] and loaded["uncompiled"]
        assert loaded["own_file"] == (rank == 0), "only the master writes"
        assert result["save_model_function"] and result["load_weights_equal"]
        assert result["save_all_devices"], "tnt_save_all_devices=True writes on every rank"
        assert all(result["architecture"].values()), result["architecture"]
    evals = [r["load_model"]["evaluate"] for r in ranks]
    assert all(e == evals[0] for e in evals)


def test_master_weights_reach_every_rank(features):
    ranks, _, _ = features
    sums = [r["broadcast_after_set_weights"] for r in ranks]
    assert all(np.allclose(s, sums[0], rtol=0, atol=0) for s in sums)
    assert sums[0][0] == pytest.approx(0.01 * 5 * 6), "the master's weights, not a fresh init"


def test_unsupported_uses_say_what_to_do(features):
    ranks, _, _ = features
    errors = ranks[0]["errors"]
    assert "batch it" in errors["unbatched"]
    assert all(r["batch_smaller_than_ranks_trains"] for r in ranks)


def test_batch_norm_warning_on_small_micro_batches(features):
    ranks, nprocs, _ = features
    warned = [r["batch_norm_warning"] for r in ranks]
    assert warned == [nprocs > 1] + [False] * (nprocs - 1), "warned once, on the master, with > 1 rank"
    if nprocs > 1:  # at the user's fit (it named tarantella/tracebacks.py)
        assert ranks[0]["batch_norm_warning_at"] == [["features_worker.py", True]]


def test_rank_local_logs_with_aggregate_logs_false(features):
    """Each rank's own loss/accuracy; weighted by the samples each rank saw they give the
    job's (serial) values. 40 training samples in batches of 9, 15 validation in 6."""
    import tnt_core

    ranks, nprocs, _ = features

    def samples(total: int, batch: int) -> list[int]:
        counts = [0] * nprocs
        for start in range(0, total, batch):
            for r, n in enumerate(tnt_core.micro_batch_sizes(min(batch, total - start), nprocs,
                                                             allow_empty=True)):
                counts[r] += n
        return counts

    weights = {"": samples(40, 9), "val_": samples(15, 6)}
    for epoch in range(2):
        shared = ranks[0]["local_logs"]["global"][epoch]
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            w = weights["val_" if key.startswith("val_") else ""]
            local = [r["local_logs"]["local"][epoch][key] for r in ranks]
            combined = sum(v * n for v, n in zip(local, w)) / sum(w)
            assert _close(combined, shared[key]), (key, local, shared[key])
            if nprocs > 1 and key == "loss":
                assert len(set(local)) > 1, "ranks saw different samples: their own losses differ"
        assert ranks[0]["local_logs"]["local"][epoch].keys() == shared.keys()


def test_cpu_ranks_share_the_cores(features):
    ranks, nprocs, _ = features
    for result in ranks:
        threads = result["threads"]
        if threads["user_set"]:
            pytest.skip("TF_NUM_INTRAOP_THREADS/TNT_NUM_THREADS set in the environment")
        # one rank per node keeps TensorFlow's default (0: all cores)
        expected = max(1, threads["cores"] // nprocs) if nprocs > 1 else 0
        assert threads["intra_op"] == expected, threads
