"""Every example under ``examples/`` runs distributed: ``tnt run -n 2`` with short settings.

The quick-start example (``examples/quickstart/lenet5.py``) is run, and compared with
serial training, by ``tests/test_wheels.py`` from the installed wheels; the plugin example
(``examples/tnt-comm-loopback``) by ``tests/test_example_plugin.py``. This file runs the
others, and checks that no example is left without a test.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from examples_site import with_examples_site

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.timeout(420)

#: examples whose test lives elsewhere: path -> the test that runs it
TESTED_ELSEWHERE = {
    "quickstart/lenet5.py": ROOT / "tests" / "test_wheels.py",
}
#: examples run by this file
TESTED_HERE = ("resnet/resnet.py", "transformer/transformer.py", "callbacks/callbacks.py",
               "pipelining/pipelined_mlp.py")


def tnt_command() -> str:
    found = shutil.which("tnt", path=str(Path(sys.executable).parent)) or shutil.which("tnt")
    if found is None:
        pytest.fail("the `tnt` command (package tnt-cli) is not installed in this environment")
    return found


def run_example(script: str, *args: str, tnt_args: tuple[str, ...] = (), cwd: Path = ROOT) -> str:
    """Run an example on 2 ranks; return its output (stdout and stderr)."""
    pytest.importorskip("tarantella")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    with_examples_site(env)
    proc = subprocess.run(
        [tnt_command(), "run", "-n", "2", "--timeout", "300", *tnt_args, "--",
         str(EXAMPLES / script), *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=400,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output[-6000:]}"
    return output


def test_every_example_has_a_test():
    scripts = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.glob("*/*.py"))
    untested = [s for s in scripts if s not in TESTED_HERE and s not in TESTED_ELSEWHERE]
    assert not untested, f"examples without a test: {untested}"
    for script, test in TESTED_ELSEWHERE.items():
        text = test.read_text() if test.exists() else ""
        assert all(part in text for part in script.split("/")), \
            f"{test.relative_to(ROOT)} no longer runs examples/{script}"


def test_resnet_with_learning_rate_scaling_and_warmup():
    out = run_example("resnet/resnet.py", "--epochs", "2", "--train-size", "256", "--verbose", "0")
    # global batch 64 = 2 x base batch 32: the learning rate is scaled 2x, reached after
    # one epoch (4 steps) of warm-up
    assert "2 rank(s), global batch 64 (32+ samples per rank); learning rate 0.05 -> 0.1 " \
           "over 4 warm-up steps, then cosine decay over 4 steps" in out, out[-3000:]
    assert re.search(r"test accuracy 0\.\d{4}, test loss \d", out), out[-3000:]


def test_transformer_with_per_rank_pipeline():
    out = run_example("transformer/transformer.py", "--epochs", "2", "--train-size", "512",
                      "--test-size", "256", "--verbose", "0")
    assert "2 rank(s), micro-batch 32, global batch 64; each rank reads its own shard" in out, out[-3000:]
    accuracy = re.search(r"test accuracy (0\.\d{4}|1\.0000)", out)
    assert accuracy, out[-3000:]


def test_callbacks_master_only_and_rank_local(tmp_path):
    out = run_example("callbacks/callbacks.py", "--epochs", "2", "--train-size", "400",
                      "--out-dir", str(tmp_path), tnt_args=("--output-on-all-devices",))
    # master-only callbacks: one summary line per epoch, from rank 0
    summaries = re.findall(r"^\[(\d)\] epoch (\d+): loss", out, re.MULTILINE)
    assert summaries and {rank for rank, _ in summaries} == {"0"}, out[-3000:]
    # the writing Keras callbacks wrote once, on the master
    assert (tmp_path / "checkpoint.keras").stat().st_size > 0
    with open(tmp_path / "training.csv") as f:
        rows = list(csv.DictReader(f))
    trained = {rank: int(n) for rank, n in re.findall(r"rank (\d): trained (\d+) epoch", out)}
    assert trained.keys() == {"0", "1"} and len(set(trained.values())) == 1, out[-3000:]
    assert len(rows) == trained["0"] == len(summaries)
    # rank-local callback: every rank wrote its own file, one row per epoch, the same steps,
    # with its own metrics (aggregate_logs=False): not the job's, which CSVLogger wrote
    local = {}
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.csv") as f:
            local[rank] = list(csv.DictReader(f))
        assert len(local[rank]) == len(rows)
    assert [r["steps"] for r in local[0]] == [r["steps"] for r in local[1]]
    job_loss = [round(float(r["loss"]), 4) for r in rows]
    assert [float(r["loss"]) for r in local[0]] != job_loss != [float(r["loss"]) for r in local[1]]


def test_pipelined_mlp_trains_as_serial_keras(tmp_path):
    out = run_example("pipelining/pipelined_mlp.py", "--epochs", "2", "--compare-serial",
                      "--save-weights", str(tmp_path / "mlp.weights.h5"))
    assert "pipelined (2 stages x 1 pipeline(s), 4 micro-batches): test accuracy 0." in out, out[-3000:]
    assert "rank 0: stage 0 holds 82432 of 182410 parameters" in out, out[-3000:]
    diff = re.search(r"largest relative weight difference, pipelined vs serial: (\S+)", out)
    assert diff and float(diff.group(1)) < 1e-10, out[-3000:]  # float64: round-off only
    assert (tmp_path / "mlp.weights.h5").stat().st_size > 0


def test_the_quickstart_without_scikit_learn_says_how_to_get_its_data(tmp_path):
    """The quick-start's default data set comes with scikit-learn, which tnt does not
    install: without it the example says what to do, in one line (no traceback)."""
    pytest.importorskip("tarantella")
    (tmp_path / "sklearn.py").write_text("raise ImportError('no scikit-learn (a test stand-in)')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore", PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, str(EXAMPLES / "quickstart" / "lenet5.py")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "pip install scikit-learn, or pass --mnist PATH" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
