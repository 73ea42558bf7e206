"""The launcher's own error type: bad input that the user can fix."""

from __future__ import annotations

__all__ = ["UsageError", "USAGE_EXIT_CODE"]

#: Exit code for bad input, as argparse uses.
USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """Bad command-line input or an unusable environment; printed as one line, exit 2."""
