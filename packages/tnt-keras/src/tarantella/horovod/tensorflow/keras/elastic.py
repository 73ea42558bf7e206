"""``horovod.tensorflow.keras.elastic``'s path: the names of
:mod:`tarantella.horovod.keras.elastic`."""

from __future__ import annotations

from ...keras.elastic import *  # noqa: F403 (the same objects under Horovod's module path)
from ...keras.elastic import __all__ as _names

__all__ = list(_names)
