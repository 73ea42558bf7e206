"""Horovod's elastic API (``hvd.elastic``): a custom loop under ``hvd.elastic.run`` goes on
over the survivors when a rank dies, rolled back to its last commit, and still gives serial
training's result (``workers/horovod_elastic_worker.py``); the states and callbacks, and the
order of a reset, without launching ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import keras
import numpy as np
import pytest

import tarantella.horovod as hvd
import tarantella.horovod.keras as hvd_keras
import tnt_core
from tarantella.errors import NotSupportedError
from tarantella.horovod import elastic
from tnt_keras_helpers import BACKENDS, QUIET, WORKERS

TNT = Path(sys.executable).with_name("tnt")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.skipif("gloo" not in BACKENDS, reason="elastic jobs need the gloo backend")
def test_a_rank_dies_and_the_loop_rolls_back_to_its_commit_and_gives_serial_results(tmp_path):
    """3 ranks, the third SIGKILLed as batch 5 begins; commits after batches 1, 3, 5, 7: the
    survivors undo batch 4 (done, not committed), redo 4 and 5 over 2 ranks, and end where
    serial training of the same global batches does (float64); nothing is left in /dev/shm."""
    before = _shm()
    proc = subprocess.run(
        [str(TNT), "run", "-n", "3", "--min-np", "1", "--backend", "gloo", "--",
         str(WORKERS / "horovod_elastic_worker.py"), str(tmp_path), "2:5"],
        env={**os.environ, **QUIET, "TNT_TIMEOUT_S": "30"}, capture_output=True, text=True,
        timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "hvd.elastic.run goes on with 2 rank(s) after" in output, output[-4000:]
    r = dict(np.load(tmp_path / "result.npz"))
    assert r["calls"].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7]  # batch 4 undone and redone
    assert r["reset_sizes"].tolist() == [2] and int(r["size"]) == 2  # hvd.size() after the reset
    assert int(r["traces"]) == 1  # the step traced at 3 ranks ran at 2
    assert int(r["iterations"]) == int(r["serial_iterations"]) == 8  # Adam's counter rolled back
    np.testing.assert_allclose(r["losses"], r["serial_losses"], rtol=1e-12)  # hvd.allreduce's average
    for i in range(4):
        np.testing.assert_allclose(r[f"w{i}"], r[f"serial_w{i}"], rtol=1e-12, atol=1e-14, err_msg=f"w{i}")
    assert _shm() <= before, sorted(_shm() - before)


def _model_and_adam():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.1)
    return model, optimizer


def _step(model, optimizer) -> None:
    grads = [np.full(v.shape, 0.5) for v in model.trainable_variables]
    optimizer.apply(grads, model.trainable_variables)


def _values(variables) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def test_restore_gives_back_the_commit_of_the_weights_the_optimizer_and_the_values():
    model, optimizer = _model_and_adam()
    optimizer.build(model.trainable_variables)
    state = hvd_keras.elastic.KerasState(model, optimizer, batch=0, epoch=0)
    _step(model, optimizer)
    state.batch = 3
    state.commit()
    committed = _values(model.variables) + _values(optimizer.variables)
    _step(model, optimizer)
    state.batch, state.epoch = 7, 1
    state.restore()
    for now, then in zip(_values(model.variables) + _values(optimizer.variables), committed):
        np.testing.assert_array_equal(now, then)
    assert (state.batch, state.epoch) == (3, 0)
    state.sync()  # one rank: rank 0's state is its own
    assert (state.batch, state.epoch) == (3, 0)


def test_restore_refuses_variables_made_after_the_commit():
    model, optimizer = _model_and_adam()  # the optimizer is built by its first step
    state = hvd.elastic.TensorFlowKerasState(model, optimizer)
    _step(model, optimizer)
    with pytest.raises(NotSupportedError, match=r"made after the last commit.*run one step before"):
        state.restore()


def test_the_keras_callbacks_keep_batch_and_epoch_and_commit_at_the_epoch_end():
    model, optimizer = _model_and_adam()
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((12, 3)), np.zeros((12, 2))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # builds the optimizer
    state = hvd_keras.elastic.KerasState(model, batch=0, epoch=1)
    callbacks = [hvd_keras.elastic.UpdateEpochStateCallback(state),
                 hvd_keras.elastic.UpdateBatchStateCallback(state),
                 hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=2)]
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=callbacks)
    fitted = _values(model.variables)
    assert (state.epoch, state.batch) == (3, 0)  # on top of the epoch it began with
    _step(model, optimizer)
    state.restore()  # to the commit at the last epoch's end
    for now, then in zip(_values(model.variables), fitted):
        np.testing.assert_array_equal(now, then)


class _Recorded(elastic.ObjectState):
    def __init__(self, said: list[str]) -> None:
        super().__init__(bcast_object=lambda obj: obj, batch=0)
        self.said = said

    def restore(self) -> None:
        self.said.append(f"restore to {self._saved_state['batch']}")
        super().restore()

    def sync(self) -> None:
        self.said.append("sync")
        super().sync()


@pytest.mark.parametrize("failure, fail_at, rolled_back", [
    (tnt_core.CommError("peer 2 closed the connection"), 3, True),  # in batch 3's collective
    (elastic.HostsUpdatedInterrupt(skip_sync=True), 2, False),  # as the commit after batch 2 finds it
    (None, None, True),  # returned here, while another rank failed in its last steps
], ids=["collective-failed", "hosts-updated", "another-rank-failed-last"])
def test_a_reset_rolls_back_rebinds_calls_back_syncs_and_calls_again(monkeypatch, failure, fail_at,
                                                                     rolled_back):
    """The order of a reset, with tnt-core's runtime and the rebind stood in for."""
    said: list[str] = []
    runtime = SimpleNamespace(membership=object(), membership_changed=lambda: False,
                              config=SimpleNamespace(elastic_joins=False))
    monkeypatch.setattr(elastic.tnt_core, "init", lambda: runtime)
    monkeypatch.setattr(elastic, "_rejoin", lambda *_: said.append("rejoin"))

    def all_finished(_runtime, label, completed=True):
        assert label.startswith("hvd.elastic.run/")
        if not completed:
            said.append("said it failed")
            return False
        said.append("all finished")  # the ranks' outcome: not at the first return, if so
        return failure is not None or said.count("all finished") > 1

    monkeypatch.setattr(elastic, "_all_finished", all_finished)
    state = _Recorded(said)
    state.register_reset_callbacks([lambda: said.append("reset callback")])

    @hvd.elastic.run
    def train(state, fail_at):
        said.append(f"train from {state.batch}")
        while state.batch < 4:
            state.batch += 1
            if state.batch % 2 == 0:
                state.commit()
            if state.batch == fail_at and said.count("rejoin") == 0:
                raise failure
        return state.batch

    assert train(state, fail_at) == 4
    if failure is None:  # the function returned and is redone from the last commit
        assert said == ["sync", "train from 0", "all finished", "restore to 4", "rejoin",
                        "reset callback", "sync", "train from 4", "all finished"]
        return
    back = ["restore to 2"] if rolled_back else []
    assert said == ["sync", "train from 0", "said it failed", *back, "rejoin", "reset callback",
                    "sync", "train from 2", "all finished"]


