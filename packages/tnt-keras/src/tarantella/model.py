"""``tnt.Model``: the user's Keras model, distributed in place; the base of both strategies.

``tnt.Model(keras_model)`` returns *the same object*, now an instance of a subclass made
for its class: ``class <Cls>(<sibling>, Cls)``, where the sibling is the strategy's model
class, :class:`~tarantella.data_parallel.model.DataParallelModel` or
:class:`~tarantella.pipeline.model.PipelinedModel`, both subclasses of :class:`Model`. So
the model stays everything it was (``isinstance(m, keras.Model)`` and ``isinstance(m,
Cls)`` hold, it nests in other models, ``self.model`` in callbacks is it,
``keras.saving.save_model`` takes it), its layers, weights, summary and config are
untouched, and the user's own ``train_step``/``compute_loss`` overrides still run: the
sibling's methods come first in the method order and call them through ``super()``. For
serialization the distributed subclass reports the user's class as ``__class__``, so a
saved file is exactly the one plain Keras writes and loads without tarantella.

What this base holds is what both strategies share: the strategy and its parsing, the class
swap, the state every distributed model keeps (runtime, strategy, whether the master's
weights must be broadcast), identity, ``summary`` on the master, and writing files once
(``save``, ``save_weights``, ``export``; ``tarantella.files``). The loops, the steps and
what a strategy adds to ``compile`` are the siblings'; the checks of the user's arguments
are :mod:`tarantella.arguments`'. A sibling names the strategies it trains in its class
statement (``class DataParallelModel(Model, strategies=(ParallelStrategy.DATA,))``), so
this module imports neither of them.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import io
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import keras

import tnt_core
from tnt_core import TntError

from . import arguments, comm, files
from .data_parallel.steps import LocalIncrements
from .errors import NotSupportedError
from .keras_backend import other_backend_error
from .reporting.tracebacks import user_facing
from .seams.class_swap import disguised_subclass

__all__ = ["DistributedState", "Model", "ParallelStrategy", "keras_model_from_config"]


class ParallelStrategy(enum.Enum):
    """How a ``tnt.Model`` is parallelized: ``DATA`` (every rank a replica, the batch
    split), ``PIPELINING`` (the model cut into partitions, at its SplitLayers or
    automatically, one per rank, the batch split into micro-batches that flow through
    them)."""

    DATA = "data"
    PIPELINING = "pipelining"
    ALL = "all"

    def __or__(self, other: object) -> ParallelStrategy:
        """``DATA | PIPELINING`` is ``ALL``, as in the original Tarantella."""
        if not isinstance(other, ParallelStrategy):
            return NotImplemented
        both = {self, other}
        if both == {ParallelStrategy.DATA, ParallelStrategy.PIPELINING} or ParallelStrategy.ALL in both:
            return ParallelStrategy.ALL
        return self


#: strategies of the Tarantella design that this release does not implement
_NOT_IMPLEMENTED: dict[str, str] = {}
_ALIASES = {"pipeline": ParallelStrategy.PIPELINING}


def _strategy(value: Any) -> ParallelStrategy:
    if isinstance(value, ParallelStrategy):
        return value
    if isinstance(value, str) and value.lower() in [s.value for s in ParallelStrategy]:
        return ParallelStrategy(value.lower())
    if isinstance(value, str) and value.lower() in _ALIASES:
        return _ALIASES[value.lower()]
    what = _NOT_IMPLEMENTED.get(value.lower()) if isinstance(value, str) else None
    problem = (f"{what} is not implemented in this release" if what is not None
               else "not a parallel strategy")
    raise NotSupportedError(
        f"tnt.Model(parallel_strategy={value!r}): {problem}; use tnt.ParallelStrategy.DATA "
        "(or 'data', the default), tnt.ParallelStrategy.PIPELINING ('pipelining') or "
        "tnt.ParallelStrategy.ALL ('all')"
    )


class DistributedState:
    """What every distributed model keeps besides its Keras state (one per model); each
    strategy's model keeps a subclass."""

    def __init__(self, runtime: tnt_core.Runtime, strategy: ParallelStrategy) -> None:
        self.runtime = runtime
        #: the job's channel: every collective of the model's steps goes through it
        self.channel = comm.world(runtime)
        self.strategy = strategy
        #: the master's weights must reach every rank before the next step
        self.needs_broadcast = True
        self._local = {"train": LocalIncrements(), "test": LocalIncrements()}
        #: the predictions the current ``predict`` passes its callbacks are the global batch's,
        #: gathered from micro-batches tarantella split (False: this rank's own already)
        self.predictions_gathered = False
        #: a resumed fit replays the steps its backup had done: they take their batches and
        #: run nothing, and the user's callbacks do not run (``tarantella.step_backup``)
        self.replaying = False

    #: ``keras.callbacks.BackupAndRestore`` resumes at the step (``tarantella.step_backup``)
    #: rather than at Keras' epoch
    resumes_at_step = False
    #: what runs a ``BackupAndRestore`` then (``step_backup.StepBackupAndRestore``, given by
    #: the strategy's model, which imports it: ``tarantella.callbacks`` cannot, being its base)
    step_backup_callback: Any = None

    def held_model(self, model: keras.Model) -> keras.Model:
        """The part of ``model`` whose variables this rank holds (all of it, unless a
        strategy cuts the model into parts)."""
        return model

    def master_writes(self, model: keras.Model, run: Callable[[], None] | None) -> None:
        """Run a hook of a master-only callback that may save (``run``: on the master; None
        on the other ranks): its writes happen on the master alone. A strategy whose other
        ranks take part in the master's saves (pipelining: they hold the other partitions)
        overrides this."""
        if run is not None:
            with files.local_writes():
                run()

    def local_increments(self, kind: str) -> LocalIncrements:
        """This rank's own metric increments (what callbacks with ``aggregate_logs=False``
        show); the data-parallel steps record them."""
        return self._local.setdefault(kind, LocalIncrements())

    def own_rows(self, rows: int) -> slice | None:
        """This rank's rows of the ``rows`` predictions of a global batch (what callbacks
        with ``aggregate_logs=False`` show); None when they are all this rank's own."""
        if not self.predictions_gathered or self.runtime.size == 1:
            return None
        runtime = self.runtime
        start = tnt_core.micro_batch_offset(rows, runtime.rank, runtime.size, allow_empty=True)
        count = tnt_core.micro_batch_size(rows, runtime.rank, runtime.size, allow_empty=True)
        return slice(start, start + count)


