"""A benchmark's own ranks: ``tnt run`` starts the benchmark script again with
``--rank-main --out DIR``; each rank writes ``DIR/rank<r>.json``, read back here.

Why one helper: the point-to-point, replica-sum and schedule benchmarks all measure inside a
job of their own and print from the parent; the ranks get a clean environment (no ``TNT_*``
of an enclosing job) and quiet TensorFlow logs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def rank_reports(script: str, ranks: int, args: Sequence[str], *, options: Sequence[str] = (),
                 timeout: float) -> list[Any]:
    """Run ``script --rank-main --out DIR *args`` on ``ranks`` ranks (``tnt run -n ranks
    *options``) and return each rank's JSON report, in rank order."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    tnt = Path(sys.executable).with_name("tnt")
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([str(tnt), "run", "-n", str(ranks), *options, "--", script, "--rank-main",
                        "--out", out, *args], env=env, check=True, timeout=timeout)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]


#: where benchmarks keep their runs' rows (JSON), beside the scripts
RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, started: float, fields: dict[str, Any], out: Path | None = None) -> Path:
    """A run's rows as JSON, with when and where it ran: ``out``, else
    ``results/<name>_<UTC start>.json``."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(started))
    path = out or RESULTS / f"{name}_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "host": platform.node(), "cpus": os.cpu_count(), **fields}, indent=1) + "\n")
    print(f"wrote {path}")
    return path
