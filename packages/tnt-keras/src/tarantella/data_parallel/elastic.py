"""Elastic data parallelism: a rank dies, the survivors redo the step that failed over the
new membership, and ``fit`` goes on with the result of serial training.

Why this is possible: every survivor holds the whole model and optimizer state, and a global
batch gives the same step on any number of ranks. What has to be exact:

* **The step in flight.** A step changes state before its collectives finish (BatchNorm
  statistics and random seed states in the forward pass, metric states zeroed and updated),
  so each step starts from a snapshot of those variables (host copies, small), restored
  when it fails. The optimizers' updates wait for the step's last collective
  (``steps.StepContext.after_collectives``): a step either is applied whole on a rank or
  not at all.
* **Which steps happened.** Every collective operation of the loop (a step, the weights'
  broadcast, the stop flag's agreement) is numbered on each rank; a survivor may have
  finished one more than another (its last collective completed, a peer's did not). After
  the new communicator is bound, the ranks compare their numbers: if one is ahead, its
  state after that operation and the operation's outputs (the step's logs) go to the ranks
  behind, whose operation then counts as done; everyone else redoes it. Nothing else is
  redone, nothing is skipped.
* **The data.** The dataset yields whole global batches; each step takes this rank's
  micro-batch for the membership of the moment (:class:`tarantella.datasets.Resharder`),
  so a redone step splits the same global batch over the survivors.

The communicator: :meth:`tnt_core.Runtime.rejoin` gives the backend over the next
membership, :meth:`tarantella.comm.Channel.bind` sends every later collective to it and
drops the traced steps, which Keras traces anew.

Ranks that join (a replacement, growth): :mod:`tarantella.data_parallel.joining`, whose
checks and state transfer run here, at the operations' boundaries and after a rebind.
Not here: pipelining; custom loops.
"""

from __future__ import annotations

import pickle
import time
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from ..comm import native as native_ops
from ..datasets import Resharder
from ..errors import NotSupportedError
from ..reporting.log import logger, quiet_keras_step_retracing
from . import joining
from .steps import SeveralUpdates, is_distributed, model_optimizers
from .weights import broadcast_model_state, model_state_variables

__all__ = ["ElasticFunction", "ElasticLoop", "is_membership_failure"]

#: the collective operations of a loop, numbered alike on every rank
KINDS = ("train", "test", "predict", "sync", "weights")
#: the Keras attribute and factory of each kind of step function
_FUNCTIONS = {"train": ("train_function", "make_train_function"),
              "test": ("test_function", "make_test_function"),
              "predict": ("predict_function", "make_predict_function")}


def is_membership_failure(exc: BaseException, runtime: tnt_core.Runtime) -> bool:
    """Whether ``exc`` is a collective's failure that a new membership answers (a rank left:
    its peers' collectives fail with ``CommError``, the native path's as TensorFlow's
    ``OpError`` carrying it, the Python path's as the ``numpy_function``'s error)."""
    if isinstance(exc, tnt_core.CommError):
        return True
    if isinstance(exc, tf.errors.OpError):
        if isinstance(native_ops.original(exc), tnt_core.CommError):
            return True
        if "CommError" in (exc.message or ""):
            return True
    return runtime.membership_changed()


#: how a joiner's exchange with the job fails (a rank left: CommError, or TensorFlow's
#: error carrying it)
_EXCHANGE_FAILURES = (tnt_core.TntError, tf.errors.OpError)


class _JoinNow(tnt_core.TntError):
    """The ranks agreed, at an operation's boundary, to take in the ranks that joined."""


def _first_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message that says something."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if "Error" in line and "Graph execution error" not in line]
    return f"{type(exc).__name__}: {(said or lines or [''])[0]}"


def _as_numpy(outputs: Any) -> Any:
    return keras.tree.map_structure(
        lambda t: np.asarray(t) if tf.is_tensor(t) or isinstance(t, np.ndarray) else t, outputs)


