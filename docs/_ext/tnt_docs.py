"""Sphinx directives that generate parts of the Tarantella-NT docs from the code itself.

``{tnt-cli-reference} tnt_cli.options:build_parser`` (MyST)
    The options of an argparse parser, group by group, taken from the real parser: the
    page cannot drift from ``tnt run --help``.

``{tnt-env-table} GROUP [GROUP ...]`` (MyST)
    The ``TNT_*`` variables of those groups, taken from their declarations (name,
    default, meaning, the ``tnt run`` option that sets it): tnt-core's groups from
    its declarations (``tnt_core.VARIABLES``), a plugin's from what it declares through the
    ``tnt_register_settings`` hook; the group ``installed`` stands for every installed
    plugin's groups. A table cannot drift from what the code reads. ``:columns:`` picks and
    orders the columns (``variable default meaning`` by default); several groups get a
    rubric each.

``{tnt-optional-toctree}`` (MyST)
    A toctree listing only those of its entries that exist, so a page may point to a
    document another change adds (e.g. measured results) without breaking the build.

``{tnt-benchmark-results}`` (MyST)
    The benchmark results committed under ``benchmarks/results/`` (``scaling.json`` and
    ``scaling.png`` from ``benchmarks/scaling.py``, ``allreduce_<backend>_<time>.json``
    from ``benchmarks/allreduce.py``), rendered as tables; a note saying how to produce
    them when there are none. Numbers only ever come from those files.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.directives.other import TocTree
from sphinx.util.docutils import SphinxDirective

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def _code(text: str) -> str:
    """``text`` as a Markdown code span."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _escape(text: str) -> str:
    """Plain text safe inside Markdown (CommonMark escapes any ASCII punctuation)."""
    return "".join("\\" + ch if ch in "\\`*_[]<>|#" else ch for ch in text)


def _option_label(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ", ".join(_code(s) for s in action.option_strings)
    metavar = action.metavar
    if metavar is None:
        metavar = ("{" + ",".join(map(str, action.choices)) + "}" if action.choices is not None
                   else action.dest.upper())
    return ", ".join(_code(f"{s} {metavar}") for s in action.option_strings)


def _parse_markdown(directive: SphinxDirective, lines: list[str], source: str,
                    classes: list[str]) -> list[nodes.Node]:
    """Parse generated MyST Markdown (these directives are used from .md pages)."""
    container = nodes.container(classes=classes)
    directive.state.nested_parse(StringList(lines, source=source), directive.content_offset, container)
    return container.children


def cli_reference(parser: argparse.ArgumentParser) -> list[str]:
    """MyST Markdown describing every option of ``parser``, group by group."""
    lines = ["```text", parser.format_usage().strip(), "```", ""]
    if parser.description:
        lines += [_escape(" ".join(parser.description.split())), ""]
    for group in parser._action_groups:  # argparse keeps its groups only here
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and a.option_strings]
        if not actions:
            continue
        title = group.title or "options"
        lines += [f":::{{rubric}} {title[0].upper() + title[1:]}", ":::", ""]
        for action in actions:
            help_text = action.help or ""
            if "%(" in help_text:
                help_text = help_text % {"prog": parser.prog, "default": action.default}
            body = _escape(" ".join(help_text.split()))
            extra = []
            if action.choices is not None:
                extra.append("choices: " + ", ".join(_code(str(c)) for c in action.choices))
            default = action.default
            if default not in (None, False, [], argparse.SUPPRESS) and action.nargs != 0:
                extra.append(f"default: {_code(str(default))}")
            if extra:
                body += " (" + "; ".join(extra) + ")"
            lines += [_option_label(action), f": {body}", ""]
    if parser.epilog:
        lines += ["```text", *parser.epilog.rstrip().splitlines(), "```", ""]
    return lines


