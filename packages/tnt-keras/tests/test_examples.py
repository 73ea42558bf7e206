"""The examples under ``examples/`` run under ``tnt run -n 2`` (the README's main job)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tnt_keras_helpers import QUIET

ROOT = Path(__file__).resolve().parents[3]
LENET5 = ROOT / "examples" / "quickstart" / "lenet5.py"
pytestmark = pytest.mark.timeout(600)


def tnt_command() -> str:
    """The ``tnt`` console script of this environment (tnt-cli)."""
    found = shutil.which("tnt", path=str(Path(sys.executable).parent)) or shutil.which("tnt")
    if found is None:
        pytest.fail("the `tnt` command (package tnt-cli) is not installed in this environment; "
                    "install it: pip install -e packages/tnt-cli")
    return found


def run_example(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(QUIET)
    proc = subprocess.run([tnt_command(), "run", "-n", "2", "--", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout


def test_lenet5_quickstart_matches_serial_training():
    out = run_example(str(LENET5), "--epochs", "1", "--compare-serial", "--verbose", "0")
    distributed = re.search(r"distributed \(2 ranks\): test accuracy ([0-9.]+)", out)
    serial = re.search(r"serial \(1 process\): +test accuracy ([0-9.]+)", out)
    diff = re.search(r"distributed vs serial: ([0-9.e+-]+)", out)
    assert distributed and serial and diff, out
    assert distributed.group(1) == serial.group(1), out
    assert float(diff.group(1)) <= 1e-5, out
    assert out.count("LeNet-5 on") == 1, "the master prints, the other rank is silent"


def test_lenet5_float32_default_run():
    out = run_example(str(LENET5), "--epochs", "1", "--train_size", "600", "--verbose", "1")
    assert re.search(r"distributed \(2 ranks\): test accuracy 0\.\d+", out), out
    assert "step" in out and "accuracy:" in out, "the master's progress bar is shown"
