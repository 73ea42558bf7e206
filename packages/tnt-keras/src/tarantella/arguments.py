"""The checks of what a user passes to ``tnt.Model`` and its methods, for every strategy.

Why a module of its own: a bad argument must fail at the user's call, in one line that names
the argument and says what to pass, before anything runs. In a multi-rank job that means
before the first collective: every rank holds the same arguments, so every rank decides
alike and none is left waiting for the others. The data-parallel and the pipelined model
(:mod:`tarantella.data_parallel.model`, :mod:`tarantella.pipeline.model`) call the same checks
at the start of their loops. Where plain Keras' own message is clear, the check raises it
(or leaves it to Keras); where Keras fails later with a message that does not name the
culprit, the check says more.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .errors import DatasetError

__all__ = [
    "check_compiled",
    "check_evaluate",
    "check_fit",
    "check_loop_arguments",
    "check_num_micro_batches",
    "check_num_pipeline_stages",
    "check_pipeline_schedule",
    "check_recompute",
    "check_optimizer",
    "check_predict",
    "check_save_path",
    "check_single_samples",
    "model_arguments",
    "refuse_data_parallel_arguments",
]


# -- tnt.Model(...) ----------------------------------------------------------------------------

def model_arguments(model: Any = None, parallel_strategy: Any = "data",
                    num_micro_batches: Any = None, num_pipeline_stages: Any = None,
                    pipeline_schedule: Any = None, recompute: Any = None,
                    **kwargs: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """``(model, parallel_strategy, num_micro_batches, num_pipeline_stages,
    pipeline_schedule, recompute)`` of a ``tnt.Model(...)`` call."""
    if kwargs:
        raise TypeError(
            f"tnt.Model(model, parallel_strategy=...) got unexpected arguments {sorted(kwargs)}; "
            "build the Keras model first (keras.Model(inputs, outputs), Sequential, or a "
            "subclass) and pass it"
        )
    if model is None:
        raise TypeError("tnt.Model(model): pass the keras.Model to distribute")
    return (model, parallel_strategy, num_micro_batches, num_pipeline_stages, pipeline_schedule,
            recompute)


def check_num_micro_batches(value: Any) -> int:
    """The number of micro-batches of a pipeline, a positive integer."""
    if not _is_integer(value) or value < 1:
        raise ValueError(f"tnt.Model(num_micro_batches={value!r}): the number of "
                         "micro-batches each global batch is split into, a positive integer")
    return int(value)


def check_num_pipeline_stages(value: Any) -> int | None:
    """The number of partitions (stages) of a pipeline, a positive integer, or None."""
    if value is None:
        return None
    if not _is_integer(value) or value < 1:
        raise ValueError(f"tnt.Model(num_pipeline_stages={value!r}): the number of partitions "
                         "the model is cut into (one stage each), a positive integer")
    return int(value)


def check_pipeline_schedule(value: Any, known: Sequence[str]) -> str:
    """The name of a pipeline's schedule, one of ``known`` (the default first), or None for
    the default."""
    if value is None:
        return known[0]
    if not isinstance(value, str) or value not in known:
        names = ", ".join(f"{name!r}" + (" (the default)" if i == 0 else "")
                          for i, name in enumerate(known))
        raise ValueError(f"tnt.Model(pipeline_schedule={value!r}): the order of each stage's "
                         f"passes, one of {names}")
    return value


def check_recompute(value: Any, num_partitions: int) -> list[bool]:
    """Whether each of ``num_partitions`` stages recomputes its activations: None (no
    stage), one bool for every stage, or a list of one bool per partition."""
    what = ("whether a stage computes its forward pass again in its backward pass instead of "
            "keeping its activations")
    if value is None:
        return [False] * num_partitions
    if isinstance(value, (bool, np.bool_)):
        return [bool(value)] * num_partitions
    if not isinstance(value, (list, tuple)) or \
            not all(isinstance(v, (bool, np.bool_)) for v in value):
        raise ValueError(f"tnt.Model(recompute={value!r}): {what}: True, False, or a list of "
                         "one bool per partition")
    if len(value) != num_partitions:
        raise ValueError(f"tnt.Model(recompute={value!r}): one bool per partition, and the model "
                         f"has {num_partitions} partitions")
    return [bool(v) for v in value]


# -- compile -----------------------------------------------------------------------------------

def check_optimizer(optimizer: Any) -> None:
    """Refuse a TensorFlow 1 optimizer, which Keras 3 fails on deep inside ``compile``."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ValueError(
            f"compile(optimizer={type(optimizer).__name__}(...)): a TensorFlow 1 optimizer "
            "(tf.compat.v1.train), which Keras 3 cannot use; pass a Keras optimizer, e.g. "
            "keras.optimizers.SGD(learning_rate=0.1), or its name, e.g. 'sgd'"
        )


