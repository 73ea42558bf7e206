"""Keras-specific names of tarantella: ``tnt.keras.callbacks.Callback``,
``tnt.keras.layers.SplitLayer``."""

from . import callbacks, layers

__all__ = ["callbacks", "layers"]
