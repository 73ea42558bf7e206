"""Mistakes in the arguments of fit/evaluate/predict and tnt Callback: one line that names
the argument, raised by tarantella's entry point before anything runs (no collective, so
every rank decides alike); what plain Keras accepts and handles sanely works the same.

Plain Keras 3.15 for the same calls: ``batch_size=-4`` -> "Invalid value in tensor used
for shape: -4"; ``batch_size='32'`` -> "unsupported operand type(s) for /"; ``epochs='3'``
-> "'str' object cannot be interpreted as an integer"; ``callbacks=[42]`` -> "'int' object
has no attribute 'set_model'"; an array of strings -> "Invalid dtype: str32";
``validation_freq=0`` -> ZeroDivisionError; ``batch_size=0`` and ``steps_per_epoch=0``
silently mean "unset" (32 samples, a whole epoch): refused here, since 0 cannot mean what it
says. A single callback instead of a list and a tuple of callbacks are taken, as Keras does.
"""

from __future__ import annotations

import traceback

import keras
import numpy as np
import pytest

import tarantella as tnt

X, Y = np.ones((16, 4), "float32"), np.ones((16, 2), "float32")


def _compiled() -> tnt.Model:
    keras.utils.set_random_seed(3)
    model = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _strings() -> np.ndarray:
    return np.array([["a"] * 4] * 16)


CASES = [
    ("fit", {"batch_size": -4}, ValueError,
     "fit(batch_size=-4): batch_size must be a positive integer or None (the global batch size)"),
    ("fit", {"batch_size": 0}, ValueError, "fit(batch_size=0): batch_size must be a positive"),
    ("fit", {"batch_size": "32"}, TypeError,
     "fit(batch_size='32'): batch_size must be a positive integer or None (the global batch "
     "size), not str"),
    ("fit", {"batch_size": 8.0}, TypeError, "fit(batch_size=8.0): batch_size must be"),
    ("fit", {"batch_size": True}, TypeError, "fit(batch_size=True): batch_size must be"),
    ("fit", {"epochs": "3"}, TypeError, "fit(epochs='3'): epochs must be an integer >= 0"),
    ("fit", {"epochs": -1}, ValueError, "fit(epochs=-1): epochs must be an integer >= 0"),
    ("fit", {"initial_epoch": -1}, ValueError, "fit(initial_epoch=-1): initial_epoch must be"),
    ("fit", {"steps_per_epoch": 0}, ValueError,
     "fit(steps_per_epoch=0): steps_per_epoch must be a positive integer or None (None: until "
     "the data is exhausted)"),
    ("fit", {"validation_data": (X, Y), "validation_freq": 0}, ValueError,
     "fit(validation_freq=0): validation_freq must be a positive integer"),
    ("fit", {"validation_data": (X, Y), "validation_batch_size": -1}, ValueError,
     "fit(validation_batch_size=-1)"),
    ("fit", {"tnt_micro_batch_size": 0}, ValueError,
     "fit(tnt_micro_batch_size=0): tnt_micro_batch_size must be a positive integer or None (the "
     "batch size of each rank)"),
    ("fit", {"tnt_validation_micro_batch_size": "4"}, TypeError,
     "fit(tnt_validation_micro_batch_size='4')"),
    ("fit", {"callbacks": [42]}, TypeError,
     "fit(callbacks=...): callbacks[0] is int 42, not a keras.callbacks.Callback; pass a list of "
     "callback instances"),
    ("fit", {"callbacks": [keras.callbacks.EarlyStopping]}, TypeError,
     "fit(callbacks=...): callbacks[0] is the class EarlyStopping, not a callback: pass an "
     "instance, EarlyStopping(...)"),
    ("fit", {"callbacks": "history"}, TypeError, "fit(callbacks=...): callbacks is str"),
    ("fit", {"x": "strings"}, TypeError,
     "fit(x=...): x holds a NumPy array of strings (dtype <U1), which a Keras model cannot take"),
    ("fit", {"validation_data": "strings"}, TypeError, "fit(validation_data=...): validation_data"),
    ("evaluate", {"batch_size": -4}, ValueError, "evaluate(batch_size=-4): batch_size must be"),
    ("evaluate", {"steps": 0}, ValueError, "evaluate(steps=0): steps must be a positive integer"),
    ("evaluate", {"callbacks": [42]}, TypeError, "evaluate(callbacks=...): callbacks[0] is int"),
    ("predict", {"batch_size": "4"}, TypeError, "predict(batch_size='4'): batch_size must be"),
    ("predict", {"x": "objects"}, TypeError,
     "predict(x=...): x holds a NumPy array of Python objects (dtype object)"),
]