def check_compiled(model: keras.Model, method: str) -> None:
    """A loop that trains or evaluates needs ``compile()`` first (Keras' own refusal)."""
    if not model.compiled:
        raise ValueError(f"You must call `compile()` before calling `{method}()`.")


# -- fit / evaluate / predict ------------------------------------------------------------------

#: the counting arguments of fit/evaluate/predict: (smallest value, what it is); each may be
#: None except ``epochs``, ``initial_epoch`` and ``validation_freq``
_COUNTS = {
    "batch_size": (1, "the global batch size"),
    "validation_batch_size": (1, "the global batch size of the validation data"),
    "epochs": (0, "the epoch to train up to"),
    "initial_epoch": (0, "the epoch to start from"),
    "steps_per_epoch": (1, "None: until the data is exhausted"),
    "validation_steps": (1, "None: until the validation data is exhausted"),
    "steps": (1, "None: until the data is exhausted"),
    "validation_freq": (1, "validate every that many epochs"),
    "tnt_micro_batch_size": (1, "the batch size of each rank"),
    "tnt_validation_micro_batch_size": (1, "the validation batch size of each rank"),
}
_NOT_NONE = ("epochs", "initial_epoch", "validation_freq")


def _is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _count_problem(name: str, value: Any) -> tuple[type[Exception], str] | None:
    """What is wrong with the counting argument ``name=value``, if anything."""
    smallest, meaning = _COUNTS[name]
    if value is None and name not in _NOT_NONE:
        return None
    if name == "validation_freq" and isinstance(value, (list, tuple)):  # epochs to validate at
        if all(_is_integer(v) and v >= 1 for v in value):
            return None
        return TypeError, "validation_freq must be an integer >= 1 or a list of epoch numbers >= 1"
    kind = "a positive integer" if smallest == 1 else "an integer >= 0"
    either = "" if name in _NOT_NONE else " or None"
    if not _is_integer(value):
        return TypeError, (f"{name} must be {kind}{either} ({meaning}), not "
                           f"{type(value).__name__}")
    if value < smallest:
        return ValueError, f"{name} must be {kind}{either} ({meaning})"
    return None


