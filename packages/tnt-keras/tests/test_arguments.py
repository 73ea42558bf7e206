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
