"""Horovod's elastic API (``hvd.elastic``): a training function that goes on over the ranks
that are left when ranks die (``tnt run --min-np M``).

``@hvd.elastic.run`` wraps ``train(state, ...)``. The state is synchronised from rank 0, then
the function runs. When a collective fails because a rank left (tnt-core's ``CommError``, or
TensorFlow's error carrying it), or :meth:`State.commit` finds the membership changed
(:class:`HostsUpdatedInterrupt`), every survivor:

1. rolls its state back to the last :meth:`State.commit` (not after the interrupt: it was
   raised right after a commit),
2. binds the communicator of the new membership (:func:`tnt_core.rejoin`), to which the
   job's channel, and with it every collective of ``tarantella.horovod``, goes from then on
   (:meth:`tarantella.comm.Channel.bind`; ``hvd.rank()``/``hvd.size()`` answer for it),
3. runs the state's reset callbacks (e.g. a learning rate scaled with ``hvd.size()``),
4. synchronises the state from the new rank 0 (a survivor: survivors keep their order), and
   calls the function again.

The function returns on every rank or on none: once it returned, the ranks agree through
the store whether it returned on all of them (``tnt_core.Runtime.settle``); if a rank
failed in its last steps, the ranks whose function returned go round again too.

Why the user's traced steps still work after that: tarantella does not trace them again (it
does not own them), so in an elastic job Horovod's reductions are traced to find the
communicator, and the number of ranks, when they run (``GradientReduction.rebinding``,
:func:`tarantella.horovod._collectives.current_size`).

Differences from Horovod: no process joins a running job (``--max-np``, ``--max-restarts``
and ``--host-discovery-script`` are refused by ``run``), so a reset always
follows a departure; the state is always synchronised after a reset (Horovod skips it when
hosts were only removed); the check for a new membership is local (the watcher of tnt-core
aborts the communicator, so a rank that has not seen it yet fails at its next collective).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

import tnt_core

from .. import comm
from ..data_parallel.elastic import is_membership_failure
from ..data_parallel.weights import broadcast_variables
from ..errors import NotSupportedError
from ..reporting.log import logger
from ._collectives import broadcast_object
from ._runtime import rank

__all__ = ["HostsUpdatedInterrupt", "KerasState", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run"]


class HostsUpdatedInterrupt(RuntimeError):
    """The job's membership changed: :func:`run` resets without rolling back (raised by
    :meth:`State.commit` right after it saved). ``skip_sync`` is Horovod's; here the state
    is synchronised after every reset."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the elastic job's membership changed")
        self.skip_sync = skip_sync


class State:
    """What :func:`run` keeps across a reset: saved by :meth:`commit`, rolled back by
    :meth:`restore`, sent from rank 0 by :meth:`sync`. Subclasses say what the state is.

    :param bcast_object: sends an object from rank 0 to every rank (``hvd.broadcast_object``
        by default).
    :param get_rank: this rank (``hvd.rank`` by default).
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or rank
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Functions called after each reset, with the new membership bound and before the
        state is synchronised (e.g. to scale the learning rate with ``hvd.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory (the point a failure rolls back to), then
        :meth:`check_host_updates`."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` when the job's membership changed since this
        rank's communicator was bound (a rank left)."""
        if tnt_core.init().membership_changed():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Keep a copy of the state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the copy :meth:`save` kept."""
        raise NotImplementedError

    def sync(self) -> None:
        """Take rank 0's state on every rank (a collective)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before the reset callbacks."""


class ObjectState(State):
    """Plain Python values as attributes (``state.epoch``, ``state.batch``): saved by
    :meth:`commit`, rank 0's taken by every rank at :meth:`sync` (picklable values)."""

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def _distinct(variables: list[Any]) -> list[Any]:
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


class _Variables:
    """Host copies of a set of variables, restored by identity: a variable made after the
    copy (an optimizer built later) cannot be rolled back, and restoring says so."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._saved: list[tuple[Any, np.ndarray]] = []

    def save(self, variables: list[Any]) -> None:
        self._saved = [(v, np.array(keras.ops.convert_to_numpy(v), copy=True)) for v in variables]

    def restore(self, variables: list[Any]) -> None:
        saved = {id(v) for v, _ in self._saved}
        if any(id(v) not in saved for v in variables):
            raise NotSupportedError(
                f"hvd.elastic: {self.what} has variables made after the last commit (an "
                "optimizer built by its first step?), which cannot be rolled back: run one "
                "step before making the state, or commit after the first step")
        for v, value in self._saved:
            v.assign(value)


class TensorFlowKerasState(ObjectState):
    """A Keras model's variables and its optimizer's (slots, step counter), and any plain
    values as keyword arguments (``batch=0``).

    :param model: a built Keras model.
    :param optimizer: its optimizer (the model's compiled one by default).
    :param backend: Horovod's TensorFlow 1 session backend; accepted and unused.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("hvd.elastic: the model must be built first: call "
                             "model.build(input_shape), or run it on a batch")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._copy = _Variables("the model or its optimizer")
        self._save_model()
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        optimizer = list(self.optimizer.variables) if self.optimizer is not None else []
        return _distinct(list(self.model.variables) + optimizer)

    def _save_model(self) -> None:
        self._copy.save(self._variables())

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._copy.restore(self._variables())
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        self._save_model()
        super().sync()


