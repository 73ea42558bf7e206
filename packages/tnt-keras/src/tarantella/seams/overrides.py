"""Instance attributes that hold only while a step is traced.

tarantella changes how a few Keras objects behave inside its step (an optimizer's ``apply``
reduces gradients, a synchronized BatchNormalization computes global moments) by setting an
attribute on the *instance* for as long as Keras traces the step, then restoring it. The
traced graph keeps the behaviour; nothing stays on the objects, their classes or Keras.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["instance_attributes"]

_MISSING = object()


@contextlib.contextmanager
def instance_attributes(overrides: Sequence[tuple[object, str, Any]]) -> Iterator[None]:
    """Set ``obj.name = value`` for each ``(obj, name, value)``; put back what was there."""
    saved = []
    for obj, name, value in overrides:
        saved.append((obj, name, vars(obj).get(name, _MISSING)))
        object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, old)
