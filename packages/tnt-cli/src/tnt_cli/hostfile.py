"""The hosts of a job, as the user names them: a hostfile, or ``-H host1:2,host2:2``.

Hostfile: one host name per line, ``host slots=K`` accepted (horovodrun's and mpirun's
form); blank lines and ``#`` comments are ignored. ``-H`` (horovodrun's spelling): the same
hosts comma-separated, ``HOST:K`` for slots. Names must be unique (Tarantella's rule): a
repeated name is almost always a copy-paste mistake that would silently double the ranks
of one node.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import UsageError

__all__ = ["Host", "parse_hostfile", "parse_host_list", "read_hostfile"]

_HOST_RE = re.compile(r"^[A-Za-z0-9_.:@\[\]-]+$")


@dataclass(frozen=True)
class Host:
    """One node of the job. ``slots`` is None when the hostfile does not say."""

    name: str
    slots: int | None = None


def _host(name: str, slots: str | None, where: str) -> Host:
    """A checked :class:`Host`; ``where`` starts each error message."""
    if not _HOST_RE.match(name):
        raise UsageError(f"{where}: {name!r} is not a host name")
    if slots is None:
        return Host(name)
    if not slots.isdigit() or int(slots) < 1:
        raise UsageError(f"{where}: slots={slots!r} must be a positive integer")
    return Host(name, int(slots))


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
        slots: str | None = None
        for attr in attrs:
            key, sep, value = attr.partition("=")
            if key != "slots" or not sep:
                raise UsageError(f"{where}: unknown entry {attr!r}; a line is 'HOST' or 'HOST slots=K'")
            slots = value
        host = _host(name, slots, where)
        if name in first_seen:
            raise UsageError(
                f"{where}: host {name!r} is listed twice (first on line {first_seen[name]}); "
                "hostfile names must be unique, use 'HOST slots=K' or --n-per-node for more ranks per host"
            )
        first_seen[name] = lineno
        hosts.append(host)
    if not hosts:
        raise UsageError(f"{source} lists no hosts")
    return hosts


def parse_host_list(text: str) -> list[Host]:
    """Parse ``-H`` (horovodrun's spelling): ``HOST[:K],HOST[:K],...``; an IPv6 address goes
    in brackets (``[fe80::1]:2``)."""
    hosts: list[Host] = []
    for item in (part.strip() for part in text.split(",")):
        where = f"-H {item!r}" if item else f"-H {text!r}"
        if not item:
            raise UsageError(f"{where}: empty entry; give HOST:K,HOST:K,... (':K' optional)")
        name, slots = item, None
        head, sep, tail = item.rpartition(":")
        if sep and (not head.count(":") or head.endswith("]")):
            name, slots = head, tail
        elif item.count(":") > 1 and not item.endswith("]"):
            raise UsageError(f"{where}: put an IPv6 address in brackets, e.g. [{item}]:2")
        host = _host(name, slots, where)
        if any(h.name == name for h in hosts):
            raise UsageError(f"{where}: host {name!r} is listed twice; name each host once, "
                             "with HOST:K for more ranks on it")
        hosts.append(host)
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
