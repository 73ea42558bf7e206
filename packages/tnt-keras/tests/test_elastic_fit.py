"""An elastic job's ``fit`` goes on over the survivors when ranks die, and its result is
still plain Keras' running the same script (``workers/elastic_fit_worker.py``).

One launch, ``tnt run -n 4 --min-np 1``, three failures where a rank may die: rank 3 is
SIGKILLed as a validation step begins in the first epoch (4 -> 3 ranks: the survivors connect
anew in mid-validation); rank 2 in its input pipeline (a ``PyDataset.__getitem__``) as the
second epoch begins, while the master writes the first epoch's ``ModelCheckpoint`` (3 -> 2);
the master itself in the middle of writing the second epoch's checkpoint (2 -> 1: rank 1
trains on alone, as the master without the old master's ModelCheckpoint); then
``evaluate``, ``predict`` and ``predict_on_batch`` on the survivor. The checkpoints written
are whole (the values of plain Keras' files), the one the master died in is not at the
user's path at all, and each death was known to the survivor within seconds.
Float64, so a difference beyond round-off is a wrong step, not noise.

A second launch, ``tnt run -n 2 --min-np 2 --max-restarts 3 --max-np 3`` with a host
discovery script, takes ranks in: rank 1 is SIGKILLed as a train step begins in the first
epoch and a replacement (member 2) joins at that step (the survivor waits for it: --min-np
2); the kill also makes the discovery script offer a third slot, whose new rank (member 3)
joins at a step's boundary once the replacement holds the state. Each joiner runs the
script from the top: its fit joins the running one, its evaluate and predict are the job's.
Deaths in the state transfer: member 2 as it gives member 3 the state
(``ELASTIC_DIE_GIVING_STATE``): member 3 binds the next membership and takes the state
from the master; member 2's replacement (member 4) as it takes the state
(``ELASTIC_DIE_TAKING_STATE``): the others go on and its replacement joins. Every rank's
result is plain Keras'.

A third launch, ``tnt run -n 4 --max-restarts 2`` of a pipelined model under ALL (2 stages
x 2 pipelines), restarts every rank when one dies: the fit resumes at the step that failed
from the survivors' copies, and, when both replicas of a stage died, from its
BackupAndRestore backup at the step.

A rank one operation ahead of another (its last collective completed, the other's failed)
is placed there by ``workers/elastic_agree_worker.py`` in the suite's 2-rank launch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tnt_keras_helpers import BACKENDS, PYTHON_PATH, QUIET, WORKERS, launch_params, run_serial

NO_GLOO = pytest.mark.skipif("gloo" not in BACKENDS,
                             reason=f"elastic jobs need the gloo backend (launchable: {BACKENDS})")

TNT = Path(sys.executable).with_name("tnt")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> dict[str, Any]:
    """Plain Keras running the worker script: the result every elastic run must give, and
    the directory of its checkpoints."""
    out = tmp_path_factory.mktemp("serial")
    run_serial("elastic_fit_worker.py", ["serial", str(out)])
    return {"result": dict(np.load(out / "result-serial.npz")), "dir": out}


def _assert_serial(result: dict[str, np.ndarray], serial: dict[str, np.ndarray],
                   rtol: float = 1e-9, atol: float = 1e-12, keys: set[str] | None = None) -> None:
    assert sorted(serial) == sorted(result)
    assert (keys or {"h_loss", "h_accuracy", "h_auc", "h_val_loss", "h_val_auc", "e_loss",
                     "predicted", "on_batch"}) <= set(serial)
    for key in sorted(serial):
        np.testing.assert_allclose(result[key], serial[key], rtol=rtol, atol=atol, err_msg=key)


def _weights_file(path: Path) -> dict[str, np.ndarray]:
    import h5py

    found: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return found


def _assert_same_file(path: Path, serial_path: Path) -> None:
    """``path`` is a whole weights file, with the values of plain Keras' ``serial_path``."""
    mine, theirs = _weights_file(path), _weights_file(serial_path)
    assert sorted(mine) == sorted(theirs), (path, sorted(mine))
    for key in theirs:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=1e-9, atol=1e-12,
                                   err_msg=f"{path.name}: {key}")


