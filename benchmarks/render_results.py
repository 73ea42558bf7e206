"""Render the committed benchmark results as Markdown tables for the results pages.

Reads ``scaling.json`` (benchmarks/scaling.py) and ``fusion_sweep.json``
(benchmarks/fusion_sweep.py) from --results (default docs/_static/benchmarks) and replaces
the part of --page (docs/performance_results.md) between the ``<!-- BEGIN GENERATED -->`` /
``<!-- END GENERATED -->`` markers (the hand-written analysis around it stays). The memory
runs of benchmarks/pipeline.py (its printed output, kept as ``pipeline-memory-*.txt``) go
the same way into --pipeline-page (docs/pipelining_results.md), one marked part per file:
``<!-- BEGIN GENERATED pipeline-memory-m1.txt -->``. ``--print`` only prints the tables.

    python benchmarks/render_results.py
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "–" if x is None else format(x, spec)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def scaling_tables(results: list[dict]) -> str:
    backends = sorted({k[4:] for r in results for k in r
                       if k.startswith("tnt-") and not k.endswith(("-no-overlap", "-comm-free"))})
    ranks, micro = results[0]["ranks"], results[0]["micro_batch"]
    lines = [f"**Throughput and scaling efficiency**, {ranks} ranks, micro-batch {micro} per rank "
             "(samples/s of the whole job; efficiency = throughput / "
             f"({ranks} x plain Keras), against the plain Keras process free to use every CPU and, "
             "in brackets, held to one CPU)", "",
             "| model | params | plain Keras (1 process) | on 1 CPU | "
             + " | ".join(f"tnt {b}: samples/s | efficiency | ours/MWMS" for b in backends)
             + " | MWMS: samples/s | efficiency |",
             "|---|---:|---:|---:|" + "---:|---:|---:|" * len(backends) + "---:|---:|"]

    def eff(t: dict) -> str:
        text = _fmt(t.get("efficiency"), ".2f")
        return text + (f" ({t['efficiency_1cpu']:.2f})" if "efficiency_1cpu" in t else "")

    for r in results:
        cells = [r["model"], f"{r['keras']['params'] / 1e6:.2f} M", _fmt(r["keras"]["samples_per_s"]),
                 _fmt(r.get("keras_1cpu", {}).get("samples_per_s"))]
        for b in backends:
            t = r.get(f"tnt-{b}", {})
            cells += [_fmt(t.get("samples_per_s")), eff(t),
                      _fmt(t.get("vs_mwms"), ".2f") + ("x" if "vs_mwms" in t else "")]
        m = r.get("mwms", {})
        cells += [_fmt(m.get("samples_per_s")), eff(m)]
        lines.append("| " + " | ".join(cells) + " |")
    if any(f"tnt-{b}-no-overlap" in r for r in results for b in backends):
        lines += ["", "**Overlap on vs off** (`TNT_OVERLAP=false`: every allreduce after backprop)", "",
                  "| model | backend | overlap on | overlap off | on / off |", "|---|---|---:|---:|---:|"]
        for r in results:
            for b in backends:
                on, off = r.get(f"tnt-{b}"), r.get(f"tnt-{b}-no-overlap")
                if on and off:
                    ratio = on["samples_per_s"] / off["samples_per_s"]
                    lines.append(f"| {r['model']} | {b} | {on['samples_per_s']:.0f} | "
                                 f"{off['samples_per_s']:.0f} | {ratio:.2f}x |")
    if any(f"tnt-{b}-comm-free" in r for r in results for b in backends):
        lines += ["", "**Without communication** (diagnostic, `--comm-free`: every gradient allreduce a "
                  "no-op, so the ranks train apart; the throughput faster collectives could reach at best)",
                  "", "| model | backend | with communication | without | efficiency without |",
                  "|---|---|---:|---:|---:|"]
        for r in results:
            for b in backends:
                on, free = r.get(f"tnt-{b}"), r.get(f"tnt-{b}-comm-free")
                if on and free:
                    lines.append(f"| {r['model']} | {b} | {on['samples_per_s']:.0f} | "
                                 f"{free['samples_per_s']:.0f} | {eff(free)} |")
    return "\n".join(lines)


def sweep_table(sweep: dict) -> str:
    ts = sweep["thresholds_kb"]
    lines = ["**Fusion threshold sweep** (`TNT_FUSION_THRESHOLD_KB`; samples/s, in brackets relative "
             "to the best threshold of the row; best in bold)", "",
             "| model | backend | " + " | ".join(f"{t} KB" for t in ts) + " |",
             "|---|---|" + "---:|" * len(ts)]
    for row in sweep["rows"]:
        rel = row["relative_to_best"]
        cells = []
        for t in ts:
            text = f"{row['samples_per_s'][str(t)]:.0f} ({rel[str(t)]:.2f})"
            cells.append(f"**{text}**" if rel[str(t)] == 1.0 else text)
        lines.append(f"| {row['model']} | {row['backend']} | " + " | ".join(cells) + " |")
    # geometric mean of the relative throughput of each threshold over all rows
    lines += ["", "| threshold | " + " | ".join(f"{t} KB" for t in ts) + " |", "|---|" + "---:|" * len(ts),
              "| geometric mean of (throughput / best of its row) | " + " | ".join(
                  f"{_geomean([r['relative_to_best'][str(t)] for r in sweep['rows']]):.3f}"
                  for t in ts) + " |"]
    return "\n".join(lines)


def timeline_table(results_dir: Path) -> str | None:
    """From the rank-0 traces of the overlapping runs: how much allreduce ran during backprop."""
    rows = []
    for path in sorted(results_dir.glob("timeline-*-overlap1.json")):
        _, backend, model, _ = path.stem.split("-")
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        backprops = sorted((e for e in events if e["name"] == "backprop"), key=lambda e: e["ts"])
        optimizers = sorted((e for e in events if e["name"] == "optimizer apply"), key=lambda e: e["ts"])
        buckets = [e for e in events if e["name"].startswith("allreduce") and e["args"]["dtype"] != "float64"]
        steps = overlapped = 0
        inside = total = 0.0
        for bp, opt in zip(backprops, optimizers):
            end = bp["ts"] + bp["dur"]
            mine = [e for e in buckets if bp["ts"] <= e["ts"] <= opt["ts"]]
            if not mine:
                continue
            steps += 1
            overlapped += min(e["ts"] for e in mine) < end
            for e in mine:
                total += e["dur"]
                inside += max(0.0, min(end, e["ts"] + e["dur"]) - e["ts"])
        if steps:
            med = sorted(b["dur"] for b in backprops)[len(backprops) // 2] / 1e3
            rows.append(f"| {model} | {backend} | {med:.1f} | {overlapped}/{steps} "
                        f"| {100 * inside / total:.0f} % |")
    if not rows:
        return None
    return "\n".join(["**What the timelines show** (rank 0, overlap on; `TNT_TIMELINE` traces in "
                      "`docs/_static/benchmarks/timeline-*.json`, open them in https://ui.perfetto.dev)", "",
                      "| model | backend | backprop, median ms | steps with a gradient allreduce started "
                      "before backprop ended | share of gradient-allreduce time inside backprop |",
                      "|---|---|---:|---:|---:|", *rows])


def _value_cells(row: str) -> list[tuple[int, str]]:
    """(end column, text) of a printed table row's cells after its label; cells are two or
    more spaces apart, numbers right-aligned under their heading."""
    cells = [(m.end(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", row)]
    return cells[1:]


def printed_tables(text: str) -> str:
    """The tables of one printed run of benchmarks/pipeline.py as Markdown: each numbered
    part's title and notes, its rows under the printed headings, and its closing lines."""
    lines, parts, i = text.splitlines(), [], 0
    run = next((line.strip() for line in lines if line.startswith("pipeline benchmark,")), "")
    while i < len(lines):
        title = re.match(r"^\d\. (.*)$", lines[i])
        i += 1
        if not title:
            continue
        notes = []
        while i < len(lines) and lines[i].startswith("   ") and "  " not in lines[i].strip():
            notes.append(lines[i].strip())
            i += 1
        header, rows = lines[i], []
        i += 1
        while i < len(lines) and lines[i].strip() and not lines[i].startswith("   "):
            rows.append(lines[i])
            i += 1
        closing = []
        while i < len(lines) and lines[i].startswith("   "):
            closing.append(lines[i].strip())
            i += 1
        widest = max(rows, key=lambda r: len(_value_cells(r)))
        ends = [end for end, _ in _value_cells(widest)]
        first = min(r.index(_value_cells(r)[0][1], len(r.split("  ")[0])) for r in rows)
        # a heading wider than the numbers under it begins before them (past every label)
        labels = max(len(r.split("  ")[0]) for r in rows)
        first = min([first, *(m.start() for m in re.finditer(r"\S+(?: \S+)*", header[:first])
                              if m.start() >= labels)])
        starts = [first] + ends[:-1]
        headings = [header[a:b].strip() for a, b in zip(starts, [*ends[:-1], None])]
        table = ["| | " + " | ".join(headings) + " |", "|---|" + "---:|" * len(headings)]
        for row in rows:
            cells = dict(_value_cells(row))
            label = row[:starts[0]].strip()
            table.append(f"| {label} | " + " | ".join(cells.get(end, "") for end in ends) + " |")
        notes_part = ["\n".join(notes), ""] if notes else []
        parts.append("\n".join([f"**{title.group(1)}**", "", *notes_part, *table, "",
                                *(f"- {c}" for c in closing)]).strip())
    return "\n\n".join([f"*{run}*", *parts]) if parts else "(no tables in this output)"


