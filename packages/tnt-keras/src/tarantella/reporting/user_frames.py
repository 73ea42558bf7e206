"""The user's frame: where an error or a warning raised for a user's call should point.

The libraries' frames (tarantella, tnt-core, Keras, TensorFlow, ...) are skipped, so an
error's traceback (:mod:`tarantella.reporting.tracebacks`) and a warning's ``file:line`` name the
user's own line, as Keras' traceback filtering does for its errors. Warnings that Keras
raises while tarantella calls it for the user (Keras' data adapter's ``shuffle`` notice)
are caught and warned again at the user's line (:func:`warnings_at_user_line`).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

__all__ = ["is_library_file", "library_dirs", "user_stacklevel", "warn_at_user",
           "warnings_at_user_line"]

T = TypeVar("T")

#: the packages whose frames are not the user's (those imported, by top-level name)
_LIBRARIES = ("tarantella", "tnt_core", "keras", "tensorflow", "numpy", "h5py", "optree")


def library_dirs() -> tuple[str, ...]:
    """The folders of the libraries imported so far (each ending with a separator)."""
    dirs = []
    for name, module in list(sys.modules.items()):
        if "." in name or not (name in _LIBRARIES or name.startswith("tnt_comm")):
            continue
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def is_library_file(filename: str, dirs: tuple[str, ...]) -> bool:
    return os.path.abspath(filename).startswith(dirs)


def _internal(frame: FrameType) -> bool:
    """A frame ``warnings.warn`` does not count (the import machinery's)."""
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def user_stacklevel(skip: int = 1) -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called ``skip`` frames above this
    call (1: by this function's caller), name the first frame outside the libraries; 1 when
    there is none."""
    dirs = library_dirs()
    frame = sys._getframe(skip)  # noqa: SLF001 (the documented way to reach a caller's frame)
    level = 1
    while frame is not None:
        if not _internal(frame):
            if not is_library_file(frame.f_code.co_filename, dirs):
                return level
            level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return 1


def warn_at_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line."""
    warnings.warn(message, category, stacklevel=user_stacklevel(2) + 1)


def warnings_at_user_line(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; the warnings it raises are warned again at the user's line
    (and then shown or not as the user's warning filters say)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    level = user_stacklevel()  # counted from this frame, which calls warnings.warn
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=level)
    return result
