"""Keras' backend must be TensorFlow's: checked when tarantella is imported, and again when a
model is distributed (a script may change it in between only by reloading Keras).

Keras picks its backend when it is first imported (``KERAS_BACKEND``, else ``keras.json``)
and imports that backend's package at once: ``KERAS_BACKEND=jax`` without JAX installed
fails inside Keras' own import. The name is then read where Keras reads it
(``KERAS_BACKEND``, else ``keras.json``), so the user gets the one line that says what to
do either way.
"""

from __future__ import annotations

import json
import os

from .errors import NotSupportedError

__all__ = ["check_keras_backend", "other_backend_error"]


def other_backend_error(name: str) -> NotSupportedError:
    """The refusal of Keras backend ``name`` (not TensorFlow)."""
    return NotSupportedError(
        f"KERAS_BACKEND={name}: tarantella trains Keras models on the TensorFlow backend only; "
        "run with KERAS_BACKEND=tensorflow (the default)"
    )


def _configured_backend() -> str:
    """The backend Keras' configuration names, read as Keras reads it (``KERAS_BACKEND``,
    else ``keras.json`` in ``KERAS_HOME`` or ``~/.keras``): for when Keras failed to import."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return str(json.load(f).get("backend", "tensorflow"))
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def check_keras_backend() -> None:
    """Import Keras; raise :func:`other_backend_error` when its backend is not TensorFlow's
    (whether or not that backend's package could be imported)."""
    try:
        import keras
    except ImportError:
        name = _configured_backend()
        if name == "tensorflow":
            raise
        raise other_backend_error(name) from None
    name = keras.backend.backend()
    if name != "tensorflow":
        raise other_backend_error(name)