def _call(method: str, kwargs: dict) -> None:
    model = _compiled()
    kwargs = dict(kwargs)
    x = {"strings": _strings(), "objects": _strings().astype(object), None: X}[kwargs.pop("x", None)]
    if isinstance(kwargs.get("validation_data"), str):
        kwargs["validation_data"] = (_strings(), Y)
    if method == "predict":
        model.predict(x, verbose=0, **kwargs)
    else:
        getattr(model, method)(x, Y, verbose=0, **kwargs)


@pytest.mark.parametrize(("method", "kwargs", "error", "message"), CASES,
                         ids=[f"{m}-{'-'.join(f'{k}={v!r:.12}' for k, v in kw.items())}"
                              for m, kw, _, _ in CASES])
def test_a_bad_argument_is_one_line_naming_it(method, kwargs, error, message):
    with pytest.raises(error) as info:
        _call(method, kwargs)
    line = str(info.value)
    assert line.startswith(message), line
    assert "\n" not in line and info.value.__cause__ is None and info.value.__context__ is None
    frames = traceback.extract_tb(info.tb)
    inside = [f for f in frames if "/tarantella/" in f.filename or "/keras/" in f.filename]
    assert len(inside) <= 2, [f"{f.filename}:{f.lineno}" for f in inside]  # the entry point's


def _weights_after_fit(**kwargs) -> list[np.ndarray]:
    model = _compiled()
    model.fit(X * np.arange(16)[:, None], Y, batch_size=4, epochs=2, verbose=0, **kwargs)
    return model.get_weights()


def test_what_keras_takes_works_the_same():
    """A single callback (not in a list), a tuple of callbacks, NumPy integers: as Keras."""
    reference = _weights_after_fit()
    stopped = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
    for extra in ({"callbacks": keras.callbacks.History()},
                  {"callbacks": (keras.callbacks.History(), keras.callbacks.TerminateOnNaN())},
                  {"initial_epoch": np.int64(0)}):
        got = _weights_after_fit(**extra)
        assert all(np.array_equal(a, b) for a, b in zip(got, reference)), extra
    model = _compiled()
    history = model.fit(X, Y, batch_size=np.int32(4), epochs=np.int64(5), verbose=0,
                        callbacks=stopped)
    assert len(history.history["loss"]) == 2, "a single EarlyStopping runs (and stops)"


def test_tnt_callback_flags_must_be_booleans():
    cb = keras.callbacks.History()
    with pytest.raises(TypeError) as info:
        tnt.keras.callbacks.Callback(cb, run_on_all_ranks="no")
    assert str(info.value) == ("tnt.keras.callbacks.Callback(run_on_all_ranks='no'): "
                               "run_on_all_ranks must be True or False, not str")
    with pytest.raises(TypeError, match=r"^tnt.keras.callbacks.Callback\(aggregate_logs=1\)"):
        tnt.keras.callbacks.Callback(cb, aggregate_logs=1)
    assert not tnt.keras.callbacks.Callback(cb, run_on_all_ranks=np.bool_(False)).run_on_all_ranks


# -- the common mistakes of bad_inputs.py's API table: Keras' own message where it is clear,
# -- a better one naming the culprit where it is not; either way at most two library frames
# -- (the entry point and the line that refused) and no chained traceback

