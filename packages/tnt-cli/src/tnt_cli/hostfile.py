"""Hostfile parsing: one host name per line, ``host slots=K`` accepted.

Blank lines and ``#`` comments are ignored. Names must be unique (Tarantella's rule): a
repeated name is almost always a copy-paste mistake that would silently double the ranks
of one node.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import UsageError

__all__ = ["Host", "parse_hostfile", "read_hostfile"]

_HOST_RE = re.compile(r"^[A-Za-z0-9_.:@\[\]-]+$")


@dataclass(frozen=True)
class Host:
    """One node of the job. ``slots`` is None when the hostfile does not say."""

    name: str
    slots: int | None = None


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse hostfile ``text``; ``source`` names the file in error messages."""
    hosts: list[Host] = []
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *attrs = line.split()
        where = f"{source}:{lineno}"
        if not _HOST_RE.match(name):
            raise UsageError(f"{where}: {name!r} is not a host name")
        slots: int | None = None
        for attr in attrs:
            key, sep, value = attr.partition("=")
            if key != "slots" or not sep:
                raise UsageError(f"{where}: unknown entry {attr!r}; a line is 'HOST' or 'HOST slots=K'")
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"{where}: slots={value!r} must be a positive integer")
            slots = int(value)
        if name in first_seen:
            raise UsageError(
                f"{where}: host {name!r} is listed twice (first on line {first_seen[name]}); "
                "hostfile names must be unique, use 'HOST slots=K' or --n-per-node for more ranks per host"
            )
        first_seen[name] = lineno
        hosts.append(Host(name, slots))
    if not hosts:
        raise UsageError(f"{source} lists no hosts")
    return hosts


def read_hostfile(path: str | os.PathLike[str]) -> list[Host]:
    """Read and parse the hostfile at ``path``; unreadable files are a :class:`UsageError`."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"cannot read hostfile {os.fspath(path)!r}: {reason}") from None
    return parse_hostfile(text, os.fspath(path))
