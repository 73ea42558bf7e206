"""The console scripts ``tnt`` and ``tarantella``: Ctrl+C ends them quietly, always.

The supervisor handles SIGINT while ranks run (first: end them; second: kill them). Before
it starts (while the imports run) and after it has ended every rank,
Python's default would print a ``KeyboardInterrupt`` traceback from wherever the program
was. This module, the first one the scripts import, replaces that default at once: the
process exits with 130, as a shell reports Ctrl+C, and nothing of the job is left then
(the supervisor has not started a rank yet, or has ended them all). Only the interpreter's
own start, before this module runs, is left to Python.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def _interrupted(signum: int, _frame: FrameType | None) -> None:
    try:
        sys.stderr.write("\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


signal.signal(signal.SIGINT, _interrupted)

# only now the slow part (tnt-core, numpy): a Ctrl+C while it loads already ends quietly
from .main import main as tnt_main  # noqa: E402
from .main import tarantella_main as main_of_tarantella  # noqa: E402


def _done(code: int) -> int:
    """Ignore Ctrl+C from here on: the job is over, and Python's finalisation would put the
    default action back (killed by SIGINT) for the moments it takes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def main() -> int:
    return _done(tnt_main())


def tarantella_main() -> int:
    return _done(main_of_tarantella())