_LIBRARY_DIRS = ("/tarantella/", "/tnt_core/", "/keras/", "/tensorflow/", "/numpy/", "/h5py/")


def _assert_user_facing(info: pytest.ExceptionInfo) -> None:
    exc = info.value
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__), \
        "a chained traceback"
    inside = [f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(info.tb)
              if any(d in f.filename for d in _LIBRARY_DIRS)]
    assert len(inside) <= 2, inside


def _model(**dense: object) -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, **dense)])


def _fit(model: keras.Model, *args: object, **kwargs: object) -> None:
    model.fit(*args, verbose=0, **kwargs)


def _sum_loss_and_regularizer() -> None:
    model = tnt.Model(_model(kernel_regularizer="l2"))
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    _fit(model, X, Y, batch_size=8)


def _unknown_loss() -> None:
    model = tnt.Model(_model())
    model.compile(optimizer="sgd", loss="msee")
    _fit(model, X, Y)


def _train_step_called_directly() -> None:
    import tensorflow as tf

    model = _compiled()
    _fit(model, X, Y, batch_size=8)
    model.train_step((tf.constant(X[:8]), tf.constant(Y[:8])))


def _unbatched_dataset() -> None:
    import tensorflow as tf

    _fit(_compiled(), tf.data.Dataset.from_tensor_slices((X, Y)))


def _tf1_optimizer() -> None:
    import tensorflow as tf

    tnt.Model(_model()).compile(optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                loss="mse")


MISTAKES = [
    ("pipelining a Sequential model without an input shape",
     lambda: tnt.Model(keras.Sequential([keras.layers.Dense(2)]), parallel_strategy="pipeline"),
     ValueError, "keras.Sequential model 'sequential"),
    ("unknown strategy", lambda: tnt.Model(_model(), parallel_strategy="model"),
     tnt.NotSupportedError, "tnt.Model(parallel_strategy='model'): not a parallel strategy; use"),
    ("unknown optimizer", lambda: tnt.Model(_model()).compile(optimizer="sgdd", loss="mse"),
     ValueError, "Could not interpret optimizer identifier: sgdd"),  # Keras' own
    ("TF1 optimizer", _tf1_optimizer, ValueError,
     "compile(optimizer=GradientDescentOptimizer(...)): a TensorFlow 1 optimizer "
     "(tf.compat.v1.train), which Keras 3 cannot use; pass a Keras optimizer"),
    ("unknown loss", _unknown_loss, ValueError, "Could not interpret loss identifier: msee"),
    ("sum loss and a regularizer", _sum_loss_and_regularizer, tnt.NotSupportedError,
     "a loss with reduction='sum' (or 'none') next to regularization losses"),
    ("x and y lengths", lambda: _fit(_compiled(), X, Y[:5]), ValueError,
     "fit(x=..., y=...): x and y have different numbers of samples (x: 16, y: 5); every array "
     "must have one entry per sample along its first dimension"),
    ("sample_weight length", lambda: _fit(_compiled(), X, Y, sample_weight=np.ones(3)),
     ValueError,
     "fit(x=..., y=..., sample_weight=...): x, y and sample_weight have different numbers of "
     "samples (x: 16, y: 16, sample_weight: 3)"),
    ("validation_data lengths", lambda: _fit(_compiled(), X, Y, validation_data=(X[:3], Y)),
     ValueError, "fit(validation_data=...): its x and y have different numbers of samples "
     "(x: 3, y: 16)"),
    ("evaluate lengths", lambda: _compiled().evaluate(X, Y[:4], verbose=0), ValueError,
     "evaluate(x=..., y=...): x and y have different numbers of samples (x: 16, y: 4)"),
    ("a file name as data", lambda: _fit(_compiled(), "data.csv", Y), TypeError,
     "fit(x=...): x is the str 'data.csv', not data: Keras does not read files; load it first"),
    ("wrong feature shape", lambda: _fit(_compiled(), np.ones((16, 3), "float32"), Y),
     ValueError, "Exception encountered when calling Sequential.call()."),  # Keras' own
    ("predict wrong shape", lambda: _compiled().predict(np.ones((4, 7), "float32"), verbose=0),
     ValueError, "Exception encountered when calling Sequential.call()."),  # Keras' own
    ("unbatched dataset", _unbatched_dataset, ValueError,
     "fit(x=...): the tf.data.Dataset yields single samples (x of shape (4,); the model takes "
     "batches of shape (None, 4)): batch it with the global batch size "
     "(dataset.batch(global_batch_size)), or pass tnt_micro_batch_size= to let tarantella "
     "batch it"),
    ("train_step called directly", _train_step_called_directly, tnt.DatasetError,
     "train_step() of a tnt.Model was given data that tarantella did not distribute (was it "
     "called directly?): call fit/evaluate/predict or train_on_batch/test_on_batch/"
     "predict_on_batch on the tnt.Model"),
    ("save into a missing directory", lambda: _compiled().save("/nonexistent/dir/m.keras"),
     FileNotFoundError, "[Errno 2] No such file or directory: '/nonexistent/dir/m.keras'"),
    ("save with a wrong suffix", lambda: _compiled().save("model.txt"), ValueError,
     "Invalid filepath extension for saving. Please add either a `.keras` extension"),  # Keras'
    ("save_weights with a wrong suffix", lambda: _compiled().save_weights("w.h5"), ValueError,
     "The filename must end in `.weights.h5`. Received: filepath=w.h5"),  # Keras' own
    ("load_weights of a missing file",
     lambda: _compiled().load_weights("/nonexistent/w.weights.h5"), FileNotFoundError,
     "[Errno 2] No such file or directory: '/nonexistent/w.weights.h5'"),
]


