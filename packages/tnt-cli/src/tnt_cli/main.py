"""Console entry points: ``tnt`` (with sub-commands) and ``tarantella`` (= ``tnt run``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from tnt_core import TntError, list_backends

from . import __version__
from .errors import USAGE_EXIT_CODE
from .run import run_command
from .settings_listing import settings_command

__all__ = ["main", "tarantella_main"]


def _run(argv: Sequence[str]) -> int:
    return run_command(argv, prog="tnt run")


def _backends(argv: Sequence[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: tnt backends\n\nList the communication backends installed tnt plugins "
              "provide, best first (names for tnt run --backend).")
        return 0
    if argv:
        print(f"tnt backends: error: unexpected argument {argv[0]!r} (see 'tnt backends --help')",
              file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        specs = list_backends()
    except TntError as exc:
        print(f"tnt backends: error: {exc}", file=sys.stderr)
        return 1
    for spec in specs:
        print(f"{spec.name:<10} priority {spec.priority:<4} {spec.description}".rstrip())
    return 0


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "run": (_run, "start a distributed job: tnt run [options] -- SCRIPT [ARGS...]"),
    "backends": (_backends, "list the installed communication backends"),
    "settings": (settings_command, "list the TNT_* settings of tnt-core and the installed plugins"),
}

_HELP = """\
usage: tnt COMMAND [options]

Tarantella-NT: distributed data-parallel training of Keras models.

commands:
{commands}

options:
  -h, --help     show this help and exit
  --version      show the version and exit

'tnt run --help' explains the launcher; 'tarantella [options] -- SCRIPT' is 'tnt run'.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``tnt``: dispatch to a sub-command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        text = _HELP.format(commands="\n".join(f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()))
        print(text, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else USAGE_EXIT_CODE
    if args[0] == "--version":
        print(f"tnt (tnt-cli) {__version__}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"tnt: error: unknown command {args[0]!r}; commands: {', '.join(COMMANDS)} "
              "(see 'tnt --help')", file=sys.stderr)
        return USAGE_EXIT_CODE
    return command[0](args[1:])


def tarantella_main(argv: Sequence[str] | None = None) -> int:
    """``tarantella``: Tarantella's original name for ``tnt run``."""
    return run_command(list(sys.argv[1:] if argv is None else argv), prog="tarantella")
