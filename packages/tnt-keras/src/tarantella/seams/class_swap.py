"""The class swap both ``tnt.Model`` and ``tnt.DistributedOptimizer`` use: the user's object
becomes an instance of ``<its class>(mixin, its class)``.

Why a subclass that hides itself: the object keeps every attribute, method and reference
the user holds, gains tarantella's behaviour from the mixin, and still reports its own
class as ``__class__``, so Keras serializes it as the plain object (a saved model or
optimizer loads without tarantella).
"""

from __future__ import annotations

__all__ = ["disguised_subclass"]

_CLASSES: dict[tuple[type, type], type] = {}


def disguised_subclass(mixin: type, cls: type) -> type:
    """``<cls>(mixin, cls)``, made once per pair; it reports ``cls`` as its ``__class__``
    and keeps it as ``_tnt_base``."""
    sub = _CLASSES.get((mixin, cls))
    if sub is None:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "__class__": property(lambda self: cls, doc="The user's class (what Keras saves)."),
            "_tnt_base": cls,
        }
        sub = _CLASSES[(mixin, cls)] = type(cls.__name__, (mixin, cls), namespace)
    return sub
