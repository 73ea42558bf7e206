"""A benchmark's own ranks: ``tnt run`` starts the benchmark script again with
``--rank-main --out DIR``; each rank writes ``DIR/rank<r>.json``, read back here.

Why one helper: the point-to-point, replica-sum and schedule benchmarks all measure inside a
job of their own and print from the parent; the ranks get a clean environment (no ``TNT_*``
of an enclosing job) and quiet TensorFlow logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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