def test_outside_an_elastic_job_run_calls_once_and_failures_go_through():
    state = elastic.ObjectState(batch=5)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.batch)
        if len(calls) == 2:
            raise tnt_core.CommError("lost a peer")
        return state.batch * 2

    assert train(state) == 10
    with pytest.raises(tnt_core.CommError, match="lost a peer"):
        train(state)
    assert calls == [5, 5]


def test_keras_2s_opt_lr_is_the_learning_rate():
    """Horovod's elastic examples scale the learning rate in their reset callbacks through
    Keras 2's ``opt.lr``."""
    import tensorflow as tf

    optimizer = keras.optimizers.Adam(0.1)
    optimizer.lr.assign(0.5)
    assert float(keras.ops.convert_to_numpy(optimizer.learning_rate)) == 0.5
    tf.keras.backend.set_value(optimizer.lr, 0.75)  # Keras 2's: it takes TensorFlow's variable
    assert float(keras.ops.convert_to_numpy(optimizer.learning_rate)) == 0.75
    optimizer.lr = 0.25
    assert float(keras.ops.convert_to_numpy(optimizer.lr)) == 0.25


def test_a_loop_with_tnts_optimizer_is_refused_in_an_elastic_job(monkeypatch):
    """Its traced reduction keeps the communicator it was traced for (only Horovod's, under
    hvd.elastic.run, reach the next one), so it is refused before it reduces anything."""
    import tarantella as tnt

    model, _ = _model_and_adam()
    optimizer = tnt.DistributedOptimizer(keras.optimizers.SGD(0.1))
    monkeypatch.setattr(tnt_core, "init", lambda: SimpleNamespace(membership=object()))
    with pytest.raises(NotSupportedError, match=r"tnt.DistributedOptimizer\) cannot go on when ranks "
                                                r"leave.*hvd.DistributedGradientTape under hvd.elastic.run"):
        _step(model, optimizer)