class CliReference(SphinxDirective):
    """Render an argparse parser's options from ``module:function`` returning the parser."""

    required_arguments = 1
    option_spec: ClassVar[dict[str, Callable[[str], Any]]] = {"prog": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        target = self.arguments[0]
        module_name, _, func_name = target.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), func_name)
            parser = factory(self.options["prog"]) if "prog" in self.options else factory()
        except Exception as exc:  # the docs build must say which parser broke
            raise self.error(f"tnt-cli-reference: cannot build the parser {target!r}: {exc}") from exc
        return _parse_markdown(self, cli_reference(parser), target, ["tnt-cli-reference"])


ENV_COLUMNS = {"variable": "variable", "default": "default", "meaning": "meaning",
               "option": "`tnt run` option"}


def _env_cell(var, column: str) -> str:
    if column == "variable":
        return f"`{var.name}`"
    if column == "default":
        return var.default_text
    if column == "option":
        return f"`{var.option}`" if var.option else ""
    return var.doc


#: the group argument of ``{tnt-env-table}`` that stands for every installed plugin's groups
INSTALLED = "installed"


def env_table(groups: list[str], columns: list[str] | None = None) -> list[str]:
    """MyST Markdown tables of the declared ``TNT_*`` variables of ``groups`` (``installed``:
    the groups of every installed plugin, by name).

    Raises ``ValueError`` for an unknown group or column.
    """
    from tnt_core import installed_settings

    declared = installed_settings()
    names = [g.name for g in declared.plugin_groups] if INSTALLED in groups else []
    groups = [n for g in groups for n in (names if g == INSTALLED else [g])]
    columns = columns or ["variable", "default", "meaning"]
    bad = [c for c in columns if c not in ENV_COLUMNS] + [g for g in groups if g not in declared.groups]
    if bad or not groups:
        raise ValueError(f"unknown group or column {bad}; groups: "
                         f"{', '.join([*declared.groups, INSTALLED])}; columns: {', '.join(ENV_COLUMNS)}")
    lines: list[str] = []
    for name in groups:
        group = declared.groups[name]
        if len(groups) > 1:
            title = group.title
            lines += [f":::{{rubric}} {title[0].upper() + title[1:]}", ":::", ""]
        rows = [[_env_cell(v, c) for c in columns] for v in group.variables.values()]
        lines += _table([ENV_COLUMNS[c] for c in columns], rows)
    return lines