class KerasState(TensorFlowKerasState):
    """A Keras model's and its optimizer's variables, and plain values as keyword arguments
    (Horovod's name for Keras; the same as :class:`TensorFlowKerasState` on Keras 3)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class TensorFlowState(ObjectState):
    """A list of TensorFlow or Keras variables, and any plain values as keyword arguments
    (eager TensorFlow 2 only; ``session`` is accepted for Horovod's signature)."""

    def __init__(self, variables: list[Any] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        if variables is None:
            raise NotSupportedError("hvd.elastic.TensorFlowState: pass the variables (TensorFlow "
                                    "2 has no global collection of them)")
        self.variables = _distinct(list(variables))
        self.session = session
        self._copy = _Variables("TensorFlowState")
        self._copy.save(self.variables)
        super().__init__(**kwargs)

    def save(self) -> None:
        self._copy.save(self.variables)
        super().save()

    def restore(self) -> None:
        self._copy.restore(self.variables)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self.variables, root_rank=0)
        self._copy.save(self.variables)
        super().sync()


def _rejoin(runtime: tnt_core.Runtime, failure: BaseException, started: float) -> None:
    """Bind the next membership's communicator to the job's channel and say so."""
    channel = comm.world(runtime)
    channel.bind(runtime.rejoin())  # CommError: evicted, or no new membership in time
    if runtime.is_master:
        membership = runtime.membership
        change = membership.describe_change() if membership is not None else "new membership"
        how = ("at the commit that found it" if isinstance(failure, HostsUpdatedInterrupt)
               else "rolled back to the last commit")
        logger.warning("elastic: %s; hvd.elastic.run goes on with %d rank(s) after %.2fs, %s",
                       change, runtime.size, time.monotonic() - started, how)


def _all_finished(runtime: tnt_core.Runtime, label: str, completed: bool = True) -> bool:
    """Whether every rank's function returned, one answer for all: True, and every rank
    returns; False (a rank failed in its last steps), and every survivor goes round again.
    Not a barrier: one a rank dies in may complete on some ranks, which would return, and
    fail on others, which would roll back and wait for them in vain
    (``tnt_core.Runtime.settle`` agrees through the store instead)."""
    if runtime.membership is None:
        if runtime.size > 1:
            comm.world(runtime).backend.barrier()
        return completed
    return runtime.settle(label, completed)


#: numbers the calls of ``hvd.elastic.run`` functions, alike on every rank (their outcomes
#: are agreed on by call)
_calls = itertools.count()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """``@hvd.elastic.run``: ``func(state, *args, **kwargs)`` synchronised from rank 0 and
    called again over the ranks that are left when ranks die (see the module doc). Outside an
    elastic job it synchronises the state and calls the function once."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        runtime = tnt_core.init()
        if runtime.membership is not None and runtime.config.elastic_joins:
            raise tnt_core.bad_input(NotSupportedError(
                "hvd.elastic.run does not take new ranks into a running job (tnt run "
                "--max-restarts, --max-np, --host-discovery-script): use --min-np alone, or "
                "the data-parallel tnt.Model's fit, which does"))
        label = f"hvd.elastic.run/{next(_calls)}"
        while True:
            failure: BaseException
            try:
                state.sync()
                result = func(state, *args, **kwargs)
                if _all_finished(runtime, label):
                    return result
                logger.info("elastic: a rank failed before the function returned on every rank; "
                            "rolling back to the last commit")
                state.restore()
                failure = tnt_core.CommError("a rank failed in the function's last steps")
            except HostsUpdatedInterrupt as exc:
                if runtime.membership is None:
                    raise
                _all_finished(runtime, label, completed=False)
                failure = exc
            except Exception as exc:
                if runtime.membership is None or not is_membership_failure(exc, runtime):
                    raise
                logger.info("elastic: a collective failed (%s); rolling back to the last commit",
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                _all_finished(runtime, label, completed=False)
                state.restore()
                failure = exc
            started = time.monotonic()
            _rejoin(runtime, failure, started)
            state.on_reset()

    return wrapper
