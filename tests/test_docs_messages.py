"""The error messages and outputs the docs quote are the ones the code really prints.

Each scenario runs the real thing (``tnt run`` with bad input, a rank with a broken
environment, a dead or hung peer, a Keras ``fit`` with unsuitable data) and checks that
the message it prints is quoted in a ``text`` block of the docs, up to numbers and paths
(ports, addresses, temporary directories differ from run to run).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^ *```(\w+)[^\n]*\n(.*?)^ *```\s*$", re.MULTILINE | re.DOTALL)
pytestmark = pytest.mark.timeout(300)


def _norm(line: str) -> str:
    line = re.sub(r"(?<![\w.])/[^\s)'`,]+", "PATH", line.strip())  # absolute paths
    return re.sub(r"\d+", "#", line)


def _quoted() -> set[str]:
    lines = set()
    for page in DOCS.glob("*.md"):
        for m in FENCE.finditer(page.read_text()):
            if m.group(1) in ("text", "console"):
                lines |= {_norm(line) for line in m.group(2).splitlines() if line.strip()}
    return lines


QUOTED = _quoted()


def assert_quoted(output: str, pattern: str) -> None:
    """The output line matching ``pattern`` appears in a docs text block (normalized)."""
    found = [line for line in output.splitlines() if re.search(pattern, line)]
    assert found, f"no line matching {pattern!r} in the output:\n{output[-3000:]}"
    assert _norm(found[-1]) in QUOTED, f"the docs do not quote the real message:\n{found[-1]}"


def _bin(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore", **extra)
    return env


def run(argv: list[str], cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def scripts(tmp_path):
    (tmp_path / "ok.py").write_text("print('ok')\n")
    (tmp_path / "train.py").write_text("print('not executable')\n")
    (tmp_path / "rank.py").write_text("import tnt_core\nprint(tnt_core.get_rank())\n")
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    return tmp_path


BAD_INPUT = [
    (["-n", "2"], r"missing script"),
    (["-n", "2", "-x", "FOO", "--", "ok.py"], r"is not NAME=VALUE"),
    (["-n", "2", "--", "missing.py"], r"script 'missing.py' not found"),
    (["-n", "2", "--python-interpreter", "", "--", "train.py"], r"program 'train.py' not found"),
    (["-n", "3", "--hostfile", "hosts", "--", "ok.py"], r"asks for more ranks"),
    (["-n", "2", "--backend", "nccl", "--", "ok.py"], r"unknown backend 'nccl'"),
]


@pytest.mark.parametrize("args,pattern", BAD_INPUT, ids=[p for _, p in BAD_INPUT])
def test_tnt_run_bad_input(scripts, args, pattern):
    proc = run([_bin("tnt"), "run", *args], scripts)
    assert proc.returncode == 2, proc.stderr
    assert_quoted(proc.stderr, pattern)


def test_tnt_run_backend_that_cannot_serve_the_job(scripts):
    if importlib.util.find_spec("tnt_comm_gloo") is None:
        pytest.skip("the message lists gloo as the backend that can")
    proc = run([_bin("tnt"), "run", "-n", "2", "--backend", "local", "--", "ok.py"], scripts)
    assert proc.returncode == 2
    assert_quoted(proc.stderr, r"cannot run a job of 2 rank")


RANK_ENV = [
    ({"TNT_BACKEND": "nccl"}, r"PluginError: unknown backend"),
    ({"TNT_SIZE": "2", "TNT_RANK": "0"}, r"was not started by a launcher"),
    ({"TNT_RANK": "1"}, r"TNT_RANK is set but TNT_SIZE is not"),
    ({"TNT_FUSION_THRESHOLD_KB": "abc"}, r"is not a number"),
]


@pytest.mark.parametrize("env,pattern", RANK_ENV, ids=[p for _, p in RANK_ENV])
def test_rank_environment_errors(scripts, env, pattern):
    # named as the FAQ names the user's script (a message may quote it)
    (scripts / "train.py").write_text((scripts / "rank.py").read_text())
    proc = run([sys.executable, "train.py"], scripts, **env)
    assert proc.returncode != 0
    assert_quoted(proc.stderr, pattern)


def test_named_backend_that_cannot_serve_a_single_process(scripts):
    if importlib.util.find_spec("tnt_comm_gloo") is None:
        pytest.skip("needs tnt-comm-gloo")
    proc = run([sys.executable, "rank.py"], scripts, TNT_BACKEND="gloo")
    assert_quoted(proc.stderr, r"is installed but cannot serve this job")


def test_mpi_backend_without_a_launcher(scripts):
    if importlib.util.find_spec("tnt_comm_mpi") is None:
        pytest.skip("needs tnt-comm-mpi")
    proc = run([sys.executable, "rank.py"], scripts, TNT_BACKEND="mpi", TNT_SIZE="2", TNT_RANK="0")
    assert_quoted(proc.stderr, r"the mpi backend needs its 2 ranks")


def test_rendezvous_errors(scripts):
    code = textwrap.dedent("""
        from tnt_core import CommError, StoreClient, StoreServer, micro_batch_sizes
        with StoreServer("127.0.0.1", 0, key="right") as server:
            try:
                StoreClient(*server.address, "wrong", rank=1)
            except CommError as exc:
                print(f"tnt_core.CommError: {exc}")
            port = server.address[1]
        try:
            StoreClient("127.0.0.1", port, "x", connect_timeout=1.0, rank=1)
        except CommError as exc:
            print(f"tnt_core.CommError: {exc}")
        try:
            micro_batch_sizes(1, 2)
        except Exception as exc:
            print(f"tnt_core.{type(exc).__name__}: {exc}")
    """)
    out = run([sys.executable, "-c", code], scripts).stdout
    assert_quoted(out, r"wrong job key")
    assert_quoted(out, r"cannot reach the rendezvous store")
    assert_quoted(out, r"global batch size 1 is smaller than the number of ranks 2")


def test_dead_and_hung_peers_with_gloo(scripts):
    if importlib.util.find_spec("tnt_comm_gloo") is None:
        pytest.skip("the quoted transport errors are Gloo's")
    (scripts / "dead.py").write_text(textwrap.dedent("""
        import os, time, numpy as np, tnt_core
        rt = tnt_core.init()
        rt.backend.barrier()
        if rt.rank == 1:
            os._exit(0)
        time.sleep(0.5)
        for _ in range(2):
            try:
                rt.backend.allreduce(np.ones(1 << 18, dtype=np.float32))
            except tnt_core.CommError as exc:
                print(f"tnt_core.CommError: {exc}", flush=True)
        raise SystemExit(1)
    """))
    (scripts / "hang.py").write_text(textwrap.dedent("""
        import time, numpy as np, tnt_core
        rt = tnt_core.init()
        if rt.rank == 1:
            time.sleep(30)
        rt.backend.allreduce(np.ones(4, dtype=np.float32))
    """))
    gloo = [_bin("tnt"), "run", "-n", "2", "--backend", "gloo"]
    # one host: the allreduce goes through shared memory; TNT_GLOO_SHM=0: Gloo's TCP
    jobs = {**{("dead", shm): [*gloo, "-x", f"TNT_GLOO_SHM={shm}", "--", "dead.py"]
               for shm in ("auto", "0")},
            **{("hang", shm): [*gloo, "--timeout", "5", "-x", f"TNT_GLOO_SHM={shm}", "--", "hang.py"]
               for shm in ("auto", "0")},
            ("hang", "no stall inspector"): [*gloo, "--timeout", "5", "-x", "TNT_STALL_WARN_S=0",
                                             "--", "hang.py"]}
    # independent jobs that mostly wait (for a dead or a sleeping peer): side by side
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        runs = {key: pool.submit(run, argv, scripts) for key, argv in jobs.items()}
        results = {key: job.result() for key, job in runs.items()}
    for shm, first in (("auto", r"rank 1 \(pid \d+\) exited during the shared-memory allreduce"),
                       ("0", r"transport error")):
        dead = results["dead", shm]
        assert dead.returncode == 1
        assert_quoted(dead.stdout, rf"^tnt_core.CommError: \[rank 0: allreduce #2\] {first}")
        assert_quoted(dead.stdout, r"an earlier collective failed")
        # rank 1 exited with 0: rank 0, which then raised SystemExit(1), is the failure
        assert dead.stderr.splitlines()[-1].startswith("tnt run: rank 0 on localhost failed: "
                                                       "exited with code 1")
        hung = results["hang", shm]
        assert hung.returncode == 1
        # whichever notices first: the backend's wait or the transport's (all quoted)
        # the launcher names the hung rank with the stall inspector's diagnosis
        assert hung.stderr.splitlines()[-1].startswith(
            "tnt run: rank 1 did not arrive at allreduce #1 within 5s (hung or too slow?); "
            "rank 0 on localhost failed waiting for it; last seen: rank 1 (before its first "
            "collective; alive, heartbeat "), hung.stderr
        assert_quoted(hung.stderr, r"^tnt run: rank 1 did not arrive")
        # (the docs quote each wording once, without the stall diagnosis that follows)
        assert_quoted(re.sub(r"; not arrived: .*$", "", hung.stderr, flags=re.MULTILINE),
                      r"^tnt_core.CommError: .*(Timed out waiting 5000ms|"
                      r"did not complete within 5s|did not arrive within 5s)")
    # without the stall inspector, the launcher names the rank still running
    hung = results["hang", "no stall inspector"]
    assert hung.returncode == 1
    assert_quoted(hung.stderr, r"^tnt run: rank 1 on localhost did not take part in a collective")


def test_a_failing_rank_ends_the_job(scripts):
    (scripts / "fail.py").write_text(textwrap.dedent("""
        import time, tnt_core
        if tnt_core.get_rank() == 1:
            raise SystemExit(3)
        time.sleep(30)
    """))
    proc = run([_bin("tnt"), "run", "-n", "2", "--", "fail.py"], scripts)
    assert proc.returncode == 3
    assert_quoted(proc.stderr, r"^tnt run: rank 1 on localhost failed: exited with code 3")
    if importlib.util.find_spec("tnt_comm_gloo") is None:
        return  # below: a real collective between two ranks
    # the peer's CommError usually ends its process first; the rank that raised is named
    (scripts / "boom.py").write_text(textwrap.dedent("""
        import numpy as np, tnt_core
        rt = tnt_core.init()
        for step in range(1000):
            if step == 3 and rt.rank == 1:
                raise ValueError("boom")
            rt.backend.allreduce(np.ones(4, dtype=np.float32))
    """))
    proc = run([_bin("tnt"), "run", "-n", "2", "--timeout", "20", "--", "boom.py"], scripts)
    assert proc.returncode == 1
    assert_quoted(proc.stderr, r"^tnt run: rank 1 on localhost failed: exited with code 1 "
                               r"\(ValueError: boom\)")


def test_collectives_the_ranks_disagree_on(scripts):
    (scripts / "mismatch.py").write_text(textwrap.dedent("""
        import numpy as np, tnt_core
        backend = tnt_core.init().backend
        backend.allreduce(np.ones(4 if tnt_core.get_rank() == 0 else 3, np.float32))
    """))
    proc = run([_bin("tnt"), "run", "-n", "2", "--", "mismatch.py"], scripts)
    assert proc.returncode == 1
    assert_quoted(proc.stderr, r"^tnt_core.CollectiveMismatchError: \[rank 0\] collective #1")


def test_keras_messages(scripts):
    pytest.importorskip("tarantella")
    (scripts / "keras_errors.py").write_text(textwrap.dedent("""
        import warnings
        import tarantella as tnt
        import keras, numpy as np, tensorflow as tf

        x = np.random.rand(64, 4).astype("float32")
        y = np.random.randint(0, 2, 64)

        def model(bn=False, sync=False):
            layers = [keras.Input((4,)), keras.layers.Dense(8)]
            layers += [keras.layers.BatchNormalization(synchronized=sync)] if bn else []
            m = tnt.Model(keras.Sequential(layers + [keras.layers.Dense(2, activation="softmax")]))
            m.compile("sgd", "sparse_categorical_crossentropy")
            return m

        def summed_with_regularizer():
            m = tnt.Model(keras.Sequential([
                keras.Input((4,)),
                keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.1))]))
            m.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                       reduction="sum"))
            return m

        def attempt(fn):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", UserWarning)
                try:
                    fn()
                except Exception as exc:
                    print(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
            for w in caught:
                if issubclass(w.category, UserWarning):
                    print(f"{w.category.__name__}: {w.message}")

        m = model()
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        attempt(lambda: m.fit(ds, verbose=0))
        attempt(lambda: m.fit(ds.batch(8), batch_size=4, verbose=0))
        attempt(lambda: m.fit(x, y, batch_size=10, tnt_micro_batch_size=4, verbose=0))
        attempt(lambda: summed_with_regularizer().fit(x, y, batch_size=8, verbose=0))
        attempt(lambda: model(bn=True).fit(x, y, batch_size=16, verbose=0))
        attempt(lambda: tnt.Model(object()))

        def cut(cuts=1):
            inp = keras.Input((4,))
            h = keras.layers.Dense(4, name="h")(inp)
            x = h
            for i in range(cuts):
                x = tnt.keras.layers.SplitLayer(name=f"cut{i}")(x)
                x = keras.layers.Dense(4, name=f"g{i}" if i else "g")(x)
            return keras.Model(inp, x, name="net")

        def resnet():
            inp = keras.Input((4,))
            x = keras.layers.Dense(8, name="stem")(inp)
            for b in range(2):
                y = keras.layers.Dense(8, name=f"block{b}_a")(x)
                y = keras.layers.Dense(8, name=f"block{b}_b")(y)
                x = keras.layers.Add(name=f"block{b}_add")([x, y])
            return keras.Model(inp, keras.layers.Dense(2, name="head")(x), name="resnet")

        attempt(lambda: tnt.Model(resnet(), parallel_strategy="pipelining", num_pipeline_stages=5))
        attempt(lambda: tnt.Model(cut(cuts=2), parallel_strategy="pipelining"))
    """))
    proc = run([_bin("tnt"), "run", "-n", "2", "--", "keras_errors.py"], scripts, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    for pattern in (r"yields single samples", r"was given with a tf.data.Dataset",
                    r"tnt_micro_batch_size=4 x 2 ranks", r"cannot be normalised like serial",
                    r"computes its batch statistics on each rank's micro-batch",
                    r"tnt.Model wraps a keras.Model", r"cannot be cut into 5 partitions automatically",
                    r"which need exactly 3 ranks"):
        assert_quoted(out, pattern)
