"""Every exception tnt-core raises, in one module.

Backends translate their native failures into :class:`CommError` in one place so
that users and tnt-keras handle a single exception type for "the collective failed".
``tnt_core/__init__.py`` gives each its public module, so a traceback's last line reads
``tnt_core.CommError: ...``.
"""

from __future__ import annotations

__all__ = ["TntError", "CommError", "CollectiveMismatchError", "ConfigError", "HandshakeError",
           "PluginError", "ShardingError", "UnsupportedOperationError"]


class TntError(Exception):
    """Base class of all Tarantella-NT errors."""


class CommError(TntError):
    """A collective failed: a peer died, the wait timed out, or the transport broke.

    The message names the rank that raised it and the operation; ``rank``,
    ``operation`` and ``peer`` (when known) are kept as attributes for programs.
    """

    def __init__(self, message: str, *, rank: int | None = None,
                 operation: str | None = None, peer: int | None = None) -> None:
        parts = []
        if rank is not None:
            parts.append(f"rank {rank}")
        if operation:
            parts.append(operation)
        prefix = f"[{': '.join(parts)}] " if parts else ""
        super().__init__(prefix + message)
        self.rank = rank
        self.operation = operation
        self.peer = peer
        if not _first_comm_error:  # what the at-exit attribution reads (_peer_failure)
            _first_comm_error.append(self)


#: the first CommError made in this process: a collective failed here, even when a framework
#: (``tf.numpy_function``) re-raised it as an exception of its own that does not chain it
_first_comm_error: list[CommError] = []


def handled(exc: CommError | None = None) -> None:
    """A CommError the program dealt with (a store wait that timed out and is polled again, a
    failure an elastic job recovered from) explains no later exception: forget ``exc``, or
    every one recorded when None, so the next CommError is the one recorded."""
    if exc is None or (_first_comm_error and _first_comm_error[0] is exc):
        _first_comm_error.clear()


class CollectiveMismatchError(TntError, ValueError):
    """The ranks called different collectives, or the same one with buffers of different
    shape or dtype, a different reduction or root. Every rank raises it, before any data
    moves (``_agreement``); the message says what each rank passed.
    """

    def __init__(self, message: str, *, rank: int | None = None, seq: int | None = None) -> None:
        super().__init__(f"[rank {rank}] {message}" if rank is not None else message)
        self.rank = rank
        self.seq = seq


class ConfigError(TntError, ValueError):
    """The launcher environment or an argument is invalid; the message says what to change."""


class HandshakeError(TntError, ConnectionError):
    """A peer of a job's TCP service did not prove it knows the job key, or the service
    refused this process (``_handshake``); the message says which and why.

    ``refused`` is True when the server refused an answer (a wrong key, another protocol,
    an identity not admitted), False when a side went silent or away, or is not the
    service expected. A ``ConnectionError`` too: its connection is of no further use.
    """

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class PluginError(TntError):
    """A plugin could not be loaded, declares its settings wrongly (a name outside its
    prefix, a prefix another plugin has), or the requested backend is unknown or
    unavailable."""


class ShardingError(TntError, ValueError):
    """A batch cannot be split over the ranks as asked (e.g. fewer samples than ranks)."""


class UnsupportedOperationError(TntError, NotImplementedError):
    """The backend lacks an optional capability (point-to-point, groups) that was used.

    Raised only when the operation is called: a backend without it keeps working for data
    parallelism. Check first with ``backend.supports("p2p")`` / ``backend.supports("groups")``.
    """