class ElasticLoop:
    """The loop state of one model in an elastic job (see the module doc)."""

    def __init__(self, model: keras.Model, state: Any) -> None:
        self._model = weakref.ref(model)
        self.state = state
        self.resharder = Resharder()
        #: the outputs of the last collective operation this rank finished (``done`` counts them)
        self.last: Any = None
        runtime = state.runtime
        #: ranks may join the job (``tnt run --max-restarts``/``--max-np``/discovery)
        self.joins = bool(runtime.config.elastic_joins)
        #: a joiner replays the operations up to this number (see ``joining``); None: not
        #: replaying, or not a joiner
        self.replay_until: int | None = None
        self._next_kind: str | None = None
        self._predictions: dict[int, Any] = {}
        #: the callbacks of the call running (their state goes to a joiner)
        self.callbacks: Any = None
        #: metric states saved when Keras reset them after the last operation (the values
        #: that operation left, which a rank behind needs)
        self._metrics_at_reset: list[np.ndarray] | None = None
        #: seconds from each failure to its recovery, for the log and the benchmark
        self.recoveries: list[float] = []
        #: wall-clock times (``time.time()``) of each failure seen and of its recovery
        self.events: list[tuple[float, float]] = []
        self._reader: tuple[tuple[int, ...], Callable[[], list[tf.Tensor]]] | None = None
        #: the optimizers' updates wait for the step's last collective; False for a step
        #: that applies more than once (then a failure after its first update is refused)
        self.defer_updates = True

    @property
    def done(self) -> int:
        """Collective operations this rank finished (every model's loop counts alike)."""
        return joining.operations().done

    @done.setter
    def done(self, value: int) -> None:
        joining.operations().done = value

    @property
    def replaying(self) -> bool:
        """A joiner before it took the job's state: the user's callbacks do not run (the
        master's ran, and their state comes with the job's)."""
        return self.replay_until is not None

    @property
    def model(self) -> keras.Model:
        model = self._model()
        if model is None:
            raise tnt_core.TntError("the elastic loop outlived its model")
        return model

    # -- state kept across a failure --------------------------------------------------------------

    def _snapshot(self) -> tuple[list[tuple[Any, np.ndarray]], list[int]]:
        """What a step changes before its collectives end (non-trainable and metric
        variables), and the optimizers' step counters; read in one call."""
        seen: set[int] = set()
        variables = []
        for v in [*self.model.non_trainable_variables, *self.model.metrics_variables]:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
        counters = [opt.iterations for opt in model_optimizers(self.model)]
        values = self._read(variables + counters)
        return list(zip(variables, values)), [int(c) for c in values[len(variables):]]

    def _read(self, variables: list[Any]) -> list[np.ndarray]:
        """The values of ``variables``, through one traced function per set of variables
        (a read per variable costs a TensorFlow call each, per step)."""
        key = tuple(id(v) for v in variables)
        if self._reader is None or self._reader[0] != key:
            held = list(variables)
            self._reader = (key, tf.function(lambda: [tf.identity(v) for v in held], autograph=False))
        return [t.numpy() for t in self._reader[1]()]

    def _iterations(self) -> list[int]:
        return [int(keras.ops.convert_to_numpy(opt.iterations))
                for opt in model_optimizers(self.model)]

    @staticmethod
    def _restore(snapshot: list[tuple[Any, np.ndarray]]) -> None:
        for v, value in snapshot:
            v.assign(value)

    def before_reset(self) -> None:
        """Keras resets the metrics (an epoch or an evaluation begins): keep what the last
        operation left in them, once."""
        if self._metrics_at_reset is None:
            self._metrics_at_reset = [np.array(keras.ops.convert_to_numpy(v), copy=True)
                                      for v in self.model.metrics_variables]

    def _metrics_after_last(self) -> list[np.ndarray]:
        if self._metrics_at_reset is not None:
            return self._metrics_at_reset
        return [np.array(keras.ops.convert_to_numpy(v), copy=True)
                for v in self.model.metrics_variables]

    def _completed(self, outputs: Any) -> Any:
        self.done += 1
        self.last = outputs
        self._metrics_at_reset = None
        return outputs

    # -- the operations -----------------------------------------------------------------------------

    def step(self, kind: str, element: Any) -> Any:
        """One step of ``kind`` on a global batch, redone over the new membership when a rank
        leaves while it runs; its outputs (the logs, or the predictions)."""
        if self.replay_until is not None:
            if self.done < self.replay_until:
                return self._replayed(kind)
            self._take_state(kind)
        snapshot, iterations = self._snapshot() if kind != "predict" else ([], [])
        while True:
            channel = self.state.channel
            try:
                self._take_joins(kind)
                packed = self.resharder(element, channel.rank, channel.size)
                outputs = self.keras_function(kind)([packed])
            except SeveralUpdates:
                self.defer_updates = False
                setattr(self.model, _FUNCTIONS[kind][0], None)  # traced anew, applying at once
                continue
            except Exception as exc:
                if not isinstance(exc, _JoinNow) and not is_membership_failure(exc, self.state.runtime):
                    raise
                if kind == "train" and iterations != self._iterations():
                    raise tnt_core.TntError(
                        f"rank {channel.rank}: ranks left while this rank's train step had "
                        "applied part of its updates (the step calls optimizer.apply more than "
                        "once, so they cannot wait for its last collective); it cannot be "
                        "redone exactly. Resume the job from its last checkpoint "
                        f"(keras.callbacks.BackupAndRestore). The failure: {_first_line(exc)}") from exc
                self._restore(snapshot)
                if self._recover(kind, exc):
                    return self.last
                continue
            if kind == "predict" and self.joins:  # a joiner replaying this predict returns them
                joining.ledger().predictions[self.done + 1] = _as_numpy(outputs)
            return self._completed(outputs)

    def host(self, kind: str, operation: Callable[[], Any]) -> Any:
        """A collective of the loop run on the host (``kind`` "sync" or "weights"), redone
        over the new membership when a rank leaves while it runs."""
        if self.replay_until is not None:
            if self.done < self.replay_until:
                return self._replayed(kind)
            self._take_state(kind)
        while True:
            try:
                self._take_joins(kind)
                outputs = operation()
            except Exception as exc:
                if not isinstance(exc, _JoinNow) and not is_membership_failure(exc, self.state.runtime):
                    raise
                if self._recover(kind, exc):
                    return self.last
                continue
            return self._completed(outputs)

    def keras_function(self, kind: str) -> Callable[[Any], Any]:
        """Keras' own step function of ``kind`` (traced anew after a rebind)."""
        attribute, make = _FUNCTIONS[kind]
        model = self.model
        function = getattr(model, attribute)
        if function is None or (isinstance(function, ElasticFunction) and function.keras_function is None):
            getattr(model, make)(force=True)
            function = getattr(model, attribute)
        inner = function.keras_function if isinstance(function, ElasticFunction) else function
        if inner is None:
            raise tnt_core.TntError(f"Keras made no {attribute}")
        return inner

    def rebound(self) -> None:
        """A new communicator was bound: Keras' traced functions go (they hold the old one),
        while the loop Keras runs keeps calling ``model.train_function``: what stays there is
        a function that has Keras trace anew at its next step."""
        model = self.model
        for kind, (attribute, _) in _FUNCTIONS.items():
            setattr(model, attribute, ElasticFunction(self, kind, None))
        quiet_keras_step_retracing()

    # -- recovery -------------------------------------------------------------------------------

    def _recover(self, kind: str, failure: BaseException) -> bool:
        """Bind the communicator over the next membership and agree on the operation in
        flight; True when a rank ahead finished it for this one (``last`` holds its outputs)."""
        runtime = self.state.runtime
        failed_at = time.time()
        logger.info("elastic: the %s operation #%d failed (%s); rejoining", kind, self.done + 1,
                    _first_line(failure))
        started = time.monotonic()
        book = joining.ledger()
        master = runtime.membership.members[0] if runtime.membership else None
        changes: list[str] = []  # a rank may die while the others recover: each generation
        welcomed = False
        while True:
            backend = runtime.rejoin()  # CommError when evicted or no membership comes
            self.state.channel.bind(backend)
            if runtime.membership is not None:
                changes.append(runtime.membership.describe_change())
            try:
                done_by_root, stateless = self._agree(kind)
                if stateless:
                    self._welcome(None if done_by_root else kind)
                    welcomed = True
                if runtime.membership is not None:
                    book.holders = set(runtime.membership.members)
                break
            except Exception as exc:
                if not is_membership_failure(exc, runtime):
                    raise
        took = time.monotonic() - started
        self.recoveries.append(took)
        self.events.append((failed_at, time.time()))
        if runtime.is_master:
            membership = runtime.membership
            change = "; then ".join(changes) or "new membership"
            said = [] if isinstance(failure, _JoinNow) else [
                f"the {kind} step in flight "
                + ("finished by a rank ahead" if done_by_root else "redone")]
            if welcomed:
                said.append(f"the joining rank(s) took the state before the {kind} step")
            logger.warning("elastic: %s; training goes on with %d rank(s) after %.2fs, %s", change,
                           runtime.size, took, ", ".join(said) or f"from the {kind} step on")
            if membership is not None and membership.members[0] != master:  # survivors keep order
                logger.warning("elastic: the master rank left: the progress bar and the "
                               "master-only callbacks of this fit (ModelCheckpoint, CSVLogger, "
                               "...) ran there and do not go on here; this rank is the master "
                               "from now on (tnt.get_rank() == 0)")
        return done_by_root

    def _agree(self, kind: str | None) -> tuple[bool, bool]:
        """The ranks compare their operation counts; a rank behind takes the state and the
        outputs of the first rank ahead (True first on it). A joiner (``kind`` None) holds no
        state: it takes part in the collectives and takes nothing. Second: whether any rank
        holds no state (a joiner, also one whose taking of the state failed before): the
        ranks decide it from the same numbers, so all of them welcome it, or none."""
        channel = self.state.channel
        mine = np.array([self.done if kind is not None else -1,
                         KINDS.index(kind) if kind is not None else 0], dtype=np.int64)
        every = np.asarray(channel.backend.allgather(mine)).reshape(-1, 2)
        holding = every[:, 0] >= 0
        stateless = not holding.all()
        if not holding[0]:  # survivors keep their order: no rank holding the state is left
            raise tnt_core.TntError(
                "every rank that held the job's state left before the joining ranks took it: "
                "the job cannot go on exactly; resume it from its last checkpoint "
                "(keras.callbacks.BackupAndRestore)")
        top = int(every[holding, 0].max())
        behind = holding & (every[:, 0] < top)
        if not behind.any():
            return False, stateless
        root = int(np.flatnonzero(every[:, 0] == top)[0])
        needed = KINDS[int(every[behind][0, 1])]  # the operation the ranks behind are in
        payload = b""
        if channel.rank == root:
            metrics = self._metrics_after_last() if needed in ("train", "test") else None
            weights = ([np.asarray(keras.ops.convert_to_numpy(v))
                        for v in model_state_variables(self.model)]
                       if needed in ("train", "weights") else None)
            payload = pickle.dumps({"outputs": _as_numpy(self.last), "metrics": metrics,
                                    "weights": weights})
        received = channel.broadcast_bytes(payload, root)
        if kind is None or self.done == top:
            return False, stateless
        answer = pickle.loads(received)
        if answer["weights"] is not None:
            for v, value in zip(model_state_variables(self.model), answer["weights"]):
                v.assign(value)
        if answer["metrics"] is not None:
            for v, value in zip(self.model.metrics_variables, answer["metrics"]):
                v.assign(value)
        self.done = top
        self.last = answer["outputs"]
        self._metrics_at_reset = None
        return True, stateless

    # -- ranks that join ------------------------------------------------------------------------

    def _take_joins(self, kind: str) -> None:
        """At an operation's boundary in a job that ranks may join: the ranks agree on the
        newest generation any of them knows of (one allreduce); when ranks joined, every
        rank moves there now (:class:`_JoinNow`). Never inside a predict: a joiner would
        need the predictions made so far."""
        if not self.joins or kind == "predict":
            return
        runtime = self.state.runtime
        newest = np.array([runtime.newest_seen()], dtype=np.int64)
        newest = np.asarray(self.state.channel.backend.allreduce(newest, "max")).reshape(-1)
        if int(newest[0]) > runtime.generation:
            raise _JoinNow(f"generation {int(newest[0])} takes in new ranks")

    def _welcome(self, kind: str | None) -> None:
        """After a rebind, when ranks are in the job that hold no state (``_agree`` found
        them): the master tells them where the job is and gives them the state when the
        call in progress is theirs (they replay up to it first; every rank waits here
        meanwhile)."""
        runtime, channel = self.state.runtime, self.state.channel
        where = joining.ledger().describe(self.done, kind) if runtime.is_master else None
        channel.broadcast_bytes(pickle.dumps(where) if where is not None else b"", 0)
        self._give_state()

    def _give_state(self) -> None:
        """The master's state to every rank (what a joiner needs to run the next operation);
        the others take what they hold already."""
        runtime, channel = self.state.runtime, self.state.channel
        broadcast_model_state(self.model, runtime)
        payload = b""
        if runtime.is_master:
            payload = pickle.dumps({
                "metrics": [np.array(keras.ops.convert_to_numpy(v), copy=True)
                            for v in self.model.metrics_variables],
                "at_reset": self._metrics_at_reset, "last": _as_numpy(self.last),
                "seeds": joining.seed_states(self.model),
                "callbacks": joining.callback_states(self.callbacks),
                "stop": bool(getattr(self.model, "stop_training", False))})
        channel.broadcast_bytes(payload, 0)

    def greet(self) -> dict[str, Any]:
        """A joiner's first call: take part in the survivors' agreement and learn where the
        job is (``joining.CallLedger.describe``)."""
        return self._as_joiner(self._greeting)

    def _greeting(self) -> dict[str, Any]:
        self._agree(None)
        return pickle.loads(self.state.channel.broadcast_bytes(b"", 0))

    def _as_joiner(self, exchange: Callable[[], Any], again: Callable[[], Any] | None = None) -> Any:
        """``exchange`` with the job; when a rank leaves meanwhile, this rank rebinds and
        runs ``again`` (default: ``exchange``) over the next membership, until it succeeds
        or this rank has to leave (:meth:`_rejoin_as_joiner`)."""
        attempt = exchange
        while True:
            try:
                return attempt()
            except _EXCHANGE_FAILURES as exc:
                self._rejoin_as_joiner(exc)
                attempt = again or exchange

    def _rejoin_as_joiner(self, exc: BaseException) -> None:
        """A joiner's exchange with the job failed. A rank left meanwhile (another joiner,
        or one that gives the state): this rank binds the next membership and is welcomed
        anew by the survivors, who recover from the same failure. Anything else, or no
        place in the next membership: it leaves the job, which goes on without it (a
        CommError, so the rank ends in one line)."""
        runtime = self.state.runtime
        if not is_membership_failure(exc, runtime):
            if isinstance(exc, tnt_core.TntError):
                raise self._cannot_join(exc) from exc
            raise exc
        logger.info("elastic: rank %d, joining, lost a peer while it took the job's state "
                    "(%s); rejoining", runtime.rank, _first_line(exc))
        try:
            self.state.channel.bind(runtime.rejoin())
        except tnt_core.TntError as again:  # evicted, or no next membership in time
            raise self._cannot_join(again) from exc

    def _cannot_join(self, exc: BaseException) -> tnt_core.CommError:
        """A joining rank could not take the job's state: it leaves the job, whose
        survivors go on; a CommError, so the rank ends in one line."""
        return tnt_core.CommError(f"this rank, joining the running job, could not take its state "
                         f"({_first_line(exc)}); it leaves the job, which goes on without it",
                         rank=self.state.runtime.rank, operation="join")

    def _check_same_place(self, where: dict[str, Any]) -> None:
        """The job, welcoming this joiner anew, is at the operation this joiner replayed
        up to (the survivors redo the welcome of the same operation)."""
        if int(where["done"]) != self.done:
            raise tnt_core.TntError(
                f"the job is at operation {int(where['done'])} welcoming this rank anew, which "
                f"replayed up to operation {self.done}")

    def start_replay(self, where: dict[str, Any]) -> None:
        """This joiner's call is the job's call in progress: replay it up to the job's
        operation (see ``joining``)."""
        self.done = int(where["first_operation"])
        self.replay_until = int(where["done"])
        self._next_kind = where["kind"]
        self._predictions = dict(where["predictions"])

    def _replayed(self, kind: str) -> Any:
        """An operation the job did before this joiner came: the input was taken already
        (by the caller), nothing runs."""
        self.done += 1
        if kind == "predict":  # kept as the master's are: a rank joining later may need them
            joining.ledger().predictions[self.done] = self._predictions[self.done]
            return self._predictions[self.done]
        return 0 if kind == "sync" else ({} if kind in ("train", "test") else None)

    def _take_state(self, kind: str) -> None:
        """The joiner at the job's operation: the master's state, then the next operation
        with the others."""
        runtime = self.state.runtime
        self.replay_until = None
        if self._next_kind is not None and kind != self._next_kind:
            raise NotSupportedError(
                f"rank {runtime.rank} joins the running job at a {kind} operation where the "
                f"master runs a {self._next_kind} one: the script must call fit, evaluate and "
                "predict alike on every rank (a call from inside a callback cannot be replayed)")
        def transfer() -> dict[str, Any]:
            broadcast_model_state(self.model, runtime)
            return pickle.loads(self.state.channel.broadcast_bytes(b"", 0))

        def welcomed_anew() -> dict[str, Any]:  # over the next membership: where the job is first
            self._check_same_place(self._greeting())
            return transfer()

        given = self._as_joiner(transfer, welcomed_anew)
        for v, value in zip(self.model.metrics_variables, given["metrics"]):
            v.assign(value)
        self._metrics_at_reset, self.last = given["at_reset"], given["last"]
        joining.take_seed_states(self.model, given["seeds"], runtime.rank)
        joining.restore_callback_states(self.callbacks, given["callbacks"])
        self.model.stop_training = given["stop"]
        book = joining.ledger()
        if runtime.membership is not None:
            book.holders = set(runtime.membership.members)
        logger.info("elastic: rank %d took the job's state; it trains from operation %d on",
                    runtime.rank, self.done + 1)


