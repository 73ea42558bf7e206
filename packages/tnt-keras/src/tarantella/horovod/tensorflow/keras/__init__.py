"""``horovod.tensorflow.keras``'s path: ``import tarantella.horovod.tensorflow.keras as hvd``
is ``import tarantella.horovod.keras as hvd`` (its callbacks also as
``tarantella.horovod.tensorflow.keras.callbacks``)."""

from __future__ import annotations

from ...keras import *  # noqa: F403 (the same objects under Horovod's module path)
from ...keras import __all__ as _names

__all__ = list(_names)
