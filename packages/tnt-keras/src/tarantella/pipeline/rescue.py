"""The survivors' backup of the step in flight: a pipelined job under ``ParallelStrategy.ALL``
loses a rank and still resumes at that step, with serial training's result.

Why: under ``tnt run --max-restarts`` every rank of a pipelined job is restarted when one
dies (a stage cannot move to other ranks), and resumes from the user's
``BackupAndRestore`` backup (:mod:`tarantella.step_backup`): the steps since that backup are
redone. Under ALL every stage has replicas, so the survivors hold every stage's state and
nothing but the step in flight need be redone. They cannot simply write what they hold: a
rank dies anywhere in a step, and by then some stages may have applied the step's update and
others not (a stage applies once its replicas' reduction completed on it). So each rank keeps
host copies of its stage's state as it stood when each of the last two steps began, and on
the failure every survivor writes both; the restarted job takes the newest position that
every stage has a copy of.

* **Why two copies are enough.** A rank can begin step ``k + 1`` only when every stage
  of its pipeline and every replica of its stage took part in step ``k``; so no rank is
  more than one step ahead of a rank that failed in step ``k``: the position every stage
  has is ``k`` or ``k + 1``. A copy at ``k + 1`` is the state after an update whose
  reduction completed, so any stage's copies at one position agree.
* **What a copy holds** (as a backup does): the stage's weights and optimizer slots, the
  rank's seed states (a restarted replica takes its own stream from another replica's:
  :func:`tarantella.randomness.refold_seed_state`), the metric states, the callbacks'
  state and the position (epoch, steps done). Taken by the user's ``BackupAndRestore``
  (:class:`tarantella.step_backup.StepBackupAndRestore`) at the step's first hook, just
  before it may write a backup there.
* **Never half-written.** Each survivor writes
  ``<backup_dir>/tnt-rescue-<epoch>-<step>/stage-<s>-rank-<r>.pkl`` to a temporary name
  and renames it; a position is complete when every stage has a file. Its own
  communicators are aborted first, so that its peers' collectives with it fail at once
  rather than after ``TNT_TIMEOUT_S``.
* **Its cost**, in this mode only: two host copies of the stage's state (weights and
  slots), and one copy of it per step, made by one compiled function (TensorFlow's own
  copies into variables on the host: reading each variable out to NumPy took 6 times as
  long for a 3 MB stage).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..data_parallel import joining
from ..errors import NotSupportedError
from ..randomness import is_seed_state, refold_seed_state

__all__ = ["StepCopies", "complete_positions", "load", "remove_all"]

_DIR = re.compile(r"^tnt-rescue-(\d+)-(\d+)$")
_FILE = re.compile(r"^stage-(\d+)-rank-(\d+)\.pkl$")


def _dir_name(position: tuple[int, int]) -> str:
    return f"tnt-rescue-{position[0]:06d}-{position[1]:08d}"


@dataclass
class _Copy:
    """One step's copy of this rank's part (its variables' values in host variables of its
    own, filled in place step after step; the metric states, which Keras makes in the
    first step, as they are then)."""

    held: list[tf.Variable]
    copy_in: Any
    position: tuple[int, int] | None = None
    saves: int = 0
    metrics: list[np.ndarray] = field(default_factory=list)
    callbacks: bytes = b""


class StepCopies:
    """This rank's copies of its stage at the last two steps' beginnings (see the module doc).

    ``variables`` are what the rank holds of the model (its stage's weights, non-trainable
    state and seed states, then its optimizer's variables), in an order every rank of a
    stage shares."""

    def __init__(self, variables: list[Any], stage: int, replica: int, rank: int) -> None:
        self.variables = variables
        self.stage, self.replica, self.rank = stage, replica, rank
        self._copies = [self._copy() for _ in range(2)]
        self._newest = 1

    def _copy(self) -> _Copy:
        sources = [v.value if isinstance(v, keras.Variable) else v
                   for v in self.variables]
        with tf.device("/CPU:0"):
            held = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in sources]

        def copy_in() -> None:
            for h, v in zip(held, sources):
                h.assign(v)

        return _Copy(held, tf.function(copy_in, autograph=False))

    def take(self, position: tuple[int, int], saves: int, metrics: list[Any],
             callbacks: Any) -> None:
        """Copy the state as the step at ``position`` begins (once per position)."""
        if self._copies[self._newest].position == position:
            return
        self._newest = 1 - self._newest
        copy = self._copies[self._newest]
        copy.copy_in()
        copy.position, copy.saves = position, saves
        copy.metrics = [np.array(keras.ops.convert_to_numpy(m), copy=True) for m in metrics]
        copy.callbacks = pickle.dumps(joining.callback_states(callbacks))

    def write(self, backup_dir: str) -> list[tuple[int, int]]:
        """Write both copies (the newest first); the positions written."""
        written = []
        for index in (self._newest, 1 - self._newest):
            copy = self._copies[index]
            if copy.position is None:
                continue
            directory = os.path.join(backup_dir, _dir_name(copy.position))
            os.makedirs(directory, exist_ok=True)
            final = os.path.join(directory, f"stage-{self.stage}-rank-{self.rank}.pkl")
            temporary = f"{final}.tmp"
            with open(temporary, "wb") as f:
                pickle.dump({"stage": self.stage, "replica": self.replica,
                             "position": copy.position, "saves": copy.saves,
                             "values": [h.numpy() for h in copy.held],
                             "metrics": copy.metrics, "callbacks": copy.callbacks}, f,
                            protocol=5)
            os.replace(temporary, final)
            written.append(copy.position)
        return written


def _files(directory: str) -> dict[int, list[tuple[int, str]]]:
    """A rescue directory's complete files: stage -> [(rank, path)], by rank."""
    found: dict[int, list[tuple[int, str]]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            m = _FILE.match(name)
            if m is not None:
                found.setdefault(int(m.group(1)), []).append(
                    (int(m.group(2)), os.path.join(directory, name)))
    return {stage: sorted(files) for stage, files in found.items()}


def complete_positions(backup_dir: str, stages: int) -> list[tuple[tuple[int, int], str]]:
    """The positions the survivors wrote for every one of ``stages`` stages, newest first,
    each with its directory."""
    out = []
    with contextlib.suppress(OSError):
        for name in os.listdir(backup_dir):
            m = _DIR.match(name)
            if m is None:
                continue
            directory = os.path.join(backup_dir, name)
            if set(_files(directory)) >= set(range(stages)):
                out.append(((int(m.group(1)), int(m.group(2))), directory))
    return sorted(out, reverse=True)


def remove_all(backup_dir: str) -> None:
    """Remove the survivors' backups (a newer backup was written, or the fit ended)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(backup_dir):
            if _DIR.match(name):
                shutil.rmtree(os.path.join(backup_dir, name), ignore_errors=True)


def load(directory: str, copies: StepCopies, metrics: list[Any], callbacks: Any) -> int:
    """Give this rank its stage's state from ``directory`` (its own file if it wrote one,
    else a replica's, its seed streams refolded to its replica), and the metric states and
    callbacks' state of the lowest rank's file, the same on every rank; the backups written
    before it (``saves``)."""
    variables, replica = copies.variables, copies.replica
    files = _files(directory)
    path = dict(files[copies.stage]).get(copies.rank) or files[copies.stage][0][1]
    part = _read(path)
    first = min(found[0] for found in files.values())[1]  # the lowest rank's file
    job = part if first == path else _read(first)
    if len(part["values"]) != len(variables) or len(job["metrics"]) != len(metrics):
        raise NotSupportedError(
            f"BackupAndRestore: {path} holds {len(part['values'])} values of its stage and "
            f"{len(job['metrics'])} metric states; this rank has {len(variables)} and "
            f"{len(metrics)}: resume with the model and compile arguments that wrote it")
    for v, value in zip(variables, part["values"]):
        if is_seed_state(v):
            value = refold_seed_state(value, part["replica"], replica)
        v.assign(value)
    for m, value in zip(metrics, job["metrics"]):
        m.assign(value)
    joining.restore_callback_states(callbacks, pickle.loads(job["callbacks"]), strict=False)
    return int(job["saves"])


def _read(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)
