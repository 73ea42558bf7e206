"""Errors raised by tnt-keras. All derive from :class:`tnt_core.TntError`.

How they reach the user (Keras' traceback filtering) is :mod:`tarantella.reporting.tracebacks`.
"""

from __future__ import annotations

from tnt_core import TntError

__all__ = ["TntKerasError", "NotSupportedError", "DatasetError", "PartitionError"]


class TntKerasError(TntError):
    """Base class of tnt-keras errors."""


class NotSupportedError(TntKerasError):
    """A Keras feature that distributed training cannot give serial results for.

    The message says what to do instead.
    """


class DatasetError(TntKerasError, ValueError):
    """Data that cannot be split into micro-batches (e.g. an unbatched dataset)."""


class PartitionError(TntKerasError, ValueError):
    """A model that cannot be cut into pipeline partitions, at its SplitLayers or
    automatically (the message names the layer or the reason)."""
