"""The rank's Chrome-trace timeline (``TNT_TIMELINE=path.json``), shared by the steps.

One ``tnt_core.Timeline`` per process, made on first use when ``config.timeline`` is set
(else :func:`get` returns None and the steps add no timeline op at all: zero cost when off).
It is written when the runtime stops (the ``tnt_runtime_stopping`` hook of
``tarantella_plugin`` calls :func:`close`) or, failing that, at interpreter exit.

Lanes: ``backprop`` (from the loss being ready to the last gradient being pushed), one lane
per fusion bucket (``tnt_core.FusedAllreducer``: issue to completion of its allreduce),
``optimizer`` (from the reduced gradients being back to the end of the optimizer apply).
"""

from __future__ import annotations

import atexit
import threading

import tnt_core

from .reporting.log import logger

__all__ = ["close", "get"]

_lock = threading.Lock()
_timeline: tnt_core.Timeline | None = None


def get(runtime: tnt_core.Runtime) -> tnt_core.Timeline | None:
    """This process's timeline, or None when ``TNT_TIMELINE`` is not set."""
    global _timeline
    path = runtime.config.timeline
    if not path:
        return None
    with _lock:
        if _timeline is None:
            _timeline = tnt_core.Timeline(path, runtime.rank)
            atexit.register(close)
        return _timeline


def close() -> None:
    """Write the timeline file (idempotent; nothing when there is none)."""
    with _lock:
        timeline = _timeline
    if timeline is not None:
        try:
            timeline.close()
        except OSError as exc:  # never fail a finished training over its trace
            logger.warning("could not write the timeline %s: %s", timeline.path, exc)
