"""Ranks that join a running data-parallel job (``tnt run --max-restarts``, ``--max-np``,
``--host-discovery-script``), so that its result stays serial training's.

A process started for the job runs the user's script from the top; its ``tnt.Model(...)``
and ``fit`` must come to the step the job is at, with the job's state:

* **Where the ranks move.** A generation that only adds ranks leaves the communicator
  working (:attr:`tnt_core.Membership.only_joins`): the ranks move to it at an operation
  boundary they agree on, a one-number allreduce of the newest generation each rank knows
  of before every collective operation of the loop (never inside a step). A generation
  whose ranks left as well is taken during the recovery from the failure it causes.
* **The script's calls.** Every top-level ``fit``/``evaluate``/``predict``/``*_on_batch``
  is numbered alike on every rank (:class:`CallLedger`). The joiner's first call greets the
  job: the master says which call runs, at which operation it began and where it is, and
  what every finished call returned. A joiner *skips* the calls the job has finished,
  returning the master's result (a ``History`` with the master's epochs and logs, the
  master's ``evaluate`` values, predictions); it joins the call in progress.
* **The call in progress.** The joiner runs Keras' own loop from that call's start with its
  steps *replayed*: each takes its global batch from the input (so the dataset's position
  and its per-iteration shuffles are the job's) but runs nothing, and the user's callbacks
  do not run. At the job's operation the master broadcasts weights, optimizer state (its
  step counter too), metric states, the random seed states (the joiner folds its rank into
  them, as every rank does), the outputs of the last operation and the user's callbacks'
  state (``History`` included); then the joiner runs the next operation with the others.
"""

from __future__ import annotations

import pickle
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from .. import callbacks as tnt_callbacks
from ..errors import NotSupportedError
from ..randomness import fold_rank_into_seeds, is_seed_state

__all__ = ["CallLedger", "OperationCounter", "ReplayingCallbacks", "callback_states", "ledger",
           "operations", "restore_callback_states", "result_of", "run_call", "seed_states",
           "skipped_result", "take_seed_states"]


class OperationCounter:
    """The collective operations of the loops of this process, numbered alike on every rank
    (one count for every model: the script's calls run one after the other)."""

    def __init__(self) -> None:
        self.done = 0


class CallLedger:
    """The script's top-level ``fit``/``evaluate``/``predict``/``*_on_batch`` calls."""

    def __init__(self) -> None:
        #: calls begun so far (the one running included)
        self.calls = 0
        #: calls running now (a fit's validation is inside its fit)
        self.depth = 0
        #: the operation count when the running call began
        self.first_operation = 0
        #: what each finished call returned, by number (sent to a joiner)
        self.results: dict[int, Any] = {}
        #: the outputs of the running predict's operations, by operation number: a joiner
        #: replaying them returns them
        self.predictions: dict[int, Any] = {}
        #: a joiner: what the master said when it greeted the job (None: not greeted yet)
        self.position: dict[str, Any] | None = None
        #: the member ids of the ranks that hold the job's state (None: not known yet)
        self.holders: set[int] | None = None

    def describe(self, done: int, kind: str | None) -> dict[str, Any]:
        """Where the job is, for a joiner: the running call (None between calls), the
        operation it began at, the operations done, the kind of the next one."""
        running = self.depth > 0
        return {"call": self.calls if running else None,
                "first_operation": self.first_operation if running else done,
                "done": done, "kind": kind, "results": dict(self.results),
                "predictions": dict(self.predictions) if running else {}}


_OPERATIONS = OperationCounter()
_LEDGER = CallLedger()


def operations() -> OperationCounter:
    return _OPERATIONS


def ledger() -> CallLedger:
    return _LEDGER


def result_of(name: str, result: Any) -> Any:
    """What a finished call gives a joiner that skips it: a fit's History as its record."""
    if name == "fit" and isinstance(result, keras.callbacks.History):
        return {"history": dict(result.history), "epoch": list(result.epoch),
                "params": dict(getattr(result, "params", None) or {})}
    return result


def skipped_result(name: str, record: Any, model: keras.Model) -> Any:
    """The master's result of a call this joiner skips (see :func:`result_of`)."""
    if name != "fit":
        return record
    history = keras.callbacks.History()
    history.set_model(model)
    history.history, history.epoch = dict(record["history"]), list(record["epoch"])
    history.set_params(record["params"])
    return history


# -- the user's callbacks ------------------------------------------------------------------------

#: attributes of a callback that are not its state: its place in this process
_NOT_STATE = frozenset({"model", "_model", "params", "_params"})


def _stateful_callbacks(callbacks: Any) -> list[keras.callbacks.Callback]:
    """The callbacks whose state a joiner takes (every rank runs them the same way): the
    user's callbacks that run on every rank, and History."""
    out = []
    every = callbacks.every_callback() if isinstance(callbacks, ReplayingCallbacks) else \
        getattr(callbacks, "callbacks", callbacks)
    for cb in every or []:
        if isinstance(cb, tnt_callbacks.Callback):
            if not cb.run_on_all_ranks:
                continue
            cb = cb.keras_callback
        if isinstance(cb, (keras.callbacks.ProgbarLogger, *tnt_callbacks.INTERNAL)):
            continue
        out.append(cb)
    return out


