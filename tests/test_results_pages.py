"""The measured tables of the results pages are the benchmarks' output, rendered.

``benchmarks/render_results.py`` writes the tables between the pages' ``BEGIN GENERATED`` /
``END GENERATED`` markers from the committed outputs in ``docs/_static/benchmarks/``: a
table edited by hand, or an output changed without rendering again, fails here.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "_static" / "benchmarks"


def _renderer():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "benchmarks" / "render_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pipelining_results_are_rendered_from_the_benchmark_outputs():
    render = _renderer()
    page = (ROOT / "docs" / "pipelining_results.md").read_text()
    names = re.findall(r"<!-- BEGIN GENERATED (\S+) -->", page)
    assert names, "docs/pipelining_results.md has no generated part"
    for name in names:
        assert (RESULTS / name).exists(), f"{name}: no such benchmark output in {RESULTS}"
        again = render.replace_generated(page, render.printed_tables((RESULTS / name).read_text()), name)
        assert again == page, f"the tables of {name} differ from its output: run benchmarks/render_results.py"


def test_performance_results_are_rendered_from_the_benchmark_outputs():
    render = _renderer()
    page = (ROOT / "docs" / "performance_results.md").read_text()
    parts = [render.scaling_tables(json.loads((RESULTS / "scaling.json").read_text()))]
    timelines = render.timeline_table(RESULTS)
    if timelines:
        parts.append(timelines)
    parts.append(render.sweep_table(json.loads((RESULTS / "fusion_sweep.json").read_text())))
    assert render.replace_generated(page, "\n\n".join(parts)) == page, \
        "docs/performance_results.md's tables differ from the outputs: run benchmarks/render_results.py"
