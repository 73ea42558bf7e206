"""Fit latency and bandwidth (alpha-beta) to emulated-cluster allreduces; project ResNet-50 scaling.

    .venv/bin/python benchmarks/alpha_beta_projection.py        # as root: measures, fits, projects
    .venv/bin/python benchmarks/alpha_beta_projection.py benchmarks/results/cluster_allreduce_*.json

Input: the JSON files ``benchmarks/cluster_allreduce.py`` writes, for runs of several
``--size`` values with one rank per host (``--layouts 2x1,3x1``) and Gloo's ring
(``--column ring:gloo:TNT_GLOO_ALGORITHM=ring``); other layouts and columns are ignored.
Given none, it makes them first: those runs at 16 KiB, 256 KiB, 4 MiB and 64 MiB, 5 timed
allreduces each, at ``--rate-mbit`` (400), into ``benchmarks/results/``.

The fit. A ring allreduce of n bytes over P ranks takes 2(P-1) steps, each sending n/P bytes
over every link, so t = 2(P-1)·alpha + 2(P-1)/P·n·beta. alpha (the cost of one step: Gloo,
TCP and the kernel on this machine, and its load) comes from the smallest size's median
times, less their transfer at the nominal rate; beta (seconds per byte on the emulated
link) from the largest size's, less 2(P-1)·alpha. The nominal 8/R over beta is the
efficiency e with which the link is used (TCP headers, pacing). The table gives the model's
largest error over all the points.

The projection, of data-parallel ResNet-50 training (25.6 M float32 parameters, so n = 102.4
MB of gradients per step) on N nodes of G ranks each (one rank per GPU), links of
``--link-gbit`` (100) Gbit/s per node. It assumes:

* the fitted alpha unchanged (this machine's TCP software path; on InfiniBand verbs one step costs
  a few µs, so this overstates latency), and beta = 8 / (e · link rate), the emulated
  efficiency at the projected rate;
* flat: one ring over all N·G ranks placed node by node; every step crosses each node's
  link with n/(N·G) bytes, so t = 2(NG-1)·(alpha + n/(NG)·beta);
* hierarchical: within a node reduce-scatter and allgather at memory speed, hidden behind
  the exchange between the nodes (the pipeline the emulated runs show at 0.92-0.95 of the
  link's bound); between the nodes, the G slices' rings run at once and share the link:
  t = 2(N-1)·alpha + 2(N-1)/N·n·beta;
* on one node neither crosses a link: no communication time;
* compute per sample ``--sample-ms`` (see below), the forward pass a third of it and the
  backward pass two thirds; with overlap the allreduce runs beside the backward pass, a
  step taking t_fwd + max(t_bwd, t_comm); without, t_fwd + t_bwd + t_comm;
* a fixed micro-batch per rank (``--micro-batch``), as Tarantella's ResNet-50 runs scale the
  global batch with the ranks; speed-up = N·G·t_step(1 rank) / t_step(N nodes), 1 rank
  having no communication; input pipeline, optimizer update and stragglers ignored.

``--sample-ms`` defaults to 2.7 ms per sample: an assumption of the order of a V100 training
ResNet-50 in float32 with TensorFlow (about 370 images/s), not a measurement here; this
machine has no GPU. Writes the table (Markdown) and the fit (JSON) to
``docs/_static/benchmarks/``, and a plot beside them when matplotlib is installed
(``benchmarks/requirements.txt``); ``--replot`` draws saved projections into one figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE.parent / "docs" / "_static" / "benchmarks"
RESNET50_PARAMS = 25.6e6
#: the original Tarantella's published ResNet-50 speed-ups: (devices, devices per node, speed-up,
#: where); its manual gives these end points only
PUBLISHED = [(96, 6, 57.0, "HPC-DA, 16 nodes x 6 V100, 2 x 100 Gbit/s InfiniBand"),
             (256, None, 62.0, "SuperMUC-NG, 256 CPU processes, 100 Gbit/s OmniPath")]
NODES = (1, 2, 4, 8, 16, 32, 64, 96)


MEASURED_SIZES = (16 << 10, 256 << 10, 4 << 20, 64 << 20)


def measure(rate_mbit: float) -> list[Path]:
    """Run cluster_allreduce.py once per size (one rank per host, Gloo's ring)."""
    import subprocess
    import time

    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    paths = []
    for size in MEASURED_SIZES:
        out = HERE / "results" / f"alpha_beta_{stamp}_{size}.json"
        subprocess.run([sys.executable, str(HERE / "cluster_allreduce.py"), "--rate-mbit", f"{rate_mbit:g}",
                        "--layouts", "2x1,3x1", "--reps", "5", "--size", str(size),
                        "--column", "ring:gloo:TNT_GLOO_ALGORITHM=ring", "--out", str(out)], check=True)
        paths.append(out)
    return paths


def load_points(paths: list[Path], column: str | None) -> tuple[list[tuple[int, float, float]], float]:
    """(ranks P, bytes n, median seconds t) of every one-rank-per-host cell, and the link rate."""
    points, rates = [], set()
    for path in paths:
        data = json.loads(path.read_text())
        rates.add(float(data["rate_mbit"]))
        for row in data["rows"]:
            if row["per_host"] != 1:
                continue
            for label, cell in row["columns"].items():
                if "median_s" in cell and (column is None or label == column):
                    points.append((row["hosts"], float(data["size_bytes"]), cell["median_s"]))
    if len(rates) > 1:
        raise SystemExit(f"the runs differ in link rate ({sorted(rates)} Mbit/s): give runs of one rate")
    if len({(p, n) for p, n, _ in points}) < 2 or len({n for _, n, _ in points}) < 2:
        raise SystemExit("need runs of at least two sizes (cluster_allreduce.py --size) "
                         "to fit alpha and beta")
    return points, rates.pop()


def fit(points: list[tuple[int, float, float]], rate_mbit: float) -> tuple[float, float, float]:
    """alpha from the smallest size, beta from the largest, as latency and bandwidth are
    measured apart: a joint least-squares fit is thrown off by the small sizes, which the
    link's token bucket (tc tbf's burst) lets pass faster than its rate. Returns alpha,
    beta and the model's largest relative error over all points."""
    nominal = 8 / (rate_mbit * 1e6)
    small, large = min(n for _, n, _ in points), max(n for _, n, _ in points)
    alpha = float(np.median([(t - 2 * (p - 1) / p * n * nominal) / (2 * (p - 1))
                             for p, n, t in points if n == small]))
    beta = float(np.median([(t - 2 * (p - 1) * alpha) / (2 * (p - 1) / p * n)
                            for p, n, t in points if n == large]))
    worst = max(abs((2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta) / t - 1) for p, n, t in points)
    return alpha, beta, float(worst)


def project(alpha: float, beta: float, nodes: int, per_node: int, sample_s: float,
            micro_batch: int) -> dict[str, float]:
    n = RESNET50_PARAMS * 4
    ranks = nodes * per_node
    compute = sample_s * micro_batch
    fwd, bwd = compute / 3, 2 * compute / 3
    if nodes == 1:
        flat = hier = 0.0
    else:
        flat = 2 * (ranks - 1) * (alpha + n / ranks * beta)
        hier = 2 * (nodes - 1) * alpha + 2 * (nodes - 1) / nodes * n * beta
    row = {"nodes": nodes, "ranks": ranks, "flat_s": flat, "hier_s": hier}
    for name, comm in (("flat", flat), ("hier", hier)):
        row[f"{name}_overlap"] = ranks * compute / (fwd + max(bwd, comm))
        row[f"{name}_serial"] = ranks * compute / (compute + comm)
    return row


def format_table(rows: list[dict], fit_info: dict, args: argparse.Namespace) -> str:
    lines = [
        f"ResNet-50 ({RESNET50_PARAMS / 1e6:g} M parameters, {RESNET50_PARAMS * 4 / 1e6:.1f} MB of "
        f"gradients), {args.per_node} ranks per node, {args.link_gbit:g} Gbit/s per node, "
        f"{args.sample_ms:g} ms per sample, micro-batch {args.micro_batch} "
        f"(step compute {args.sample_ms * args.micro_batch:.0f} ms)",
        f"fit from {fit_info['points']} emulated allreduces at {fit_info['rate_mbit']:g} Mbit/s: "
        f"alpha = {fit_info['alpha_s'] * 1e6:.0f} µs per step, "
        f"beta = {fit_info['beta_s_per_byte'] * 1e9:.2f} "
        f"ns/B (link used at e = {fit_info['efficiency']:.3f}), "
        f"largest error {fit_info['worst'] * 100:.0f} %",
        f"projected with alpha = {fit_info['alpha_projected_s'] * 1e6:.0f} µs"
        + (" (the fit's)" if args.alpha_us is None else " (given: a what-if, not measured)")
        + f", beta = 8 / (e · {args.link_gbit:g} Gbit/s) = "
        f"{fit_info['beta_projected_s_per_byte'] * 1e12:.0f} ps/B",
        "",
        "| nodes | ranks | allreduce flat ms | allreduce hierarchical ms | speed-up flat (overlap / none) "
        "| speed-up hierarchical (overlap / none) | efficiency hierarchical, overlap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['ranks']} | {r['flat_s'] * 1e3:.1f} | {r['hier_s'] * 1e3:.1f} | "
            f"{r['flat_overlap']:.1f} / {r['flat_serial']:.1f} | {r['hier_overlap']:.1f} / "
            f"{r['hier_serial']:.1f} | {r['hier_overlap'] / r['ranks']:.2f} |")
    lines.append("")
    lines.append("Published by the original Tarantella (its manual, speed-up per epoch over one "
                 "device with TensorFlow 2.2):")
    for devices, _per_node, speedup, where in PUBLISHED:
        lines.append(f"- {speedup:g}x on {devices} devices ({where}): efficiency {speedup / devices:.2f}")
    return "\n".join(lines)


def plot(projections: list[tuple[str, list[dict]]], per_node: int, link_gbit: float,
         path: Path) -> bool:
    """Draw each projection's speed-ups (``(label, rows)``) in one figure, with the original
    Tarantella's published point for ``per_node`` ranks per node; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ranks = [r["ranks"] for r in projections[0][1]]
    ax.plot(ranks, ranks, ":", color="grey", label="linear")
    for (label, rows), color in zip(projections, ("tab:blue", "tab:orange", "tab:green")):
        ranks = [r["ranks"] for r in rows]
        ax.plot(ranks, [r["hier_overlap"] for r in rows], "o-", color=color,
                label=f"hierarchical, overlap ({label})")
        ax.plot(ranks, [r["flat_overlap"] for r in rows], "s--", color=color,
                label=f"flat, overlap ({label})")
        ax.plot(ranks, [r["hier_serial"] for r in rows], "^:", color=color,
                label=f"hierarchical, no overlap ({label})")
    for devices, devices_per_node, speedup, _ in PUBLISHED:
        if devices_per_node == per_node:
            ax.plot([devices], [speedup], "k*", markersize=14,
                    label=f"original Tarantella, published ({speedup:g}x)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ticks = [r["ranks"] for r in projections[0][1]]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("speed-up over one rank")
    ax.set_title(f"ResNet-50, {per_node} ranks per node, {link_gbit:g} Gbit/s: alpha-beta projection",
                 fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def replot(paths: list[Path], out: Path) -> int:
    """The figure of projections saved before (their JSON), without measuring anything."""
    saved = [json.loads(p.read_text()) for p in paths]
    if len({(d["per_node"], d["link_gbit"]) for d in saved}) != 1:
        sys.exit("--replot: the projections differ in ranks per node or link rate; plot them apart")
    projections = [(f"alpha = {d['fit']['alpha_projected_s'] * 1e6:.0f} µs", d["rows"]) for d in saved]
    if not plot(projections, saved[0]["per_node"], saved[0]["link_gbit"], out):
        sys.exit("--replot needs matplotlib: pip install -r benchmarks/requirements.txt")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="*",
                        help="cluster_allreduce.py JSON files (default: measure them first)")
    parser.add_argument("--rate-mbit", type=float, default=400.0,
                        help="the emulated links' rate when measuring (default 400)")
    parser.add_argument("--column", default=None, help="use this column's cells only (default all)")
    parser.add_argument("--link-gbit", type=float, default=100.0, help="per node (default 100)")
    parser.add_argument("--per-node", type=int, default=6, help="ranks per node (default 6, as HPC-DA)")
    parser.add_argument("--sample-ms", type=float, default=2.7,
                        help="compute per sample and rank, ms (default 2.7: assumed, see above)")
    parser.add_argument("--micro-batch", type=int, default=64, help="samples per rank and step (default 64)")
    parser.add_argument("--alpha-us", type=float, default=None,
                        help="project with this alpha instead of the fitted one (a what-if)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--replot", type=Path, nargs="+", metavar="PROJECTION_JSON",
                        help="draw projections written before (their .json) into one figure, "
                             "alpha_beta_projection.png in --out-dir, and measure nothing")
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot, args.out_dir / "alpha_beta_projection.png")
    points, rate_mbit = load_points(args.runs or measure(args.rate_mbit), args.column)
    alpha, beta, worst = fit(points, rate_mbit)
    efficiency = 8 / (rate_mbit * 1e6) / beta
    beta_projected = 8 / (efficiency * args.link_gbit * 1e9)
    fit_info = {"points": len(points), "rate_mbit": rate_mbit, "alpha_s": alpha,
                "beta_s_per_byte": beta, "efficiency": efficiency, "worst": worst,
                "beta_projected_s_per_byte": beta_projected}
    alpha_projected = alpha if args.alpha_us is None else args.alpha_us * 1e-6
    fit_info["alpha_projected_s"] = alpha_projected
    rows = [project(alpha_projected, beta_projected, n, args.per_node, args.sample_ms / 1e3,
                    args.micro_batch) for n in NODES]
    table = format_table(rows, fit_info, args)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / (f"alpha_beta_projection_{args.per_node}per_node"
                           + ("" if args.alpha_us is None else f"_alpha{args.alpha_us:g}us"))
    stem.with_suffix(".md").write_text(table + "\n")
    stem.with_suffix(".json").write_text(json.dumps({
        "fit": fit_info, "points": points, "link_gbit": args.link_gbit, "per_node": args.per_node,
        "sample_ms": args.sample_ms, "micro_batch": args.micro_batch, "rows": rows,
        "runs": [p.name for p in args.runs]}, indent=1) + "\n")
    label = f"alpha = {alpha_projected * 1e6:.0f} µs"
    plotted = plot([(label, rows)], args.per_node, args.link_gbit, stem.with_suffix(".png"))
    print(f"wrote {stem}.md, .json" + (", .png" if plotted else " (no matplotlib: no plot)"),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
