"""tnt-comm-gloo: Tarantella-NT's Gloo communication backend.

Installing the distribution is all a user does: it registers the ``gloo`` backend through
the ``tnt`` entry-point group (:mod:`tnt_comm_gloo.plugin`), and ``tnt run -n N`` picks it.
The backend binds the Gloo C++ library (private module ``tnt_comm_gloo._gloo``); the
policy — addresses, algorithm choice, timeouts, errors — lives in
:mod:`tnt_comm_gloo.backend`.

Importing this package never loads the native module, so a broken build cannot stop
tnt-core from listing the other backends; the names below load it on first use.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import GlooBackend, GlooHandle, GlooSettings

try:
    __version__ = version("tnt-comm-gloo")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["GlooBackend", "GlooHandle", "GlooSettings", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("GlooBackend", "GlooHandle", "GlooSettings"):
        from . import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