@NO_GLOO
def test_ranks_die_anywhere_and_fit_still_gives_plain_keras_results(tmp_path, serial):
    before = _shm()
    env = {**os.environ, **QUIET, "TNT_TIMEOUT_S": "30"}
    proc = subprocess.run(
        [str(TNT), "run", "-n", "4", "--min-np", "1", "--backend", "gloo", "--",
         str(WORKERS / "elastic_fit_worker.py"), "tnt", str(tmp_path),
         "3:test:0:1,2:input:1:0,0:write:1:0"],
        env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    for says in ("going on with 3 rank(s), generation 1", "going on with 2 rank(s), generation 2",
                 "going on with 1 rank(s), generation 3",
                 "training goes on with 3 rank(s) after", "the test step in flight redone",
                 "training goes on with 2 rank(s) after", "the train step in flight redone",
                 "rank 0 left (exited with code 137", "the master rank left"):
        assert says in output, output[-4000:]
    assert "evicted" not in output, output[-4000:]  # each death was seen, none waited out
    _assert_serial(dict(np.load(tmp_path / "result-tnt.npz")), serial["result"])

    # the checkpoint written while rank 2 died is whole; the one the master died in is absent
    # (its partial file stays under a hidden temporary name); BackupAndRestore's last backup,
    # of the first epoch, is whole too
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
        ["w-01.weights.h5"], sorted(p.name for p in ckpt.iterdir())
    _assert_same_file(ckpt / "w-01.weights.h5", serial["dir"] / "ckpt" / "w-01.weights.h5")
    _assert_same_file(tmp_path / "backup" / "latest.weights.h5",
                      serial["dir"] / "ckpt" / "w-01.weights.h5")
    assert json.loads((tmp_path / "backup" / "training_metadata.json").read_text())["epoch"] == 1

    # each death known to the survivor (its watcher; its loop's collective failing) in seconds
    record = json.loads((tmp_path / "recoveries.json").read_text())
    assert record["size"] == 1 and len(record["recoveries"]) == 3, record
    notices = {generation: seen for seen, generation in record["notices"]}
    for generation, member in ((1, 3), (2, 2), (3, 0)):
        killed = float((tmp_path / f"killed-{member}").read_text())
        known = min(notices[generation], record["failures"][generation - 1]) - killed
        assert 0 <= known < 5.0, (generation, member, known, record)  # ~0.3s measured
    assert _shm() <= before, sorted(_shm() - before)


@NO_GLOO
def test_a_replacement_and_a_new_rank_join_and_fit_still_gives_plain_keras_results(tmp_path, serial):
    before = _shm()
    hosts = tmp_path / "hosts.sh"  # a third slot once the kill wrote OUT/grow
    hosts.write_text(f"#!/bin/sh\nif [ -e {tmp_path}/grow ]; then echo localhost:3; "
                     "else echo localhost:2; fi\n")
    hosts.chmod(0o755)
    env = {**os.environ, **QUIET, "TNT_TIMEOUT_S": "90", "ELASTIC_JOIN_AFTER": "3:2",
           "ELASTIC_DIE_GIVING_STATE": "2", "ELASTIC_DIE_TAKING_STATE": "4"}
    proc = subprocess.run(
        [str(TNT), "run", "-n", "2", "--min-np", "2", "--max-restarts", "3", "--max-np", "3",
         "--host-discovery-script", str(hosts), "--backend", "gloo", "--",
         str(WORKERS / "elastic_fit_worker.py"), "tnt", str(tmp_path), "1:train:0:3", "3:1:2"],
        env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    (tmp_path / "output.txt").write_text(output)
    assert proc.returncode == 0, output[-6000:]
    for says in ("rank 1 left (exited with code 137 (signal SIGKILL?)); rank 1 joined; training "
                 "goes on with 2 rank(s) after",  # the replacement, at the step that failed
                 "rank 3 on localhost joined; going on with 3 rank(s)",  # the new slot's rank
                 "rank 2 on localhost exited with code 137", "rank 4 on localhost exited with code 137",
                 "rank 5 on localhost joined; going on with 3 rank(s)"):
        assert says in output, output[-4000:]
    # the giver died: the joiner bound the next membership and took the state from the master
    assert re.search(r"rank 2 joined; then generation \d+: 2 ranks; rank 1 left \(exited with code "
                     r"137 \(signal SIGKILL\?\)\); training goes on with 2 rank\(s\) after [\d.]+s, "
                     r"the joining rank\(s\) took the state", output), output[-4000:]
    assert "exited with code 75" not in output and "evicted" not in output, output[-4000:]
    # Keras' step functions, made anew at each rebind on purpose, are no retracing to warn of
    assert "triggered tf.function retracing" not in output, output[-4000:]
    record = json.loads((tmp_path / "recoveries.json").read_text())
    assert record["size"] == 3, record
    for member in (2, 4):  # each death in a state transfer known to the master in seconds
        killed = float((tmp_path / f"killed-{member}").read_text())
        assert any(0 <= seen - killed < 5.0 for seen, _ in record["notices"]), (member, killed, record)
    for member in (0, 3, 5):  # the survivor, the joiner whose giver died, the last replacement
        _assert_serial(dict(np.load(tmp_path / f"result-member{member}.npz")), serial["result"],
                       rtol=1e-12, atol=1e-15)
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


@NO_GLOO
def test_a_pipelined_job_restarts_every_rank_and_resumes_at_the_step_as_plain_keras(tmp_path,
                                                                                   serial_suite):
    """``tnt run -n 4 --max-restarts 2`` of a fit pipelined under ALL
    (``workers/pipeline_resume_worker.py``): rank 3 is SIGKILLed as batch 5 of the second
    epoch begins, and every rank restarts at batch 5, from the survivors' copies (the
    user's BackupAndRestore(save_freq=2) is at batch 4); then both replicas of stage 1 as
    batch 4 of the third epoch begins, and every rank restarts at batch 3, the backup's step
    (no survivor holds stage 1). Final weights and History are plain Keras' (round-off of
    the micro-batches; the plain Keras run is part of the suite's plain process)."""
    before = _shm()
    env = {**os.environ, **QUIET, "TNT_TIMEOUT_S": "30"}
    proc = subprocess.run(
        [str(TNT), "run", "-n", "4", "--max-restarts", "2", "--backend", "gloo", "--",
         str(WORKERS / "pipeline_resume_worker.py"), "tnt", str(tmp_path / "tnt")],
        env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    reason = ("a pipelined tnt.Model cannot go on with fewer ranks (the survivors back up the "
              "step in flight): restarting every rank")
    for restart, ranks in ((1, "3"), (2, "[13]")):  # the second: whichever died first
        assert re.search(rf"tnt run: rank {ranks} on localhost exited with code 137 \(signal "
                         rf"SIGKILL\?\); {re.escape(reason)} \(restart {restart} of 2\)",
                         output), output[-4000:]
    first = [json.loads((tmp_path / "tnt" / f"first-batch-{run}.json").read_text())
             for run in (0, 1, 2)]
    assert first == [[0, 0], [1, 5], [2, 3]]  # where each run's callbacks begin
    _assert_serial(dict(np.load(tmp_path / "tnt" / "result-tnt.npz")),
                   dict(np.load(serial_suite / "pipeline_resume" / "result-serial.npz")),
                   rtol=1e-12, atol=1e-15, keys={"h_loss", "h_mae", "h_val_loss", "w0"})
    assert not (tmp_path / "tnt" / "backup").exists()  # deleted at the end, as Keras does
    assert _shm() <= before, sorted(_shm() - before)


def test_a_pipelined_model_refuses_a_job_that_may_change_its_size():
    from types import SimpleNamespace

    from tarantella.pipeline.model import _restart_all_on_failure

    told: list[str] = []
    runtime = SimpleNamespace(membership=object(), config=SimpleNamespace(elastic_resizes=True),
                              restart_all_on_failure=told.append)
    with pytest.raises(Exception, match=r"^a pipelined tnt.Model cannot go on with another number "
                       r"of ranks \(tnt run --min-np below -n, --max-np, --host-discovery-script\)"):
        _restart_all_on_failure(runtime)
    runtime.config.elastic_resizes = False  # --max-restarts alone: tnt run restarts every rank
    _restart_all_on_failure(runtime)
    assert told and "a stage is held by its ranks alone" in told[0]