def _callbacks_problem(callbacks: Any) -> tuple[list[Any] | None, str | None]:
    """``callbacks`` as a list, as Keras takes it (a list, a tuple or a single callback), or
    what is wrong with it."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks, None
    items = keras.tree.flatten(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for index, cb in enumerate(items):
        if isinstance(cb, keras.callbacks.Callback):
            continue
        where = f"callbacks[{index}]" if isinstance(callbacks, (list, tuple)) else "callbacks"
        if isinstance(cb, type) and issubclass(cb, keras.callbacks.Callback):
            return None, (f"{where} is the class {cb.__name__}, not a callback: pass an instance, "
                          f"{cb.__name__}(...)")
        return None, (f"{where} is {type(cb).__name__} {cb!r:.40}, not a keras.callbacks.Callback; "
                      "pass a list of callback instances")
    return items, None


def _data_problem(name: str, data: Any) -> str | None:
    """A file name, or NumPy arrays of strings or objects, which Keras cannot feed to a model."""
    if isinstance(data, tf.data.Dataset) or data is None:
        return None
    if isinstance(data, (str, bytes, os.PathLike)):
        return (f"{name} is the {type(data).__name__} {data!r:.60}, not data: Keras does not "
                "read files; load it first, into NumPy arrays (e.g. numpy.loadtxt, "
                "pandas.read_csv) or a tf.data.Dataset (e.g. "
                "tf.data.experimental.make_csv_dataset), and pass that")
    try:
        arrays = [a for a in keras.tree.flatten(data) if isinstance(a, np.ndarray)]
    except (TypeError, ValueError):
        return None  # Keras' adapter will say what it cannot use
    for array in arrays:
        if array.dtype.kind in "USO":
            what = "Python objects" if array.dtype.kind == "O" else "strings"
            return (f"{name} holds a NumPy array of {what} (dtype {array.dtype}), which a Keras "
                    "model cannot take; convert it to numbers (e.g. with a StringLookup or "
                    "TextVectorization layer outside the model), or pass a tf.Tensor or "
                    "tf.data.Dataset of strings to a model with string inputs")
    return None


def _first_dimensions(data: Any) -> list[int] | None:
    """The first dimension of every array in ``data`` (NumPy arrays and tensors, nested);
    None when it holds anything else (Keras' adapters judge that)."""
    try:
        leaves = keras.tree.flatten(data)
    except (TypeError, ValueError):
        return None
    sizes = []
    for leaf in leaves:
        if leaf is None:
            continue
        if not isinstance(leaf, (np.ndarray, tf.Tensor)) or len(leaf.shape) == 0 \
                or leaf.shape[0] is None:
            return None
        sizes.append(int(leaf.shape[0]))
    return sizes


def _cardinality_problem(data: dict[str, Any]) -> str | None:
    """Arrays of ``x``, ``y``, ``sample_weight`` with different numbers of samples."""
    sizes: dict[str, list[int]] = {}
    for name, value in data.items():
        if value is None:
            continue
        found = _first_dimensions(value)
        if found is None:
            return None
        sizes[name] = found
    if len({n for found in sizes.values() for n in found}) < 2:
        return None
    names = list(sizes)
    listed = " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]
    counts = ", ".join(f"{name}: {'/'.join(map(str, dict.fromkeys(found)))}"
                       for name, found in sizes.items())
    return (f"{listed} have different numbers of samples ({counts}); every array must have "
            "one entry per sample along its first dimension")


def check_loop_arguments(method: str, callbacks: Any, data: dict[str, Any],
                         **counts: Any) -> Any:
    """Check the arguments of ``fit``/``evaluate``/``predict`` before anything else runs (no
    collective yet; every rank has the same arguments, so all decide alike). One line that
    names the argument, as plain Keras would raise or better; returns ``callbacks`` as a list
    (Keras also takes a single callback or a tuple)."""
    for name, value in counts.items():
        problem = _count_problem(name, value)
        if problem is not None:
            raise problem[0](f"{method}({name}={value!r}): {problem[1]}")
    for name, value in data.items():
        message = _data_problem(name, value)
        if message is not None:
            raise TypeError(f"{method}({name}=...): {message}")
    arrays = {name: data.get(name) for name in ("x", "y", "sample_weight")}
    message = _cardinality_problem(arrays)
    if message is not None:
        given = ", ".join(f"{name}=..." for name, value in arrays.items() if value is not None)
        raise DatasetError(f"{method}({given}): {message}")
    validation = data.get("validation_data")
    if isinstance(validation, (list, tuple)) and len(validation) in (2, 3):
        message = _cardinality_problem(dict(zip(("x", "y", "sample_weight"), validation)))
        if message is not None:
            raise DatasetError(f"{method}(validation_data=...): its {message}")
    listed, message = _callbacks_problem(callbacks)
    if message is not None:
        raise TypeError(f"{method}(callbacks=...): {message}")
    return listed


def check_single_samples(model: keras.Model, method: str, name: str, data: Any,
                         micro_batch_size: int | None) -> None:
    """Refuse a tf.data.Dataset of single samples (not batched) for a model with one input,
    where Keras' first step would fail on the rank of the input (before any collective)."""
    if not isinstance(data, tf.data.Dataset) or micro_batch_size is not None:
        return
    try:
        inputs = model.inputs  # a sub-classed model has none: its step will say
    except (AttributeError, ValueError):
        return
    if not inputs or len(inputs) != 1:
        return
    spec = data.element_spec
    if isinstance(spec, tuple) and spec:
        spec = spec[0]
    expected = tuple(inputs[0].shape)
    if (not isinstance(spec, tf.TensorSpec) or spec.shape.rank != len(expected) - 1
            or expected[-1] == 1  # Keras adds the last axis of size 1 itself
            or not tf.TensorShape(expected[1:]).is_compatible_with(spec.shape)):
        return
    raise DatasetError(
        f"{method}({name}=...): the tf.data.Dataset yields single samples (x of shape "
        f"{tuple(spec.shape)}; the model takes batches of shape {expected}): batch it with the "
        "global batch size (dataset.batch(global_batch_size)), or pass tnt_micro_batch_size= to "
        "let tarantella batch it"
    )


def check_fit(model: keras.Model, *, x: Any, y: Any, sample_weight: Any, validation_data: Any,
              callbacks: Any, batch_size: Any, epochs: Any, initial_epoch: Any,
              steps_per_epoch: Any, validation_steps: Any, validation_batch_size: Any,
              validation_freq: Any, tnt_micro_batch_size: Any = None,
              tnt_validation_micro_batch_size: Any = None) -> Any:
    """Every check of ``fit``'s arguments (both strategies); returns ``callbacks`` as a list."""
    check_compiled(model, "fit")
    listed = check_loop_arguments(
        "fit", callbacks, {"x": x, "y": y, "sample_weight": sample_weight,
                           "validation_data": validation_data},
        batch_size=batch_size, epochs=epochs, initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
        validation_batch_size=validation_batch_size, validation_freq=validation_freq,
        tnt_micro_batch_size=tnt_micro_batch_size,
        tnt_validation_micro_batch_size=tnt_validation_micro_batch_size)
    check_single_samples(model, "fit", "x", x, tnt_micro_batch_size)
    check_single_samples(model, "fit", "validation_data", validation_data,
                         tnt_validation_micro_batch_size)
    return listed


def check_evaluate(model: keras.Model, *, x: Any, y: Any, sample_weight: Any, callbacks: Any,
                   batch_size: Any, steps: Any, tnt_micro_batch_size: Any = None) -> Any:
    """Every check of ``evaluate``'s arguments (both strategies); returns ``callbacks`` as a
    list."""
    check_compiled(model, "evaluate")
    listed = check_loop_arguments(
        "evaluate", callbacks, {"x": x, "y": y, "sample_weight": sample_weight},
        batch_size=batch_size, steps=steps, tnt_micro_batch_size=tnt_micro_batch_size)
    check_single_samples(model, "evaluate", "x", x, tnt_micro_batch_size)
    return listed


def check_predict(model: keras.Model, *, x: Any, callbacks: Any, batch_size: Any, steps: Any,
                  tnt_micro_batch_size: Any = None) -> Any:
    """Every check of ``predict``'s arguments (both strategies; no compile needed); returns
    ``callbacks`` as a list."""
    listed = check_loop_arguments("predict", callbacks, {"x": x}, batch_size=batch_size,
                                  steps=steps, tnt_micro_batch_size=tnt_micro_batch_size)
    check_single_samples(model, "predict", "x", x, tnt_micro_batch_size)
    return listed


def refuse_data_parallel_arguments(method: str, **given: Any) -> None:
    """Refuse the DATA-only ``tnt_*`` arguments for a pipelined model (given: those not at
    their default)."""
    names = sorted(name for name, value in given.items() if value not in (None, False))
    if names:
        raise TypeError(f"{method}({', '.join(names)}=...): these arguments split data across "
                        "ranks for ParallelStrategy.DATA; a pipelined model reads the whole "
                        "global batch on every rank")


# -- saving ------------------------------------------------------------------------------------

def check_save_path(method: str, filepath: Any, kwargs: dict[str, Any]) -> None:
    """Keras' own refusal of a file name it cannot save to, raised before the collective
    write (so every rank raises it, not only the writer); the cases Keras decides first or
    otherwise are left to Keras."""
    if not isinstance(filepath, (str, os.PathLike)):
        return
    path = str(filepath)
    if method == "save":
        if set(kwargs) - {"include_optimizer", "zipped"} or kwargs.get("zipped") is False \
                or path.startswith("hf://") or path.endswith((".keras", ".h5", ".hdf5")):
            return
        raise ValueError(  # Keras 3's message (keras.saving.save_model)
            "Invalid filepath extension for saving. Please add either a `.keras` extension for "
            "the native Keras format (recommended) or a `.h5` extension. Use "
            "`model.export(filepath)` if you want to export a SavedModel for use with "
            f"TFLite/TFServing/etc. Received: filepath={filepath}."
        )
    sharded = kwargs.get("max_shard_size") is not None
    if not path.endswith(("weights.h5", "weights.json") if sharded else ".weights.h5"):
        raise ValueError(  # Keras 3's messages (keras.saving.save_weights)
            "The filename must end in `.weights.json` when `max_shard_size` is specified. "
            f"Received: filepath={path}" if sharded
            else f"The filename must end in `.weights.h5`. Received: filepath={path}"
        )
