"""Which addresses belong to this machine, and which only this machine reaches.

Asked by the launcher (is a hostfile's host this machine?), by the rules of settings that
name an address (``TNT_GLOO_HOSTNAME`` must be one of this host's) and by the choice of
the address a backend listens on. One answer for all of them. Standard library only.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["can_bind", "is_loopback"]

#: names that mean this machine's loopback interface (Debian's /etc/hosts has the ip6- ones)
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def is_loopback(address: str) -> bool:
    """True for an address or name only this machine reaches: ``127.0.0.0/8``, ``::1``
    (also IPv4-mapped, in brackets or with a zone) and ``localhost``."""
    text = address.strip().strip("[]").lower()
    if text in LOOPBACK_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def can_bind(address: str) -> bool:
    """True when a socket can bind to ``address`` (an IP address as ``getaddrinfo`` gives
    it): the address is assigned to this machine. Needs no privileges and no listing of
    interfaces; binds to port 0, so nothing stays taken."""
    if not address.strip("[] "):
        return False  # binding "" would take every address: it proves nothing
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address.strip("[]"), 0))
    except (OSError, UnicodeError, ValueError):
        return False
    return True
