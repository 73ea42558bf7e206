"""The example third-party backend passes tnt-core's conformance suite after a plain
``pip install`` (not editable: exactly what a plugin author's user does)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tnt-comm-loopback"


@pytest.fixture
def installed_example(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", str(EXAMPLE)],
                   check=True, timeout=600, capture_output=True)
    try:
        yield
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "tnt-comm-loopback"],
                       check=True, timeout=120, capture_output=True)


def test_loopback_plugin_passes_conformance_after_pip_install(installed_example, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(EXAMPLE),
         "-o", "addopts=", str(EXAMPLE / "tests")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert re.search(r"\b\d+ passed", result.stdout) and "failed" not in result.stdout, result.stdout[-2000:]