class ElasticFunction:
    """What Keras' loop calls as ``model.train_function`` (``test_``, ``predict_``) in an
    elastic job: it takes the global batches from Keras' iterator and runs each as an
    :meth:`ElasticLoop.step` through Keras' own function (:attr:`keras_function`)."""

    def __init__(self, loop: ElasticLoop, kind: str,
                 keras_function: Callable[[Any], Any] | None) -> None:
        self.loop = loop
        self.kind = kind
        self.keras_function = keras_function

    def __call__(self, data: Any) -> Any:
        if self.kind == "predict" and any(is_distributed(element) for element in data):
            return self.loop.keras_function("predict")(data)  # predict_on_batch: split already
        if self.kind == "predict":  # Keras' predict loop passes the elements it fetched
            parts = [self.loop.step("predict", element) for element in data]
            if len(parts) == 1:
                return parts[0]
            return keras.tree.map_structure(lambda *rows: tf.concat(rows, axis=0), *parts)
        if not isinstance(data, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return self.loop.keras_function(self.kind)(data)  # *_on_batch: one batch, split already
        outputs: Any = None
        for i in range(max(1, int(self.loop.model.steps_per_execution))):
            try:
                element = data.get_next()
            except tf.errors.OutOfRangeError:
                if i == 0:
                    raise  # the epoch's end, as Keras' own function says it
                break
            outputs = self.loop.step(self.kind, element)
        return outputs