@pytest.mark.parametrize(("call", "error", "message"), [m[1:] for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_a_common_mistake_is_one_clear_error_at_the_users_call(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(message), str(info.value)
    assert "tarantella builds" not in str(info.value), "Keras' message, nothing appended"
    _assert_user_facing(info)


def test_the_messages_of_keras_are_keras_own(tmp_path):
    """Where plain Keras' message is clear, tnt.Model raises exactly it."""
    for call in (lambda m: m.save(str(tmp_path / "model.txt")),
                 lambda m: m.save_weights(str(tmp_path / "w.h5")),
                 lambda m: m.compile(optimizer="sgdd")):
        messages = []
        for model in (_model(), tnt.Model(_model())):
            model.compile(optimizer="sgd", loss="mse")
            with pytest.raises(ValueError) as info:
                call(model)
            messages.append(str(info.value))
        assert messages[0] == messages[1]


def test_full_tracebacks_when_keras_filtering_is_off():
    keras.config.disable_traceback_filtering()
    try:
        with pytest.raises(ValueError) as info:
            _compiled().predict(np.ones((4, 7), "float32"), verbose=0)
    finally:
        keras.config.enable_traceback_filtering()
    frames = traceback.extract_tb(info.tb)
    assert sum("/tarantella/" in f.filename for f in frames) >= 2, "tarantella's own frames"


def test_what_the_new_checks_must_not_refuse():
    """Batched rank-1 data for an input of shape (1,) (Keras adds the axis), an unbatched
    dataset with tnt_micro_batch_size, arrays of equal length: as before."""
    import tensorflow as tf

    model = tnt.Model(keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)]))
    model.compile(optimizer="sgd", loss="mse")
    _fit(model, tf.data.Dataset.from_tensor_slices((np.ones(8, "float32"), Y[:8])).batch(4),
         shuffle=False)
    _fit(_compiled(), tf.data.Dataset.from_tensor_slices((X, Y)), tnt_micro_batch_size=8,
         shuffle=False)
    _fit(_compiled(), X, Y, sample_weight=np.ones(16), validation_data=(X[:4], Y[:4]))
    assert tnt.Model(_model(), parallel_strategy="DATA").parallel_strategy is \
        tnt.ParallelStrategy.DATA