class EnvTable(SphinxDirective):
    """Tables of the declared ``TNT_*`` variables: tnt-core's and the installed plugins'."""

    required_arguments = 1
    optional_arguments = 10
    option_spec: ClassVar[dict[str, Callable[[str], Any]]] = {"columns": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        from tnt_core import SettingGroup

        declarations = inspect.getfile(SettingGroup)  # tnt-core's settings module
        self.env.note_dependency(declarations)
        columns = self.options.get("columns", "").split() or None
        try:
            lines = env_table(list(self.arguments), columns)
        except ValueError as exc:
            raise self.error(f"tnt-env-table: {exc}") from exc
        return _parse_markdown(self, lines, declarations, ["tnt-env-table"])


def _fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def _size(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def result_files(results: Path) -> list[Path]:
    """``scaling.json`` and the newest ``allreduce_<backend>_<time>.json`` of each backend."""
    if not results.is_dir():
        return []
    files = [results / "scaling.json"] if (results / "scaling.json").exists() else []
    latest: dict[str, Path] = {}
    for path in sorted(results.glob("allreduce_*_*.json")):
        latest[path.name.split("_")[1]] = path  # names end in a UTC time stamp: last is newest
    return files + [latest[b] for b in sorted(latest)]


def benchmark_results(results: Path, docdir: Path, repo: Path = REPO) -> list[str]:
    """MyST Markdown tables of the result files in ``results``; a note when there are none.

    Raises ``ValueError`` (naming the file) for a file that cannot be read.
    """
    lines: list[str] = []
    for path in result_files(results):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        rel = path.relative_to(repo) if path.is_relative_to(repo) else path
        if path.name == "scaling.json":
            lines += _scaling(data, rel, path.with_suffix(".png"), docdir)
        else:
            lines += _allreduce(data, path.name.split("_")[1], rel)
    if not lines:
        lines = [":::{note}",
                 "No results in `benchmarks/results/` of this tree (no `scaling.json` or",
                 "`allreduce_*.json`; the directory is git-ignored, so results stay on the",
                 "machine that measured them). Produce them with the commands above; this",
                 "section then shows them.", ":::", ""]
    return lines


def _scaling(data: list[dict], rel: Path, png: Path, docdir: Path) -> list[str]:
    first = data[0]
    lines = [f":::{{rubric}} Training throughput (`{rel}`)", ":::", "",
             f"{first['ranks']} ranks, micro-batch {first['micro_batch']} per rank; "
             "efficiency = throughput of N ranks / (N x throughput of one plain Keras process).", ""]
    rows = []
    for row in data:
        rows.append([f"`{row['model']}`", "Keras, 1 process", _fmt(row["keras"]["samples_per_s"], 0), "", ""])
        for key, r in row.items():
            if not isinstance(r, dict) or key == "keras":
                continue
            rows.append(["", f"`{key}`", _fmt(r["samples_per_s"], 0),
                         _fmt(r["efficiency"]) if "efficiency" in r else "",
                         _fmt(r["vs_mwms"]) + "x" if "vs_mwms" in r else ""])
    lines += _table(["model", "run", "samples/s", "efficiency", "ours / MWMS"], rows)
    if png.exists():
        lines += [f"![throughput per model and run]({os.path.relpath(png, docdir)})", ""]
    return lines


def _allreduce(data: dict, backend: str, rel: Path) -> list[str]:
    lines = [f":::{{rubric}} Allreduce, {backend} backend (`{rel}`)", ":::", "",
             f"{data.get('nprocs', '?')} ranks, {data.get('iters', '?')} iterations per size, "
             f"started {data.get('started_utc', '?')} on host `{data.get('host', '?')}`. "
             "Bandwidth is algorithm bandwidth (bytes / median time). *ours* is "
             "`allreduce_async(buf).wait()` through the backend; *baseline* is the "
             "backend's library called directly.", ""]
    rows = [[_size(r["size_bytes"]), _fmt(r["ours_median_us"], 0), _fmt(r["baseline_median_us"], 0),
             _fmt(r["ours_gbps"], 3), _fmt(r["baseline_gbps"], 3), _fmt(r["ratio"])]
            for r in data.get("rows", [])]
    return lines + _table(["size", "ours median µs", "baseline median µs", "ours GB/s",
                           "baseline GB/s", "ours / baseline"], rows)


class BenchmarkResults(SphinxDirective):
    """Tables (and the plot) of the result files under ``benchmarks/results``."""

    def run(self) -> list[nodes.Node]:
        for path in result_files(RESULTS):
            self.env.note_dependency(str(path))
        docdir = Path(self.env.doc2path(self.env.docname)).parent
        try:
            lines = benchmark_results(RESULTS, docdir)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise self.error(f"tnt-benchmark-results: {exc!r}") from exc
        return _parse_markdown(self, lines, str(RESULTS), ["tnt-benchmark-results"])


class OptionalTocTree(TocTree):
    """``toctree`` of the entries that exist; nothing at all when none does."""

    def run(self) -> list[nodes.Node]:
        kept = [(line, self.content.info(i)) for i, line in enumerate(self.content)
                if line.strip() in self.env.found_docs]
        if not kept:
            return []
        content = StringList()
        for line, (source, offset) in kept:
            content.append(line, source, offset)
        self.content = content
        return super().run()


def setup(app):
    app.add_directive("tnt-cli-reference", CliReference)
    app.add_directive("tnt-benchmark-results", BenchmarkResults)
    app.add_directive("tnt-optional-toctree", OptionalTocTree)
    app.add_directive("tnt-env-table", EnvTable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
