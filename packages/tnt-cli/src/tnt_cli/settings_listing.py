"""``tnt settings``: every ``TNT_*`` setting, tnt-core's and the installed plugins', with
its default, what a value may be and what it does; and the note ``tnt run --help`` ends
with, naming the installed plugins' prefixes.

The listing is a command of its own, as Open MPI's ``ompi_info`` lists MCA parameters
apart from ``mpirun --help``: there are some 40 variables, two or three lines each, which
would bury the options ``tnt run --help`` is about. Both read the declarations the
launcher checks values against (:func:`tnt_core.installed_settings`).
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence

from tnt_core import InstalledSettings, TntError, Variable, installed_settings

from .errors import USAGE_EXIT_CODE

__all__ = ["format_settings", "plugin_settings_note", "settings_command"]

_WIDTH = 100
_USAGE = """\
usage: tnt settings [GROUP ...]

List the TNT_* settings of tnt-core and of the installed plugins: name, what it does, its
default and what a value may be. GROUP picks groups ({groups}); by default every group but
'internal'. Pass a setting to the ranks with 'tnt run -x NAME=VALUE'; tnt run checks the
value against the same declaration before it starts a rank.
"""


def _plain(text: str) -> str:
    """Markdown code spans as plain text, for a terminal."""
    return text.replace("`", "")


def _variable(var: Variable) -> list[str]:
    indent = " " * 6
    facts = f"default: {_plain(var.default_text)}"
    if var.kind != "str":
        facts += f"; allowed: {var.allowed}"
    if var.option:
        facts += f"; tnt run {var.option}"
    return [f"  {var.name}",
            *textwrap.wrap(_plain(var.doc), _WIDTH, initial_indent=indent, subsequent_indent=indent),
            *textwrap.wrap(facts, _WIDTH, initial_indent=indent, subsequent_indent=indent)]


def format_settings(installed: InstalledSettings, groups: Sequence[str]) -> str:
    """The listing of ``groups`` (names of ``installed.groups``), group by group."""
    lines: list[str] = []
    for name in groups:
        group = installed.groups[name]
        whose = f"{group.prefix}* of {installed.owner(name)}" if group.prefix else "tnt-core"
        lines += [f"[{name}] {_plain(group.title)} -- {whose}"]
        for var in group.variables.values():
            lines += _variable(var)
        lines.append("")
    return "\n".join(lines)


def settings_command(argv: Sequence[str]) -> int:
    """``tnt settings [GROUP ...]``; returns the exit code."""
    try:
        installed = installed_settings()
    except TntError as exc:
        print(f"tnt settings: error: {exc}", file=sys.stderr)
        return 1
    if argv and argv[0] in ("-h", "--help"):
        print(_USAGE.format(groups=", ".join(installed.groups)), end="")
        return 0
    unknown = [name for name in argv if name not in installed.groups]
    if unknown:
        print(f"tnt settings: error: no setting group {unknown[0]!r}; groups: "
              f"{', '.join(installed.groups)} (see 'tnt settings --help')", file=sys.stderr)
        return USAGE_EXIT_CODE
    groups = list(argv) or [name for name in installed.groups if name != "internal"]
    print(format_settings(installed, groups), end="")
    return 0


def plugin_settings_note() -> str:
    """The paragraph ``tnt run --help`` ends with: where the settings are listed, and the
    prefixes of the installed plugins' settings."""
    try:
        groups = installed_settings().plugin_groups
        plugins = ", ".join(f"{g.name}: {g.prefix}*" for g in groups) or "none installed"
    except TntError as exc:  # --help works even with a broken plugin; the listing says why
        plugins = f"cannot be listed: {exc}"
    text = ("TNT_* variables: 'tnt settings' lists each with its default and allowed values, "
            f"tnt-core's and the installed plugins' ({plugins}). tnt run checks every value "
            "given (-x or exported) before it starts a rank.")
    return "\n" + textwrap.fill(text, 90) + "\n"
