"""``keras.callbacks.BackupAndRestore`` resumed at the step, with serial training's result.

Keras 3's callback saves at a batch (``save_freq=N``) but restores only the epoch: the
partial epoch is redone, the dataset starts that epoch with the first epoch's shuffle, and
the History of the restarted ``fit`` lacks the epochs before. A job whose every rank is
restarted (a pipelined model under ``tnt run --max-restarts``: a stage cannot be rebuilt from
the other ranks) would then not give serial training's result. Here the user's unchanged
callback resumes at the step instead:

* **What a backup holds.** Written at the hook where the save falls due, once every other
  callback finished the step before (the next step's ``on_train_batch_begin``, or the next
  epoch's ``on_epoch_begin``): the weights and optimizer state (the model's own
  ``save_weights``: for a pipelined model the master writes, streamed from the stages),
  the metric states of the epoch in progress, the callbacks' state (History too, as a
  joining rank takes it: :mod:`tarantella.data_parallel.joining`), the position (epoch,
  steps done) and each rank's random seed states.
* **Never half-written.** The master gathers every rank's part and writes the backup into
  ``<backup_dir>/tnt-state-N.tmp``, then renames it ``tnt-state-N`` and removes the older
  one. A job killed while it writes leaves a temporary directory that is never read.
* **Where a resumed fit starts.** ``fit`` runs Keras' own loop from its start, the steps
  before the backup's position *replayed*, as a joining rank replays them: each takes its
  batch from the input (the dataset's position and its per-epoch shuffles stay the serial
  run's) and runs nothing, validation too, and the user's callbacks do not run. At the
  hook the backup was written in, every rank loads it (``backup_dir`` on a file system
  every rank sees, as for Keras' own restore on every rank) and training goes on. The master
  decides whether and where a fit resumes, so the ranks agree.
* **The step in flight.** A pipelined job under ALL in an elastic job keeps host copies of
  each stage as the last two steps began; when a rank dies, the survivors write them, and
  the restarted fit resumes at the step that failed when that position is newer than the
  backup (:mod:`tarantella.pipeline.rescue`).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from typing import Any

import keras
import numpy as np

from . import _keras_compat
from . import callbacks as tnt_callbacks
from .data_parallel import joining
from .errors import NotSupportedError
from .pipeline import rescue as step_rescue
from .randomness import is_seed_state

__all__ = ["QuietProgbar", "SkippedWhileReplaying", "StepBackupAndRestore"]

_STATE = re.compile(r"^tnt-state-(\d+)$")
_WEIGHTS = "latest.weights.h5"
_JOB = "job.pkl"


def _rank_file(rank: int) -> str:
    return f"rank-{rank}.pkl"


def _replaying(model: Any) -> bool:
    return bool(getattr(getattr(model, "_tnt", None), "replaying", False))


class StepBackupAndRestore(tnt_callbacks.Callback):
    """The user's ``keras.callbacks.BackupAndRestore``, resumed at the step (see the module
    doc); runs on every rank (its saves and loads are collectives)."""

    keras_callback: keras.callbacks.BackupAndRestore

    def __init__(self, keras_callback: keras.callbacks.BackupAndRestore) -> None:
        super().__init__(keras_callback)
        #: the position: the epoch running and the steps of it done
        self.epoch, self.step = 0, 0
        #: steps since the last backup (Keras counts them across epochs alike)
        self.since_save = 0
        #: a backup falls due at the next hook
        self.due = False
        #: backups written so far in the fit (they name the directories)
        self.saves = 0
        #: a resumed fit: the backup and the position it was written at
        self.resume_from: str | None = None
        self.resume_at: tuple[int, int] | None = None
        #: the resumed backup is the survivors' copies of the step in flight
        self.resume_rescue = False
        #: this rank's copies of its stage as the last two steps began, when the model's
        #: survivors write them on a rank's death (tarantella.pipeline.rescue); None otherwise
        self.copies: step_rescue.StepCopies | None = None
        #: the loop's callbacks (their state is backed up; a list or Keras' CallbackList),
        #: set by the model's fit
        self.callbacks: Any = []

    # -- where the loop is ----------------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        """The master looks for the newest backup and tells every rank (they resume alike)."""
        self.epoch, self.step, self.since_save, self.due, self.saves = 0, 0, 0, False, 0
        backup_dir = str(self.keras_callback.backup_dir)
        state = self.model._tnt  # noqa: SLF001 (tarantella's own state of the model)
        rescue = getattr(state, "rescue_copies", None)
        self.copies = rescue(self.model) if rescue is not None else None
        found: dict[str, Any] = {}
        if state.runtime.is_master:
            newest = _newest(backup_dir)
            if newest is not None:
                with open(os.path.join(newest, _JOB), "rb") as f:
                    found = {"path": newest, "position": tuple(pickle.load(f)["position"])}
            stages = getattr(getattr(state, "parts", None), "num_partitions", 0)
            rescued = step_rescue.complete_positions(backup_dir, stages) if stages else []
            if rescued and (not found or rescued[0][0] > found["position"]):
                found = {"path": rescued[0][1], "position": rescued[0][0], "rescue": True}
                for name in os.listdir(backup_dir):  # what a rank killed while writing left
                    if name.startswith("tnt-state-") and name.endswith(".tmp"):
                        shutil.rmtree(os.path.join(backup_dir, name), ignore_errors=True)
            elif os.path.exists(os.path.join(backup_dir, _WEIGHTS)):
                found = {"keras": True}  # Keras' own backup (an epoch's): Keras restores it
        if state.runtime.size > 1:
            found = pickle.loads(state.channel.broadcast_bytes(pickle.dumps(found), 0))
        if found.get("keras"):
            self.keras_callback.on_train_begin(logs)
        elif found:
            self.resume_from, self.resume_at = found["path"], found["position"]
            self.resume_rescue = bool(found.get("rescue"))
            state.replaying = True

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch, self.step = epoch, 0
        self._arrive()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.step = batch
        self._arrive()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if _replaying(self.model):
            return
        self.since_save += 1
        freq = self.keras_callback.save_freq
        if freq != "epoch" and freq and self.since_save >= int(freq):
            self.since_save = 0
            self.due = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not _replaying(self.model) and self.keras_callback.save_freq == "epoch":
            self.due = True

    def on_train_end(self, logs: dict | None = None) -> None:
        if _replaying(self.model) and self.resume_at == (self.epoch + 1, 0):
            self._load()  # a backup of the whole training (delete_checkpoint=False)
        elif self.due and not self.keras_callback.delete_checkpoint:
            self.epoch, self.step, self.due = self.epoch + 1, 0, False
            self._save()  # kept: the training's end, as Keras' last backup holds it
        if _replaying(self.model):
            epoch, step = self.resume_at or (0, 0)
            raise NotSupportedError(
                f"BackupAndRestore({self.keras_callback.backup_dir!r}): its backup is at step "
                f"{step} of epoch {epoch}, which this fit never reached: call fit with the "
                "arguments of the run that wrote it, or remove the backup")
        if self.keras_callback.delete_checkpoint and self.model._tnt.runtime.is_master:  # noqa: SLF001
            shutil.rmtree(str(self.keras_callback.backup_dir), ignore_errors=True)

    def _arrive(self) -> None:
        """At a hook a backup may be written in: the resumed fit's backup loads here, or a
        backup that fell due is written."""
        if _replaying(self.model):
            if (self.epoch, self.step) == self.resume_at:
                self._load()
            return
        if self.copies is not None:
            self.copies.take((self.epoch, self.step), self.saves, self.model.metrics_variables,
                             self.callbacks)
        if self.due:
            self.due = False
            self._save()

    # -- the backup ---------------------------------------------------------------------------

    def _save(self) -> None:
        """Every rank's seed states to the master, which writes the backup alone (the
        weights streamed from the stages of a pipeline) and renames it into place."""
        model = self.model
        state = model._tnt  # noqa: SLF001
        runtime = state.runtime
        backup_dir = str(self.keras_callback.backup_dir)
        self.saves += 1
        final = os.path.join(backup_dir, f"tnt-state-{self.saves:08d}")
        temporary = final + ".tmp"
        seeds = [np.array(keras.ops.convert_to_numpy(v), copy=True)
                 for v in state.held_model(model).variables if is_seed_state(v)]
        mine = pickle.dumps({"seeds": seeds})
        ranks = state.channel.gather_bytes(mine) if runtime.size > 1 else [mine]
        if runtime.is_master:
            shutil.rmtree(temporary, ignore_errors=True)
            os.makedirs(temporary)
        model.save_weights(os.path.join(temporary, _WEIGHTS))  # every rank: a collective
        if not runtime.is_master:
            return
        for rank, payload in enumerate(ranks):
            with open(os.path.join(temporary, _rank_file(rank)), "wb") as f:
                f.write(payload)
        _write(os.path.join(temporary, _JOB), {
            "position": (self.epoch, self.step), "saves": self.saves,
            "metrics": [np.array(keras.ops.convert_to_numpy(v), copy=True)
                        for v in model.metrics_variables],
            "callbacks": joining.callback_states(self.callbacks)})
        shutil.rmtree(final, ignore_errors=True)
        os.rename(temporary, final)
        step_rescue.remove_all(backup_dir)  # older than this backup
        keep = 2 if self.keras_callback.double_checkpoint else 1
        for number in sorted(_numbers(backup_dir))[:-keep]:
            shutil.rmtree(os.path.join(backup_dir, f"tnt-state-{number:08d}"), ignore_errors=True)

    def _load(self) -> None:
        """Every rank reads the backup (``backup_dir`` is on a file system they all see)."""
        model = self.model
        state = model._tnt  # noqa: SLF001
        found = self.resume_from
        assert found is not None
        if self.resume_rescue:
            self._load_rescue(found)
            return
        mine = os.path.join(found, _rank_file(state.runtime.rank))
        if not os.path.exists(mine):
            raise NotSupportedError(
                f"BackupAndRestore: rank {state.runtime.rank} cannot read the backup {found} "
                "(every rank resumes from it: put backup_dir on a file system every rank sees, "
                "and resume with as many ranks as wrote it)")
        model.load_weights(os.path.join(found, _WEIGHTS))
        with open(os.path.join(found, _JOB), "rb") as f:
            job = pickle.load(f)
        with open(mine, "rb") as f:
            own = pickle.load(f)
        metrics = list(model.metrics_variables)
        if len(metrics) != len(job["metrics"]):
            raise NotSupportedError(
                f"BackupAndRestore: the backup {found} holds {len(job['metrics'])} metric "
                f"states, the model has {len(metrics)}: compile it as the run that wrote it did")
        for v, value in zip(metrics, job["metrics"]):
            v.assign(value)
        seeds = [v for v in state.held_model(model).variables if is_seed_state(v)]
        for v, value in zip(seeds, own["seeds"]):
            v.assign(value)
        joining.restore_callback_states(self.callbacks, job["callbacks"], strict=False)
        self.saves, self.since_save, self.due = int(job["saves"]), 0, False
        state.replaying = False


    def _load_rescue(self, found: str) -> None:
        """Every rank takes its stage's state from the survivors' copies."""
        model = self.model
        state = model._tnt  # noqa: SLF001
        copies = self.copies
        if copies is None:
            raise NotSupportedError(
                f"BackupAndRestore: {found} holds the step a pipelined job under ALL was in "
                "when a rank died; only that job (the same model, strategy and number of "
                "ranks, in an elastic tnt run) can resume from it: remove it to start anew")
        self.saves = step_rescue.load(found, copies, model.metrics_variables, self.callbacks)
        self.since_save, self.due = 0, False
        state.replaying = False

    def write_rescue(self, reason: str) -> list[tuple[int, int]]:
        """A rank died (``reason``): this survivor writes its copies for the restarted job;
        the positions written (none when this model keeps no copies)."""
        if self.copies is None or _replaying(self.model):
            return []
        self.model._tnt.abort_communicators(reason)  # noqa: SLF001 (its peers fail at once)
        return self.copies.write(str(self.keras_callback.backup_dir))


def _write(path: str, value: Any) -> None:
    with open(path, "wb") as f:
        pickle.dump(value, f)


def _numbers(backup_dir: str) -> list[int]:
    try:
        names = os.listdir(backup_dir)
    except OSError:
        return []
    return [int(m.group(1)) for m in map(_STATE.match, names) if m is not None]


def _newest(backup_dir: str) -> str | None:
    """The newest complete backup in ``backup_dir`` (a renamed one), or None."""
    for number in sorted(_numbers(backup_dir), reverse=True):
        path = os.path.join(backup_dir, f"tnt-state-{number:08d}")
        if os.path.exists(os.path.join(path, _JOB)):
            return path
    return None


class SkippedWhileReplaying:
    """A step function of Keras' loop (``model.train_function``, ``test_function``) that,
    while a resumed fit replays (``model._tnt.replaying``), takes its batch from the
    iterator and runs nothing."""

    def __init__(self, model: keras.Model, function: Any) -> None:
        self.model, self.function = model, function
        self._built = False

    def __call__(self, data: Any) -> Any:
        if _replaying(self.model):
            batch = data.get_next()
            if not self._built:  # the metrics' state exists before it is loaded (as Keras
                _keras_compat.symbolic_build(self.model, batch)  # builds it under a strategy)
                self._built = True
            return {}
        return self.function(data)


class QuietProgbar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, silent while a resumed fit replays the steps its backup had
    done (the master's, in place of the one Keras would add)."""


def _quiet(name: str) -> Any:
    parent = getattr(keras.callbacks.ProgbarLogger, name)

    def hook(self: QuietProgbar, *args: Any, **kwargs: Any) -> None:
        if not _replaying(self.model):
            parent(self, *args, **kwargs)

    hook.__name__ = name
    return hook


for _name in ("on_train_begin", "on_epoch_begin", "on_train_batch_end", "on_epoch_end",
              "on_test_begin", "on_test_batch_end", "on_test_end", "on_train_end"):
    setattr(QuietProgbar, _name, _quiet(_name))