def _is_state(value: Any) -> bool:
    if callable(value) or isinstance(value, (tf.Variable, keras.Variable, tf.Module,
                                             keras.layers.Layer, keras.optimizers.Optimizer)):
        return False
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 (whatever cannot be pickled stays the joiner's own)
        return False
    return True


def callback_states(callbacks: Any) -> list[tuple[str, dict[str, Any]]]:
    """Each stateful callback's class name and picklable attributes (the master's)."""
    return [(type(cb).__name__, {k: v for k, v in vars(cb).items()
                                 if k not in _NOT_STATE and _is_state(v)})
            for cb in _stateful_callbacks(callbacks)]


def restore_callback_states(callbacks: Any, states: list[tuple[str, dict[str, Any]]],
                            strict: bool = True) -> None:
    """Give each stateful callback its state from ``states`` (``callback_states``). Strict
    (a joiner): the callbacks must be the master's. Not strict (a backup read by a later
    run, whose callbacks may differ): each takes the state of the next one of its class,
    in order; one without is left as it is."""
    mine = _stateful_callbacks(callbacks)
    names = [type(cb).__name__ for cb in mine]
    if not strict:
        left = list(states)
        for cb in mine:
            found = next((i for i, (name, _) in enumerate(left) if name == type(cb).__name__), None)
            if found is not None:
                for key, value in left.pop(found)[1].items():
                    setattr(cb, key, value)
        return
    if names != [name for name, _ in states]:
        raise NotSupportedError(
            f"rank {tnt_core.get_rank()} joins the running job with other callbacks than the "
            f"master's ({names} here, {[name for name, _ in states]} there): every rank must "
            "pass the same callbacks")
    for cb, (_, attributes) in zip(mine, states):
        for key, value in attributes.items():
            setattr(cb, key, value)


# -- random seed states --------------------------------------------------------------------------

def seed_states(model: keras.Model) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v), copy=True)
            for v in model.variables if is_seed_state(v)]


def take_seed_states(model: keras.Model, values: list[np.ndarray], rank: int) -> None:
    """The master's seed states, with this rank folded in (``tarantella.randomness``)."""
    states = [v for v in model.variables if is_seed_state(v)]
    if len(states) != len(values):
        raise NotSupportedError(f"rank {rank} joins with {len(states)} random seed states in "
                                f"its model, the master has {len(values)}: build the same model")
    for v, value in zip(states, values):
        v.assign(value)
    fold_rank_into_seeds(model, rank)


# -- a joiner's replay ---------------------------------------------------------------------------

class ReplayingCallbacks(keras.callbacks.CallbackList):
    """Keras' CallbackList, whose hooks reach only tarantella's own callbacks while the
    joiner replays the operations the job had done (``replaying()`` True): the user's
    callbacks take the master's state when the replay ends."""

    def __init__(self, *args: Any, replaying: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._replaying = replaying

    @property  # Keras' attribute, read by each of its hooks
    def callbacks(self) -> list[keras.callbacks.Callback]:
        every = self.__dict__.get("_every", [])
        replaying = self.__dict__.get("_replaying")
        if replaying is None or not replaying():
            return every
        return [cb for cb in every if isinstance(cb, tnt_callbacks.INTERNAL)]

    @callbacks.setter
    def callbacks(self, value: list[keras.callbacks.Callback]) -> None:
        self.__dict__["_every"] = value

    def every_callback(self) -> list[keras.callbacks.Callback]:
        return list(self.__dict__.get("_every", []))


def run_call(model: keras.Model, loop: Any, name: str, run: Any) -> Any:
    """A top-level ``fit``/``evaluate``/``predict``/``*_on_batch`` of an elastic job that
    ranks may join: numbered; on a joiner, skipped when the job had finished it (the
    master's result), replayed up to the job's operation when it is the one in progress
    (see the module doc)."""
    book = ledger()
    if book.depth > 0:
        raise NotSupportedError(
            f"{name} called inside another fit, evaluate or predict (from a callback) in an "
            "elastic job that ranks may join: a joining rank could not replay it; call it "
            "after the outer call, or run without --max-restarts/--max-np/--host-discovery-script")
    book.calls += 1
    number = book.calls
    runtime = loop.state.runtime
    if runtime.joined_late and book.holders is None:
        if book.position is None:
            book.position = loop.greet()
        position = book.position
        running = position["call"]
        if running is None or number < running:
            if number not in position["results"]:
                raise NotSupportedError(
                    f"rank {runtime.rank} joined the running job, whose script made no call "
                    f"#{number} ({name}): the script must call fit, evaluate and predict alike "
                    "on every rank")
            # kept as the job's: should this rank be the master later, a joiner learns it here
            book.results[number] = position["results"][number]
            return skipped_result(name, position["results"][number], model)
        if number > running:
            raise NotSupportedError(
                f"rank {runtime.rank} joined the running job at call #{number} ({name}) of its "
                f"script while the job runs call #{running}: the script must call fit, evaluate "
                "and predict alike on every rank")
        loop.start_replay(position)
    book.depth += 1
    book.first_operation = loop.done
    book.predictions.clear()
    try:
        result = run()
    finally:
        book.depth -= 1
        book.predictions.clear()
    book.results[number] = result_of(name, result)
    return result
