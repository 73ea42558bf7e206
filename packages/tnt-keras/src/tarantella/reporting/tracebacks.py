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
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, cast

import keras

from ..comm import native as native_ops
from .user_frames import is_library_file, library_dirs

__all__ = ["user_facing"]

F = TypeVar("F", bound=Callable[..., Any])


def _filtered(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the libraries' frames; the innermost frame when no other is left."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    dirs = library_dirs()
    kept: TracebackType | None = None
    for entry in reversed(entries):
        if not is_library_file(entry.tb_frame.f_code.co_filename, dirs):
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
