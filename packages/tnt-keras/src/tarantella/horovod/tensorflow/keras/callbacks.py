"""``horovod.tensorflow.keras.callbacks``'s path: the callbacks of
:mod:`tarantella.horovod.callbacks`."""

from __future__ import annotations

from ...callbacks import *  # noqa: F403 (the same objects under Horovod's module path)
from ...callbacks import __all__ as _names

__all__ = list(_names)