def _distribute(model: Any, parallel_strategy: Any, num_micro_batches: Any = None,
                num_pipeline_stages: Any = None, pipeline_schedule: Any = None,
                recompute: Any = None) -> Model:
    strategy = _strategy(parallel_strategy)
    for name, value, what in (("num_micro_batches", num_micro_batches, "splits the batch of"),
                              ("num_pipeline_stages", num_pipeline_stages, "cuts the model into"),
                              ("pipeline_schedule", pipeline_schedule, "orders the passes of"),
                              ("recompute", recompute, "recomputes the activations of")):
        if value is not None and strategy is ParallelStrategy.DATA:
            raise TypeError(f"tnt.Model({name}={value!r}) {what} a pipeline: pass it with "
                            "parallel_strategy=tnt.ParallelStrategy.PIPELINING (or ALL)")
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise other_backend_error(backend)
    if isinstance(model, Model):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"tnt.Model wraps a keras.Model (Sequential, functional or sub-classed); got "
            f"{type(model).__name__}"
        )
    sibling = Model._tnt_siblings[strategy]  # noqa: SLF001 (this module's class)
    return sibling._tnt_distribute(model, strategy, num_micro_batches,  # noqa: SLF001 (its hook)
                                   num_pipeline_stages, pipeline_schedule, recompute)


def keras_model_from_config(config: dict, custom_objects: dict | None = None) -> keras.Model:
    """A Keras model from a model's ``get_config()``, or from a serialized ``{"class_name":
    ..., "config": ...}`` dict (new weights)."""
    if isinstance(config, dict) and "class_name" in config and "config" in config:
        return keras.models.model_from_json(json.dumps(config), custom_objects=custom_objects)
    if isinstance(config, dict) and "layers" in config and "input_layers" not in config:
        return keras.Sequential.from_config(config, custom_objects=custom_objects)
    return keras.Model.from_config(config, custom_objects=custom_objects)


