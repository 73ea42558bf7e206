"""tarantella's communication: every collective a step traces, and the host-side ones, go
through a :class:`~tarantella.comm.channel.Channel` (see its module)."""

from .channel import Channel, Link, world
from .order import count, previous, record, traced_collectives

__all__ = ["Channel", "Link", "count", "previous", "record", "traced_collectives", "world"]
