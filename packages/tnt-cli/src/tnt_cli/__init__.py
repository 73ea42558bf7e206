"""tnt-cli: the ``tnt run`` launcher of Tarantella-NT (also installed as ``tarantella``).

Kept import-light: the per-rank agent (``python -m tnt_cli.agent``) imports this package
and starts once per rank, and the console scripts (:mod:`tnt_cli._entry`) must install
their Ctrl+C handler before anything slow is imported. So ``__version__`` is looked up
only when asked for.
"""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    if name != "__version__":
        raise AttributeError(f"module 'tnt_cli' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tnt-cli")
    except PackageNotFoundError:  # running from a source tree
        return "0+unknown"
