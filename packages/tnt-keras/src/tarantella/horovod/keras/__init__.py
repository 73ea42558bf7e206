"""``horovod.tensorflow.keras``'s names: ``import tarantella.horovod.keras as hvd``.

The same objects as :mod:`tarantella.horovod`: on TensorFlow 2 and Keras 3 one optimizer
wrapper and one set of collectives serve both of Horovod's modules.
"""

from __future__ import annotations

import importlib

from .. import *  # noqa: F403 (the same objects as tarantella.horovod's)
from .. import __all__ as _names

# Horovod's keras.elastic (the states and the Keras callbacks), not the parent's elastic the
# star import bound: `from . import elastic` would return that attribute, not the submodule
elastic = importlib.import_module(f"{__name__}.elastic")

#: Horovod's Keras module has everything of its parent's but ``run``, the launcher
__all__ = [name for name in _names if name != "run"]
