"""Allreduce benchmark driver: one backend's allreduce next to its own baseline.

    python benchmarks/allreduce.py --backend gloo --sizes 4KiB..256MiB --iters 50

imports ``allreduce_<backend>`` from this directory and calls its ``run(args)``, which
returns one dict per buffer size with the keys ``size_bytes``, ``ours_gbps``,
``baseline_gbps``, ``ratio`` (ours / baseline bandwidth), ``ours_median_us`` and
``baseline_median_us`` (a module may add more keys: they go to the JSON, and to the table
after the standard columns for those its ``EXTRA_COLUMNS`` names).
The table is printed and everything is written to ``benchmarks/results/``.

Bandwidth is algorithm bandwidth: buffer bytes / median time of one allreduce, in GB/s
(1e9 bytes per second).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REQUIRED_KEYS = ("size_bytes", "ours_gbps", "baseline_gbps", "ratio", "ours_median_us",
                 "baseline_median_us")
_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30,
          "KB": 1000, "MB": 1000**2, "GB": 1000**3}


def parse_size(text: str) -> int:
    """``4KiB`` -> 4096; ``1MB`` -> 1000000; plain numbers are bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 4096, 4KiB, 16MiB or 1GiB")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """``4KiB..256MiB`` (every power of two in between) or a comma list ``4KiB,1MiB``."""
    if ".." in text:
        lo_text, hi_text = text.split("..", 1)
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        if lo <= 0 or hi < lo:
            raise argparse.ArgumentTypeError(f"empty size range {text!r}")
        sizes = []
        size = lo
        while size <= hi:
            sizes.append(size)
            size *= 2
        return sizes
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def human(size: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} B"


def format_table(rows: list[dict], backend: str,
                 extra: list[tuple[str, str, str]] = ()) -> str:
    """The standard columns, then ``extra`` ones ``(key, header, format)`` (blank where a
    row lacks the key)."""
    header = (f"{'size':>9}  {backend + ' GB/s':>12}  {'baseline GB/s':>13}  {'ratio':>6}  "
              f"{backend + ' med µs':>14}  {'baseline med µs':>15}")
    lines = [header + "".join(f"  {title:>{len(title)}}" for _, title, _ in extra)]
    for row in rows:
        line = (
            f"{human(row['size_bytes']):>9}  {row['ours_gbps']:>12.3f}  "
            f"{row['baseline_gbps']:>13.3f}  {row['ratio']:>6.3f}  "
            f"{row['ours_median_us']:>14.1f}  {row['baseline_median_us']:>15.1f}"
        )
        for key, title, spec in extra:
            cell = format(row[key], spec) if key in row else ""
            line += f"  {cell:>{len(title)}}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True,
                        help="backend name; benchmarks/allreduce_<backend>.py implements it")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4KiB..256MiB"),
                        help="LO..HI (powers of two) or a comma list (default 4KiB..256MiB)")
    parser.add_argument("--iters", type=int, default=50,
                        help="timed allreduces per size and side (large sizes may use fewer)")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default benchmarks/results/allreduce_<backend>_<time>.json)")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    if args.nprocs < 2:
        parser.error("--nprocs must be >= 2")
    if not re.fullmatch(r"[A-Za-z0-9_]+", args.backend):
        parser.error(f"--backend {args.backend!r} is not a module-name suffix")
    sys.path.insert(0, str(HERE))
    try:
        module = importlib.import_module(f"allreduce_{args.backend}")
    except ModuleNotFoundError as exc:
        if exc.name != f"allreduce_{args.backend}":
            raise
        parser.error(f"no benchmark for backend {args.backend!r}: "
                     f"{HERE / f'allreduce_{args.backend}.py'} does not exist")
    started = time.time()
    rows = module.run(args)
    for row in rows:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise SystemExit(f"allreduce_{args.backend}.run returned a row without {missing}")
    print(format_table(rows, args.backend, getattr(module, "EXTRA_COLUMNS", [])))
    out = args.out or RESULTS / (
        f"allreduce_{args.backend}_{time.strftime('%Y%m%dT%H%M%S', time.gmtime(started))}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "backend": args.backend,
        "nprocs": args.nprocs,
        "iters": args.iters,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "host": platform.node(),
        "python": platform.python_version(),
        "bandwidth": "algorithm bandwidth: bytes / median seconds / 1e9",
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
