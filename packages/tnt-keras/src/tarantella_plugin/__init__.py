"""The ``tnt`` plugin of tnt-keras: hook implementations for Keras objects.

Registered through the entry point ``[project.entry-points.tnt] keras = "tarantella_plugin"``.
Every tnt process loads its plugins (the ``tnt run`` launcher too), so this module stays
outside the ``tarantella`` package: importing it imports neither TensorFlow nor Keras and
does not run ``tarantella``'s start-up. The hooks only act on TensorFlow/Keras objects,
which exist only once the user's script has imported them, and then load the behaviour
from ``tarantella.datasets`` / ``tarantella.callbacks``.
"""

from __future__ import annotations

import sys
from typing import Any

from tnt_core import ShardContext, hookimpl

__all__ = ["tnt_runtime_stopping", "tnt_shard_data", "tnt_wrap_callback"]


@hookimpl
def tnt_shard_data(data: Any, context: ShardContext) -> Any | None:
    """This rank's part of a ``tf.data.Dataset`` batched with the global batch size.

    Stops at first non-None result (None for anything but a ``tf.data.Dataset``).
    """
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(data, tf.data.Dataset):
        return None
    from tarantella.datasets import shard_data

    return shard_data(data, context)


@hookimpl
def tnt_wrap_callback(callback: Any, context: dict[str, Any]) -> Any | None:
    """How a Keras callback runs distributed (master only, all ranks, ...).

    Stops at first non-None result (None for anything but a ``keras.callbacks.Callback``).
    """
    keras = sys.modules.get("keras")
    if keras is None or not isinstance(callback, keras.callbacks.Callback):
        return None
    from tarantella.callbacks import wrap_callback

    return wrap_callback(callback, context)


@hookimpl
def tnt_runtime_stopping(runtime: Any) -> None:
    """Write this rank's ``TNT_TIMELINE`` trace, if tarantella recorded one."""
    timeline = sys.modules.get("tarantella.timeline")
    if timeline is not None:
        timeline.close()
