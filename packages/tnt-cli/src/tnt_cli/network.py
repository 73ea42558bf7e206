"""Which hosts are this machine, and which address the other hosts reach us at."""

from __future__ import annotations

import functools
import socket

from tnt_core import address_towards, can_bind, is_loopback

from .errors import UsageError

__all__ = ["is_local_host", "route_source_address", "store_bind_address", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


def _strip_user(host: str) -> str:
    return host.rpartition("@")[2].strip("[]")


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(_strip_user(host), None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@functools.lru_cache(maxsize=256)
def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine: loopback, its name, or a name of an address
    assigned to it (:func:`tnt_core.can_bind`)."""
    name = _strip_user(host)
    if is_loopback(name) or name in {socket.gethostname(), socket.getfqdn()}:
        return True
    return any(can_bind(addr) for addr in _resolve(name))


def route_source_address(host: str) -> str:
    """The local address packets to ``host`` leave from (no packet is sent)."""
    found = address_towards(_strip_user(host))
    if found is not None:
        return found
    if not _resolve(host):
        raise UsageError(f"cannot resolve host {host!r}; check the hostfile (or /etc/hosts, DNS)")
    raise UsageError(f"no route to host {host!r}; pass --rendezvous-host ADDR")


def store_bind_address(hosts: list[str], override: str | None) -> str:
    """Where the rendezvous store listens: ``override``, loopback when every rank is on
    this machine, else the address that routes to the first remote host."""
    if override:
        return override
    remote = [h for h in hosts if not is_local_host(h)]
    if not remote:
        return LOOPBACK
    return route_source_address(remote[0])
