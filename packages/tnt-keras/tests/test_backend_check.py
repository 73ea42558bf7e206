"""A Keras backend other than TensorFlow is refused with one clear message.

Keras fixes its backend at import (``KERAS_BACKEND``), and the other backends need JAX or
PyTorch, which the test environment does not install; the check reads
``keras.backend.backend()``, so the test answers that call as Keras would under
``KERAS_BACKEND=torch``.
"""

from __future__ import annotations

import keras
import pytest

import tarantella as tnt


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_other_keras_backends_are_refused_clearly(monkeypatch, name):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    monkeypatch.setattr(keras.backend, "backend", lambda: name)
    with pytest.raises(tnt.NotSupportedError, match=f"KERAS_BACKEND={name}") as info:
        tnt.Model(model)
    assert "KERAS_BACKEND=tensorflow" in str(info.value), "the message says what is supported"
    assert not isinstance(model, tnt.Model), "a refused model stays as it was"
