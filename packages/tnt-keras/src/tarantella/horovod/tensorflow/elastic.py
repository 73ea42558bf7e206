"""``horovod.tensorflow.elastic``'s path: the names of :mod:`tarantella.horovod.elastic`."""

from __future__ import annotations

from ..elastic import *  # noqa: F403 (the same objects under Horovod's module path)
from ..elastic import __all__ as _names

__all__ = list(_names)
