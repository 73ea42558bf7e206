"""Errors raised at the user's call, with Keras' own traceback filtering.

:func:`user_facing` gives the public methods of ``tnt.Model`` (and the collectives a script
calls) Keras' own traceback filtering: an exception leaves them with the frames of
tarantella, tnt-core, Keras and TensorFlow dropped (the innermost one kept when nothing else
is left) and without its chained traceback, as Keras' ``fit`` raises it; the user sees their
own call and the line that refused. ``keras.config.disable_traceback_filtering()`` shows
everything. An error of the native gradient path, which TensorFlow re-raises as its own
``OpError``, is raised as the exception the native path recorded (:mod:`tarantella.comm.native`).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, cast

import keras

from .comm import native as native_ops

__all__ = ["user_facing"]

F = TypeVar("F", bound=Callable[..., Any])

#: the packages whose frames a user-facing error leaves out (those imported, by top-level name)
_LIBRARIES = ("tarantella", "tnt_core", "keras", "tensorflow", "numpy", "h5py", "optree")


def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name, module in list(sys.modules.items()):
        if "." in name or not (name in _LIBRARIES or name.startswith("tnt_comm")):
            continue
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _filtered(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the libraries' frames; the innermost frame when no other is left."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    dirs = _library_dirs()
    kept: TracebackType | None = None
    for entry in reversed(entries):
        if not os.path.abspath(entry.tb_frame.f_code.co_filename).startswith(dirs):
            kept = TracebackType(kept, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    if kept is None and len(entries) > 1:  # (one entry: the call itself failed, in wrapper)
        last = entries[-1]
        kept = TracebackType(None, last.tb_frame, last.tb_lasti, last.tb_lineno)
    return kept


def user_facing(fn: F) -> F:
    """Raise what ``fn`` raises as Keras' public methods do (see the module's doc)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if type(exc).__module__.startswith("tensorflow"):
                recorded = native_ops.original(exc)
                if recorded is not None:  # the native path's error, as the Python path raises it
                    raise recorded.with_traceback(None) from None
            if not keras.config.is_traceback_filtering_enabled():
                raise
            raise exc.with_traceback(_filtered(exc.__traceback__)) from None

    return cast(F, wrapper)
