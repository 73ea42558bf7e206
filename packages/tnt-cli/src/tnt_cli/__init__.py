"""tnt-cli: the ``tnt run`` launcher of Tarantella-NT (also installed as ``tarantella``).

Kept import-light: the per-rank agent (``python -m tnt_cli.agent``) imports this package
and starts once per rank.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tnt-cli")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["__version__"]
