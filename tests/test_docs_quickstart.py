"""Every code block of the quick start (docs/quickstart.md) is executed.

The ``python`` blocks, in order, are the program ``lenet5.py``; each ``console`` block's
``$`` commands are run in the directory holding it (``python`` is this interpreter,
``tnt`` this environment's launcher). The ``text`` block after a command is the output the
page shows: the command's output must have the same lines, up to the numbers in them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from examples_site import with_examples_site

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
pytestmark = pytest.mark.timeout(600)


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(PAGE.read_text())]


def _shape(line: str) -> str:
    """A line with every number (and time unit) replaced, for comparing outputs that
    differ in values: ``22/22 - 4s - 201ms/step`` and ``22/22 - 1s - 1s/step`` agree."""
    line = re.sub(r"\d+(\.\d+)?(ms|us|s)\b", "T", line.strip())
    return re.sub(r"\d+(\.\d+)?", "#", line)


def _tnt() -> str:
    found = shutil.which("tnt", path=str(Path(sys.executable).parent)) or shutil.which("tnt")
    if found is None:
        pytest.fail("the `tnt` command (package tnt-cli) is not installed in this environment")
    return found


def _run(command: str, cwd: Path) -> str:
    argv = shlex.split(command)
    argv[0] = {"python": sys.executable, "tnt": _tnt()}.get(argv[0], argv[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    with_examples_site(env)  # the page's `pip install scikit-learn`, in this environment
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, \
        f"{command}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_the_page_has_the_expected_blocks():
    kinds = [kind for kind, _ in blocks()]
    assert kinds.count("python") >= 4 and kinds.count("console") >= 2, kinds
    assert set(kinds) <= {"python", "console", "text"}, f"a block of an unexpected kind: {kinds}"


def test_every_quickstart_block_runs(tmp_path):
    pytest.importorskip("tarantella")
    page = blocks()
    program = "\n\n".join(code for kind, code in page if kind == "python")
    (tmp_path / "lenet5.py").write_text(program)
    ran = 0
    for i, (kind, code) in enumerate(page):
        if kind != "console":
            continue
        commands = [line[2:] for line in code.splitlines() if line.startswith("$ ")]
        assert commands, f"console block {i} has no '$ ' command"
        for command in commands:
            out = _run(command, tmp_path)
            ran += 1
            accuracy = re.search(r"^(\d+) rank\(s\): test accuracy (\d\.\d+)$", out, re.MULTILINE)
            assert accuracy, f"{command}: no accuracy line\n{out[-3000:]}"
            ranks = 2 if " -n 2 " in f" {command} " else 1
            assert int(accuracy.group(1)) == ranks, out[-3000:]
            assert float(accuracy.group(2)) > 0.8, f"{command}: the model did not learn\n{out}"
            shown = page[i + 1][1] if i + 1 < len(page) and page[i + 1][0] == "text" else None
            if shown is not None:
                got = [_shape(line) for line in out.splitlines() if line.strip()]
                want = [_shape(line) for line in shown.splitlines() if line.strip()]
                assert got == want, f"{command}: the page shows\n{shown}\nbut the run printed\n{out}"
    assert ran >= 2