def replace_generated(page: str, generated: str, name: str = "") -> str:
    begin, end = (f"<!-- BEGIN GENERATED {name} -->", f"<!-- END GENERATED {name} -->") if name \
        else (BEGIN, END)
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n\n{generated}\n\n{end}{tail}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=ROOT / "docs/_static/benchmarks")
    p.add_argument("--page", type=Path, default=ROOT / "docs/performance_results.md")
    p.add_argument("--pipeline-page", type=Path, default=ROOT / "docs/pipelining_results.md")
    p.add_argument("--print", action="store_true")
    args = p.parse_args()
    parts = []
    scaling = args.results / "scaling.json"
    if scaling.exists():
        parts.append(scaling_tables(json.loads(scaling.read_text())))
    timelines = timeline_table(args.results)
    if timelines:
        parts.append(timelines)
    sweep = args.results / "fusion_sweep.json"
    if sweep.exists():
        parts.append(sweep_table(json.loads(sweep.read_text())))
    generated = "\n\n".join(parts) or "(no results yet)"
    pipeline_page = args.pipeline_page.read_text() if args.pipeline_page.exists() else ""
    printed = {name: printed_tables((args.results / name).read_text())
               for name in re.findall(r"<!-- BEGIN GENERATED (\S+) -->", pipeline_page)
               if (args.results / name).exists()}
    if args.print:
        print(generated)
        for name, tables in printed.items():
            print(f"\n{name}:\n{tables}")
        return 0
    args.page.write_text(replace_generated(args.page.read_text(), generated))
    print(f"updated {args.page}")
    for name, tables in printed.items():
        pipeline_page = replace_generated(pipeline_page, tables, name)
    if printed:
        args.pipeline_page.write_text(pipeline_page)
        print(f"updated {args.pipeline_page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
