"""The generated parts of the docs, and the docs' claims about options and variables.

* ``docs/_ext/tnt_docs.py`` renders the ``tnt run`` reference from tnt-cli's own parser and
  the benchmark tables from ``benchmarks/results``: checked here without a Sphinx build.
* Every ``tnt run``/``tarantella`` option used in a command of the docs exists in the parser,
  and every ``TNT_*`` variable the docs name is read somewhere in the packages' sources.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

tnt_docs = pytest.importorskip("tnt_docs")
options = pytest.importorskip("tnt_cli.options")

FENCE = re.compile(r"^ *```(\w+)[^\n]*\n(.*?)^ *```\s*$", re.MULTILINE | re.DOTALL)


def _option_strings() -> set[str]:
    parser = options.build_parser()
    return {s for action in parser._actions for s in action.option_strings}


def test_cli_reference_lists_every_option_of_the_parser():
    text = "\n".join(tnt_docs.cli_reference(options.build_parser()))
    for option in _option_strings():
        assert f"`{option}" in text, f"{option} missing from the generated reference"
    for title in ("Where ranks run", "What each rank gets", "Control"):
        assert f":::{{rubric}} {title}" in text
    assert "TNT\\_TIMEOUT\\_S; default 1800" in text  # help text, escaped for Markdown
    assert "(choices: `auto`, `local`, `ssh`, `mpirun`, `srun`; default: `auto`)" in text


def test_cli_page_uses_the_real_parser():
    assert "```{tnt-cli-reference} tnt_cli.options:build_parser" in (DOCS / "cli.md").read_text()


def _commands():
    for page in sorted(DOCS.glob("*.md")):
        for kind, block in ((m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())):
            if kind != "console":
                continue
            for line in block.splitlines():
                if line.startswith(("$ tnt run", "$ tarantella ")):
                    yield page.name, line[2:]


def test_every_option_used_in_the_docs_exists():
    known = _option_strings()
    checked = 0
    for page, command in _commands():
        words = shlex.split(command.split(" -- ")[0], comments=True)
        for word in words:
            if word.startswith("-") and len(word) > 1:
                assert word.split("=")[0] in known, f"{page}: `{command}` uses unknown option {word}"
                checked += 1
    assert checked > 20


def test_every_tnt_variable_named_in_the_docs_is_read_by_the_code():
    sources = "\n".join(p.read_text(errors="replace") for p in (ROOT / "packages").glob("*/src/**/*.py"))
    sources += "\n".join(p.read_text(errors="replace") for p in (ROOT / "packages").glob("*/csrc/*"))
    # the example plugin's own setting (docs/plugins.md shows how it declares it)
    sources += "\n".join(p.read_text() for p in (ROOT / "examples").glob("*/src/**/*.py"))
    named = set()
    for page in DOCS.glob("*.md"):
        named |= set(re.findall(r"\bTNT_[A-Z0-9_]*[A-Z0-9]", page.read_text()))
    missing = sorted(v for v in named if v not in sources)
    assert not missing, f"the docs name variables no package reads: {missing}"


def test_benchmark_results_without_files_say_how_to_make_them(tmp_path):
    lines = tnt_docs.benchmark_results(tmp_path / "results", DOCS)
    assert lines[0] == ":::{note}" and "No results in `benchmarks/results/`" in "\n".join(lines)


def test_benchmark_results_render_the_newest_files(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    row = {"size_bytes": 4096, "ours_gbps": 0.5, "baseline_gbps": 0.25, "ratio": 2.0,
           "ours_median_us": 8.25, "baseline_median_us": 16.5}
    old = {"nprocs": 2, "iters": 5, "rows": [dict(row, ratio=9.99)]}
    new = {"nprocs": 2, "iters": 7, "started_utc": "2026-01-02T03:04:05Z", "host": "h", "rows": [row]}
    (results / "allreduce_gloo_20260101T000000.json").write_text(json.dumps(old))
    (results / "allreduce_gloo_20260102T000000.json").write_text(json.dumps(new))
    scaling = [{"model": "mlp", "ranks": 2, "micro_batch": 64, "keras": {"samples_per_s": 1000.0},
                "tnt-gloo": {"samples_per_s": 1800.0, "efficiency": 0.9, "vs_mwms": 1.25}}]
    (results / "scaling.json").write_text(json.dumps(scaling))
    (results / "scaling.png").write_bytes(b"\x89PNG")
    docdir = tmp_path / "docs"
    text = "\n".join(tnt_docs.benchmark_results(results, docdir, repo=tmp_path))
    assert "| `mlp` | Keras, 1 process | 1,000 |" in text
    assert "|  | `tnt-gloo` | 1,800 | 0.90 | 1.25x |" in text
    assert "![throughput per model and run](../benchmarks/results/scaling.png)" in text
    assert "allreduce_gloo_20260102T000000.json" in text and "20260101" not in text
    assert "| 4 KiB | 8 | 16 | 0.500 | 0.250 | 2.00 |" in text and "9.99" not in text


def test_a_broken_result_file_fails_the_build(tmp_path):
    (tmp_path / "allreduce_mpi_20260101T000000.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"allreduce_mpi_20260101T000000\.json"):
        tnt_docs.benchmark_results(tmp_path, DOCS)
