"""The example third-party backend after a plain ``pip install`` (not editable: exactly what
a plugin author's user does): it passes tnt-core's conformance suite, and the setting it
declares through ``tnt_register_settings`` (``TNT_LOOPBACK_PORT``) is listed with
tnt-core's, checked by ``tnt run`` before any rank starts, and used by the backend."""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tnt-comm-loopback"
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def installed_example():
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", str(EXAMPLE)],
                   check=True, timeout=600, capture_output=True)
    try:
        yield
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "tnt-comm-loopback"],
                       check=True, timeout=120, capture_output=True)


def _tnt(*args: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    tnt = shutil.which("tnt", path=str(Path(sys.executable).parent)) or shutil.which("tnt")
    assert tnt, "the `tnt` command (package tnt-cli) is not installed in this environment"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    return subprocess.run([tnt, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)


def test_loopback_plugin_passes_conformance_after_pip_install(installed_example, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(EXAMPLE),
         "-o", "addopts=", str(EXAMPLE / "tests")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert re.search(r"\b\d+ passed", result.stdout) and "failed" not in result.stdout, result.stdout[-2000:]


def test_its_setting_is_listed_with_tnt_cores(installed_example, tmp_path):
    """In ``tnt settings``, in ``tnt run --help`` (its prefix) and in the docs' table."""
    listing = _tnt("settings", "loopback", tmp_path=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines()[:4] == [
        "[loopback] the loopback example backend (tnt-comm-loopback) -- TNT_LOOPBACK_* of plugin "
        "'loopback' (tnt-comm-loopback)",
        "  TNT_LOOPBACK_PORT",
        "      TCP port rank 0 listens on for the other ranks (0: a free one)",
        "      default: 0; allowed: an integer between 0 and 65535"]
    help_text = _tnt("run", "--help", tmp_path=tmp_path)
    assert "loopback: TNT_LOOPBACK_*" in " ".join(help_text.stdout.split()), help_text.stdout
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import tnt_docs; "
            "print('\\n'.join(tnt_docs.env_table(['installed'])))")
    table = subprocess.run([sys.executable, "-c", code, str(ROOT / "docs" / "_ext")],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert ":::{rubric} The `loopback` example backend (tnt-comm-loopback)" in table
    assert ("| `TNT_LOOPBACK_PORT` | `0` | TCP port rank 0 listens on for the other ranks "
            "(0: a free one) |") in table


def _check_script(tmp_path: Path) -> Path:
    script = tmp_path / "check.py"
    script.write_text(
        "import numpy as np, pathlib, sys, tnt_core\n"
        "rt = tnt_core.init()\n"
        "pathlib.Path(sys.argv[1], f'ran.{rt.rank}').touch()\n"
        "buf = np.full(3, rt.rank + 1.0)\n"
        "rt.backend.allreduce(buf)\n"
        "if rt.rank == 0:\n"
        "    print('port', rt.backend.inner.root_address[1], 'sum', buf.tolist())\n"
        "tnt_core.shutdown()\n")
    return script


def test_a_bad_value_fails_in_one_line_before_any_rank_starts(installed_example, tmp_path):
    script = _check_script(tmp_path)
    res = _tnt("run", "-n", "2", "--backend", "loopback", "-x", "TNT_LOOPBACK_PORT=70000",
               "--", str(script), str(tmp_path), tmp_path=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.splitlines() == [
        "tnt run: error: TNT_LOOPBACK_PORT=70000 must be between 0 and 65535 "
        "(-x TNT_LOOPBACK_PORT=...)"], res.stderr
    assert not list(tmp_path.glob("ran.*"))  # no rank started


def test_the_backend_listens_on_the_port_it_is_given(installed_example, tmp_path):
    with socket.socket() as probe:  # a free port of this host
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    res = _tnt("run", "-n", "2", "--backend", "loopback", "-x", f"TNT_LOOPBACK_PORT={port}",
               "--", str(_check_script(tmp_path)), str(tmp_path), tmp_path=tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert f"port {port} sum [3.0, 3.0, 3.0]" in res.stdout, res.stdout