class Model(keras.Model):
    """Distributed training of a ``keras.Model``: ``tnt.Model(model)`` returns ``model``,
    distributed; use it as the Keras model itself.

    :param model: the Keras model (its weights are broadcast from the master rank).
    :param parallel_strategy: ``tnt.ParallelStrategy.DATA`` (the default),
        ``PIPELINING`` (a functional or Sequential model cut into partitions, one per rank)
        or ``ALL`` (several pipelines, data-parallel); see the "Pipelining" guide.
    :param num_micro_batches: for ``PIPELINING``/``ALL``, the micro-batches each global
        batch is split into (default 1).
    :param num_pipeline_stages: for ``PIPELINING``/``ALL``, the number of partitions
        (stages) a model without ``tnt.keras.layers.SplitLayer`` is cut into automatically,
        balancing their parameters (default under ``PIPELINING``: one per rank). A model
        with SplitLayers is cut at them; a different ``num_pipeline_stages`` is refused.
    :param pipeline_schedule: for ``PIPELINING``/``ALL``, the order of each stage's passes:
        ``"1f1b"`` (the default), ``"zb-h1"`` (zero bubble: each weight gradient apart,
        filling the waits), ``"zb-fused"`` (the weight gradients of several micro-batches
        together, one op each, for the memory of GPipe) or ``"gpipe"``; see the
        "Pipelining" guide.
    :param recompute: for ``PIPELINING``/``ALL``, activation recomputation: ``True`` (every
        stage), or a list of one bool per partition; such a stage keeps only the inputs of
        the micro-batches in flight and computes their forward pass again in their backward
        pass (the same result, for one more forward pass; default ``False``).
    """

    _tnt: DistributedState
    _tnt_base: type
    #: the model class that trains each strategy (the siblings register in their class
    #: statements: ``strategies=(...)``)
    _tnt_siblings: ClassVar[dict[ParallelStrategy, type[Model]]] = {}

    def __init_subclass__(cls, strategies: Iterable[ParallelStrategy] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for strategy in strategies:
            Model._tnt_siblings[strategy] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Model:
            try:
                return _distribute(*arguments.model_arguments(*args, **kwargs))
            except (TntError, ValueError, TypeError) as exc:  # a refusal: at the user's call
                raise exc.with_traceback(None) from None
        base = cls.__dict__.get("_tnt_base")
        if base is None:
            raise TypeError(
                "tnt.Model is not a base class: subclass keras.Model and pass an instance to "
                "tnt.Model(...)"
            )
        return _distribute(base(*args, **kwargs), ParallelStrategy.DATA)  # e.g. from_config

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: ``__new__`` returned the user's model, initialised already."""

    @classmethod
    def _tnt_distribute(cls, model: keras.Model, strategy: ParallelStrategy,
                        num_micro_batches: Any, num_pipeline_stages: Any = None,
                        pipeline_schedule: Any = None, recompute: Any = None) -> Model:
        """Make ``model`` (a plain Keras model) a model of this strategy (each sibling's)."""
        raise NotImplementedError(f"{cls.__name__} trains no strategy")

    @classmethod
    def _tnt_adopt(cls, model: keras.Model, state: DistributedState) -> Any:
        """The class swap: ``model`` becomes an instance of ``<its class>(cls, its class)``
        holding ``state``."""
        object.__setattr__(model, "__class__", disguised_subclass(cls, type(model)))
        object.__setattr__(model, "_tnt", state)
        state.channel.on_bind(model._tnt_rebound)  # noqa: SLF001 (the model just adopted)
        return model

    def _tnt_rebound(self, channel: comm.Channel) -> None:
        """A new communicator was bound to the job's channel: what Keras traced for the old
        one goes, and the next step traces anew (weights, optimizer state, metrics and the
        step counter stay as they are)."""
        self.train_function = self.test_function = self.predict_function = None

    # -- identity ---------------------------------------------------------------------------

    @property
    def keras_model(self) -> keras.Model:
        """The model itself (``tnt.Model`` distributes the user's model in place)."""
        return self

    @property
    def parallel_strategy(self) -> ParallelStrategy:
        return self._tnt.strategy

    def __repr__(self) -> str:
        runtime = self._tnt.runtime
        base = type(self)._tnt_base.__name__  # noqa: SLF001 (this class's own attribute)
        return f"<tnt.Model {self.name!r} ({base}) on rank {runtime.rank}/{runtime.size}>"

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Any:
        """A new ``tnt.Model`` from ``get_config()`` output (new weights)."""
        if cls is Model:
            return Model(keras_model_from_config(config, custom_objects=custom_objects))
        base = cls.__dict__["_tnt_base"]
        made = (base.from_config(config) if custom_objects is None
                else base.from_config(config, custom_objects=custom_objects))
        return _distribute(made, ParallelStrategy.DATA)

    # -- configuration ------------------------------------------------------------------------

    def _tnt_check_compiled(self) -> None:
        """After ``compile``: refuse what no strategy trains, and broadcast the master's state
        before the next step."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise NotSupportedError(
                f"optimizer {type(optimizer).__name__} is not a Keras 3 optimizer; use one from "
                "keras.optimizers (or a subclass of keras.optimizers.Optimizer)"
            )
        self._tnt.needs_broadcast = True

    def summary(self, *args: Any, **kwargs: Any) -> None:
        """Print the Keras summary, on the master rank only."""
        if self._tnt.runtime.is_master:
            super().summary(*args, **kwargs)

    # -- weights, saving --------------------------------------------------------------------

    @user_facing
    def set_weights(self, weights: list) -> None:
        """As Keras; the master's weights are broadcast before the next step."""
        super().set_weights(weights)
        self._tnt.needs_broadcast = True

    @user_facing
    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """As Keras (every rank reads); the master's weights are broadcast before the next step."""
        path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
        if isinstance(path, str) and "://" not in path and not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        super().load_weights(filepath, *args, **kwargs)
        self._tnt.needs_broadcast = True

    @user_facing
    def save(self, filepath: Any, overwrite: bool = True, zipped: Any = None, *,
             tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
        """Save the model as Keras does (a plain Keras file). Call on every rank: the master
        writes (every rank with ``tnt_save_all_devices=True``), atomically, and all ranks
        return once the file is complete."""
        parent = super().save
        if zipped is not None:
            kwargs["zipped"] = zipped
        arguments.check_save_path("save", filepath, kwargs)
        files.write_collectively(lambda path: parent(path, overwrite=True, **kwargs), filepath,
                                 overwrite=overwrite, all_devices=tnt_save_all_devices,
                                 runtime=self._tnt.runtime)

    @user_facing
    def save_weights(self, filepath: Any, overwrite: bool = True, *,
                     tnt_save_all_devices: bool = False, **kwargs: Any) -> None:
        """Save the weights (``.weights.h5``); the master writes, as :meth:`save`."""
        parent = super().save_weights
        arguments.check_save_path("save_weights", filepath, kwargs)
        files.write_collectively(lambda path: parent(path, overwrite=True, **kwargs), filepath,
                                 overwrite=overwrite, all_devices=tnt_save_all_devices,
                                 runtime=self._tnt.runtime)

    @user_facing
    def export(self, filepath: Any, *args: Any, tnt_save_all_devices: bool = False,
               **kwargs: Any) -> None:
        """``keras.Model.export``, written by the master only (every rank waits for it)."""
        parent = super().export
        printed: list[tuple[str, str]] = []

        def write(path: str) -> None:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                parent(path, *args, **kwargs)
            printed.append((path, out.getvalue()))

        files.write_collectively(write, filepath, all_devices=tnt_save_all_devices,
                                 runtime=self._tnt.runtime)
        for path, text in printed:  # Keras' report names the temporary path: now the user's
            sys.stdout.write(text.replace(path, os.fspath(filepath)))
            sys.stdout.flush()
