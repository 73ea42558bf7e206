"""Keras-specific names of tarantella: ``tnt.keras.callbacks.Callback``."""

from . import callbacks

__all__ = ["callbacks"]
