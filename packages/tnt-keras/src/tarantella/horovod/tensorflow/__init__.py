"""``horovod.tensorflow``'s path: ``import tarantella.horovod.tensorflow as hvd`` is
``import tarantella.horovod as hvd``, so that moving a Horovod script is one mechanical
rename of ``horovod`` to ``tarantella.horovod`` in its imports."""

from __future__ import annotations

from .. import *  # noqa: F403 (the same objects under Horovod's module path)
from .. import __all__ as _horovod_names

__all__ = [name for name in _horovod_names if name != "run"]  # horovod.run is Horovod's top level
