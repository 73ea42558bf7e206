"""Every code block of every user-facing page of ``docs/`` runs as the page says.

Each page's blocks are found in its Markdown (``python``, ``console`` and ``text`` fences;
MyST directives such as ``{toctree}`` are not code). What happens to a block:

- A ``python`` block runs on 2 ranks under ``tnt run``, after the page's *prelude*: a few
  declared lines below that supply what the page says it assumes (``model``,
  ``x_train``, a small data set), with small sizes so that each block takes seconds; the
  blocks themselves are not edited. A block that continues an earlier one (the page uses
  its names) runs after it in the same namespace; the others each start afresh from the
  prelude. Where the page states a result (a comment ``# shape (...)``, a printed line),
  a declared *check* asserts it on every rank.
- A ``console`` block's ``$`` commands run as written, in a folder holding the files the
  page names (``train.py``, ``hosts``, ...: declared per page), with this environment's
  ``tnt`` and ``python``. Output the page shows after a command (in the block, or in the
  ``text`` block right after it) must match the real output line by line, up to numbers,
  paths and ``<placeholders>``; a ``...`` line ends the comparison.
- A ``text`` block is either such output, or a message the page quotes; the messages are
  tests/test_docs_messages.py's subject.

Anything not run carries its reason below (``SKIP``), and the listing of every block, ran or
skipped, is printed (``pytest tests/test_docs_run.py -rA`` shows it; with ``-v`` each
block is a test of its own, ``page.md:line``).

To fit the suite, the python blocks of all pages share one launch of ``tnt run -n 2`` (the
pages run one after the other in fresh namespaces, so TensorFlow starts once per rank, not
once per page: the suite is bound by CPU, and each start costs seconds of it), and the console
commands run one at a time beside it. A block that fails ends the launch (its ranks could no
longer agree on the next collective); the blocks after it are reported as not run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^( *)```([^\s`]*)[^\n]*\n(.*?)^ *```\s*$", re.MULTILINE | re.DOTALL)
RANKS = 2
pytestmark = pytest.mark.timeout(900)


# --------------------------------------------------------------------------------------
# what the pages assume, and what is not run (and why)


@dataclass
class Page:
    #: python code run before each (group of) python block(s) of the page
    prelude: str = ""
    #: files the page's commands name, written into the page's folder
    files: dict[str, str] = field(default_factory=dict)
    #: block index -> code of assertions run after it, in its namespace, on every rank
    checks: dict[int, str] = field(default_factory=dict)
    #: block index -> index of the earlier block it continues
    continues: dict[int, int] = field(default_factory=dict)
    #: block index (or "index:command number") -> why it is not run
    skip: dict[int | str, str] = field(default_factory=dict)
    #: block index (or "index:command number") -> (reason, text the known failure prints)
    known_failures: dict[int | str, tuple[str, str]] = field(default_factory=dict)
    #: console "index:command number" -> regex its output must match (beyond shown output)
    expect: dict[str, str] = field(default_factory=dict)
    #: python block index -> regex the master rank's output of the block must match
    prints: dict[int, str] = field(default_factory=dict)
    #: python block index -> file name: the block is a file the page's commands use
    as_file: dict[int, str] = field(default_factory=dict)
    #: console "index:command number" -> files the command must have written (removed after)
    expect_files: dict[str, list[str]] = field(default_factory=dict)
    #: text block index -> the console "index:command number" whose output it shows
    output_of: dict[int, str] = field(default_factory=dict)
    #: text block index -> why it is not a block's output
    quoted: dict[int, str] = field(default_factory=dict)


MESSAGE = ("an error message the page quotes for a failing case, not a block's output "
           "(tests/test_docs_messages.py runs those cases)")

#: the script the launcher pages (cli, advanced) name: it starts the rank runtime and shows
#: what `tnt run` gave the rank; a training (TensorFlow's start-up on every rank) would
#: check nothing more about the launcher's options, except the timeline, which is a training's
LAUNCH_SCRIPT = """\
import os, sys
if os.environ.get("TNT_TIMELINE"):   # the timeline command: a few real training steps
    import numpy as np, keras
    import tarantella as tnt
    model = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((16, 4)), np.ones((16, 2)), batch_size=8, epochs=1, verbose=0)
import tnt_core
runtime = tnt_core.init()
settings = " ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ)
                    if k in ("TNT_FUSION_THRESHOLD_KB", "TNT_OVERLAP", "TNT_NATIVE_OPS",
                             "TNT_TIMEOUT_S", "TNT_LOG_LEVEL", "TNT_LOG_ALL", "TNT_OUTPUT_ALL"))
print(f"rank {tnt_core.get_rank()} of {tnt_core.get_size()} on {runtime.backend.name}; "
      f"args {sys.argv[1:]}; {settings}")
"""

SAME_WEIGHTS = """
import numpy as _np, tarantella as _tnt
_w = _np.concatenate([_np.asarray(v).ravel() for v in {model}.get_weights()])
_all = _tnt.allgather(_w[None])
assert all(_np.array_equal(_all[0], row) for row in _all), "the ranks' weights differ"
"""

SMALL_CLASSIFIER = """
import numpy as np
import keras
import tensorflow as tf
import tarantella as tnt

rng = np.random.default_rng(0)
x_train = rng.normal(size=({n}, 8)).astype("float32")
y_train = (x_train[:, 0] > 0).astype("int32")

def build_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(2, activation="softmax")])
"""

PAGES: dict[str, Page | str] = {
    "quickstart.md": "tests/test_docs_quickstart.py runs every block of this page: the program "
                     "(its python blocks in order), both commands, and their shown output",
    "faq.md": "only error messages the page quotes (text blocks); tests/test_docs_messages.py "
              "runs the cases that print them",
    "index.md": Page(skip={
        0: "the two lines of tnt.Model, a fragment (keras_model is the reader's); "
           "quickstart.md runs them in a whole program",
        "1:0": "installs packages from PyPI: tests/test_wheels.py installs the wheels",
        "1:1": "model.py is the reader's script: quickstart.md and cli.md run the same command "
               "with scripts of theirs",
    }),
    "installation.md": Page(
        as_file={7: "check.py"},
        output_of={8: "6:1"},
        skip={
            "0:0": "builds the wheels: tests/test_wheels.py does",
            "0:1": "installs: tests/test_wheels.py does",
            "1:0": "installs Debian packages (root)", "1:1": "installs packages: tests/test_wheels.py does",
            "2:0": "make run is the README's main job, run by CI (.ci/run)",
            "2:1": "make test is the suite this test is part of",
            "3:0": "installs a build from source: tests/test_wheels.py builds the packages",
            "5:0": "installs MPICH's wheel", "5:1": "installs Open MPI's wheel",
            "5:2": "installs packages: tests/test_wheels.py does",
        },
        quoted={4: "the message CMake's build prints without Gloo; tnt-comm-gloo's build test owns it"},
    ),
    "datasets.md": Page(
        prelude=SMALL_CLASSIFIER.format(n=256) + """
def augment(x, y):
    return x + 0.01, y

model = tnt.Model(build_model())
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
val_dataset = tf.data.Dataset.from_tensor_slices((x_train[:32], y_train[:32])).batch(16)
""",
        checks={0: SAME_WEIGHTS.format(model="model"), 1: SAME_WEIGHTS.format(model="model"),
                3: SAME_WEIGHTS.format(model="model")},
        quoted={2: MESSAGE, 4: MESSAGE, 5: MESSAGE},
    ),
    "callbacks.md": Page(
        prelude=SMALL_CLASSIFIER.format(n=32) + """
train_dataset = dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(16)
val_dataset = train_dataset.take(1)
model = tnt.Model(build_model())
# a learning rate of 0: val_loss does not improve, so EarlyStopping ends the page's 50 epochs at 4
model.compile(optimizer=keras.optimizers.SGD(0.0), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
callback = keras.callbacks.Callback()
""",
        checks={
            0: """
import os
if tnt.is_master_rank():   # the writer (the other ranks do not wait for its last checkpoint)
    written = sorted(os.listdir("checkpoints"))
    assert written == [f"epoch-{e}.keras" for e in (1, 2, 3, 4)], written
    assert len(open("training.csv").read().splitlines()) == 5   # a header and 4 epochs, once
""",
            2: """
assert open(f"log.rank{tnt.get_rank()}.txt").read().count("\\n") == 10
""",
        },
    ),
    "save_load.md": Page(
        prelude=SMALL_CLASSIFIER.format(n=32) + """
train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(16)
model = tnt.Model(build_model())
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(train_dataset, epochs=1, verbose=0)
""",
        checks={0: """
import os
assert os.path.getsize("lenet5.keras") > 0 and os.path.getsize("lenet5.weights.h5") > 0
assert isinstance(restored, keras.Model) and restored.optimizer is not None   # compiled
""" + SAME_WEIGHTS.format(model="restored")},
        skip={1: "writes to /local/scratch, a folder of the reader's machine; the same call with "
                 "another path is tested by packages/tnt-keras/tests (tnt_save_all_devices)"},
    ),
    "custom_loops.md": Page(
        prelude=SMALL_CLASSIFIER.format(n=256) + """
epochs = 2

def make_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(2)])
""",
        checks={0: SAME_WEIGHTS.format(model="model")},
    ),
    "collectives.md": Page(
        prelude="""
import numpy as np
import tensorflow as tf
import tarantella as tnt

x = np.arange(3.0)
preds = np.ones((tnt.get_rank() + 1, 10), np.float32)   # rank r predicted r + 1 samples
loss = 0.5 * (tnt.get_rank() + 1)
""",
        checks={
            0: """
n = tnt.get_size()
assert total["seen"] == 10 * n and isinstance(total["seen"], int)
assert total["loss"] == sum(0.25 * r for r in range(n))
assert list(total["correct"]) == [3 * n, 4 * n]
""",
            1: """
assert isinstance(mean[0], np.ndarray) and mean[0].shape == (3, 3) and mean[0].dtype == np.float32
assert isinstance(mean[1], tf.Tensor) and mean[1].shape == (2,) and mean[1].dtype == tf.float32
""",
            2: "assert len(set(tnt.allgather(seed).tolist())) == 1   # rank 0's, on every rank",
            3: """
n = tnt.get_size()
assert every.shape == (n * (n + 1) // 2, 10)
assert losses.tolist() == [0.5 * (r + 1) for r in range(n)]
""",
            4: "assert total.tolist() == (x * tnt.get_size()).tolist()",
        },
        prints={0: r"^\[0\.3 0\.4\]$"},
        quoted={5: MESSAGE, 6: MESSAGE},
    ),
    "migration.md": Page(
        prelude=SMALL_CLASSIFIER.format(n=64) + """
import sys
import types
import tarantella.horovod.keras
# the page's "before" script imports Horovod, which does not install with TensorFlow 2.16+:
# tarantella.horovod.keras stands in for horovod.tensorflow.keras, as the page says it can
_horovod = types.ModuleType("horovod")
_horovod.tensorflow = types.ModuleType("horovod.tensorflow")
_horovod.tensorflow.keras = tarantella.horovod.keras
sys.modules.update({"horovod": _horovod, "horovod.tensorflow": _horovod.tensorflow,
                    "horovod.tensorflow.keras": tarantella.horovod.keras})

per_rank_batch = 8
train_ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))

def make_dataset():
    return tf.data.Dataset.from_tensor_slices((x_train, y_train))

model = tnt.Model(build_model())
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
""",
        checks={0: SAME_WEIGHTS.format(model="model"), 1: SAME_WEIGHTS.format(model="model"),
                2: SAME_WEIGHTS.format(model="model")},
        skip={
            "3:0": "horovodrun: Horovod is not installed (it supports no TensorFlow >= 2.16)",
            "3:1": "train.py is python block 2, run on 2 ranks in this test's launch",
        },
    ),
    "pipelining.md": Page(
        prelude="""
import numpy as np
import keras
import tarantella as tnt

rng = np.random.default_rng(0)
x_train = rng.normal(size=(8, 784)).astype("float32")   # one small batch per epoch
y_train = rng.integers(0, 10, size=8)
x, y = x_train[:, :16], rng.normal(size=(8, 1)).astype("float32")

def build_my_model():
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
""",
        checks={
            0: "assert 0 < model.local_param_count < 37_000_000",
            2: "assert model.local_param_count < 37_000_000   # a part of the model",
            5: """
import os
assert os.path.getsize("ck.keras") > 0
plain = keras.saving.load_model("final.keras")   # plain Keras loads it
assert len(plain.get_weights()) == len(model.get_weights()) == 6
""",
            6: "assert model.recompute is (tnt.get_rank() == 0)   # stage 0 recomputes, 1 not",
        },
        skip={
            "1:0": "model.py is python block 0, run on 2 ranks in this test's launch",
            "4:0": "4 ranks of TensorFlow on the 2-core CI machine; ALL (2 stages x 2) is trained "
                   "against plain Keras by packages/tnt-keras/tests/test_pipeline_model.py, and the "
                   "example with 2 stages by tests/test_examples.py",
        },
        quoted={3: MESSAGE},
    ),
    "pipelining_results.md": Page(),   # measurements: no code blocks
    "points_to_consider.md": Page(
        prelude=SMALL_CLASSIFIER.format(n=64) + """
import math
micro_batch, epochs, num_samples = 8, 3, 64
dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
model = tnt.Model(build_model())
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
discriminator = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
""",
        checks={0: SAME_WEIGHTS.format(model="model"),
                1: "assert model.optimizer.learning_rate is not None",
                7: "assert isinstance(gan, keras.Model)"},
        quoted={2: MESSAGE, 3: MESSAGE, 4: MESSAGE, 5: MESSAGE, 6: MESSAGE, 8: MESSAGE},
    ),
    "advanced.md": Page(
        files={"train.py": LAUNCH_SCRIPT, "hosts": "localhost slots=2\n",
               "my_program": "#!/bin/sh\necho \"my_program: rank $TNT_RANK of $TNT_SIZE, args $*\"\n"},
        prints={0: r"^training on 2 ranks$"},
        expect={
            "1:0": r"rank 0 of 8 on gloo; .*TNT_FUSION_THRESHOLD_KB=1024",
            "2:0": r"rank 0 of 4 on gloo; .*TNT_OVERLAP=false",
            "3:0": r"rank 0 of 4 on gloo; .*TNT_NATIVE_OPS=false",
            "4:0": r"rank 0 of 2 on gloo",
            "5:0": r"rank 0 of 2 on gloo; .*TNT_TIMEOUT_S=5",
            "8:0": r"rank 0 of 2 on gloo",
            "9:2": r"my_program: rank 0 of 2, args --flag",
            "10:0": r"(?m)^\[3\] rank 3 of 4 on gloo; .*TNT_LOG_LEVEL=INFO",
        },
        expect_files={"4:0": ["/tmp/trace-0.json", "/tmp/trace-1.json"]},
        skip={
            "9:0": "/opt/py311/bin/python is a path of the reader's machine",
            "9:1": "valgrind under every rank takes minutes (and runs the `python` on PATH)",
        },
        quoted={6: "the message of a peer that stopped answering, not this command's output "
                   "(tests/test_docs_messages.py runs that case)",
                7: "the stall inspector's warning for a hung rank (packages/tnt-core/tests run that case)"},
    ),
    "cli.md": Page(
        files={"train.py": LAUNCH_SCRIPT},
        expect={"0:0": r"rank 0 of 4 on gloo; args \['--batch_size=64'\]",
                "0:1": r"rank 0 of 4 on gloo; args \['--batch_size=64'\]"},
        skip={"4:0": "-H node1:2,node2:2: two hosts reachable by ssh",
              7: "elastic runs of a training script that ranks die in (and a host discovery "
                 "script); packages/tnt-cli/tests/test_cli_elastic.py runs the elastic options "
                 "with a loop of allreduces, killing ranks, and checks these lines",
              "10:0": "ends every process of this user that runs a train.py, other jobs' too; "
                      "packages/tnt-cli/tests/test_cli_launch.py runs --cleanup on a script of a "
                      "unique name and checks this line"},
        quoted={5: MESSAGE, 6: MESSAGE,
                8: "the output of an elastic run above (test_cli_elastic.py checks these lines)",
                9: "the output of an elastic run above (test_cli_elastic.py checks this line)"},
    ),
    "elastic.md": Page(
        # the custom loop (block 4) runs here in a job that is not elastic: hvd.elastic.run
        # synchronises the state and calls it once; packages/tnt-keras/tests/
        # test_horovod_elastic.py kills a rank of such a loop
        checks={5: SAME_WEIGHTS.format(model="model")},
        skip={0: "an elastic run that ranks die in; packages/tnt-keras/tests/test_elastic_fit.py "
                 "runs one (tnt run -n 4 --min-np 1, three ranks SIGKILLed) against plain Keras",
              6: "a Slurm allocation of several hosts reachable by ssh"},
        quoted={1: "the output of an elastic run above (test_elastic_fit.py checks its lines)",
                2: "the new master's line when the master died (test_elastic_fit.py checks it)",
                3: "tnt run's line when a pipelined job restarts (test_elastic_fit.py checks "
                   "the reason)",
                4: "tnt run's line when a pipelined job under ALL restarts (test_elastic_fit.py "
                   "checks it)"},
    ),
    "examples.md": Page(
        skip=dict.fromkeys((0, 2, 3), "an example's full-length run (minutes); tests/test_examples.py "
                                      "runs every example under tnt run -n 2 with short settings"),
        quoted={1: "the output of the full-length run above (tests/test_examples.py checks the line "
                   "of a short run)",
                4: "the output of the full-length run above (tests/test_examples.py checks a short run's)"},
    ),
    "performance.md": Page(skip=dict.fromkeys(range(22), "a benchmark run (minutes of training or of "
                                              "allreduces); its output is what the results pages show")),
    "performance_results.md": Page(skip=dict.fromkeys(range(21), "the benchmark runs that produced the "
                                                                "page's tables (minutes each)")),
}

#: pages for developers of Tarantella-NT, not its users: their blocks are reference
#: material (generated API pages, the package contract, a plugin's files)
DEVELOPER_PAGES = ("architecture.md", "plugins.md", "api.md", "api_keras.md")


# --------------------------------------------------------------------------------------
# the pages' blocks


@dataclass
class Block:
    page: str
    index: int
    kind: str
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: str) -> list[Block]:
    """The fenced code blocks of a page, in order (MyST directives such as ``{toctree}``
    are not code and not counted); a block indented inside a list item is dedented."""
    text = (DOCS / page).read_text()
    found = []
    for m in FENCE.finditer(text):
        kind = m.group(2)
        if kind.startswith("{"):
            continue
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(page, len(found), kind or "text", line, textwrap.dedent(m.group(3))))
    return found


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """A console block's ``$`` commands, each with the output lines the page shows after it."""
    result: list[tuple[str, list[str]]] = []
    pending = ""
    for line in block.code.splitlines():
        if pending or line.startswith("$ "):
            part = line[2:] if not pending else line
            if part.rstrip().endswith("\\"):
                pending += part.rstrip()[:-1] + " "
                continue
            result.append((pending + part, []))
            pending = ""
        elif result and line.strip():
            result[-1][1].append(line)
    return result


def user_pages() -> list[str]:
    return sorted(PAGES)


# --------------------------------------------------------------------------------------
# running them


def _norm(line: str) -> str:
    """A line compared up to numbers, paths, placeholders and spacing."""
    line = re.sub(r"<[^>]*>", "<>", line.strip())
    line = re.sub(r"(?<![\w.])/[^\s'\"]+", "PATH", line)
    line = re.sub(r"\d+(\.\d+)?(ms|us|s)\b", "T", line)
    line = re.sub(r"\d+(\.\d+)?", "#", line)
    return re.sub(r"\s+", " ", line)


def _bin(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"`{name}` is not installed in this environment ({Path(sys.executable).parent})")
    return found


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


HARNESS = r'''
import json, os, sys, time, traceback
units = json.load(open(sys.argv[1]))
for unit in units:
    os.chdir(unit["dir"])
    namespace = {"__name__": "__main__"}
    print(f"@@start {unit['id']}", flush=True)
    start = time.perf_counter()
    try:
        for name, code in unit["code"]:
            exec(compile(code, name, "exec"), namespace)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        print(f"@@failed {unit['id']}", flush=True)
        os._exit(1)   # the other ranks may wait in a collective this rank left: end the launch
    print(f"@@ok {unit['id']} {time.perf_counter() - start:.1f}s", flush=True)
'''


@dataclass
class Outcome:
    status: str             # "ok", "failed", "not run", "skipped", "known failure"
    detail: str = ""
    seconds: float = 0.0


class Runs:
    """Runs every page's blocks once (the launch and the commands side by side) and keeps what
    happened to each block, by block id."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.outcomes: dict[str, Outcome] = {}
        self.listing: list[str] = []
        self.timings: list[tuple[str, float]] = []

    # -- planning --------------------------------------------------------------------
    def _folder(self, page: str, spec: Page) -> Path:
        folder = self.workdir / page.removesuffix(".md")
        folder.mkdir(exist_ok=True)
        for name, text in spec.files.items():
            (folder / name).write_text(text)
            if text.startswith("#!"):
                (folder / name).chmod(0o755)
        return folder

    def plan(self) -> tuple[list[dict], list[tuple[Block, int, str, list[str], Page, Path]]]:
        units: list[dict] = []
        console: list[tuple[Block, int, str, list[str], Page, Path]] = []
        for page in user_pages():
            spec = PAGES[page]
            blocks = page_blocks(page)
            if isinstance(spec, str):
                for b in blocks:
                    self.outcomes[b.id] = Outcome("skipped", spec)
                continue
            folder = self._folder(page, spec)
            groups: dict[int, list[Block]] = {}
            for b in blocks:
                if b.kind == "python":
                    if b.index in spec.skip:
                        self.outcomes[b.id] = Outcome("skipped", spec.skip[b.index])
                    elif b.index in spec.as_file:
                        (folder / spec.as_file[b.index]).write_text(b.code)
                        self.outcomes[b.id] = Outcome("ok", f"the file {spec.as_file[b.index]} of the "
                                                            "page's command")
                    else:
                        head = b.index
                        while head in spec.continues:
                            head = spec.continues[head]
                        groups.setdefault(head, []).append(b)
                elif b.kind == "console":
                    if b.index in spec.skip:
                        self.outcomes[b.id] = Outcome("skipped", spec.skip[b.index])
                        continue
                    for n, (command, shown) in enumerate(commands(b)):
                        console.append((b, n, command, shown, spec, folder))
                elif b.kind == "text":
                    if b.index in spec.quoted:
                        self.outcomes[b.id] = Outcome("skipped", spec.quoted[b.index])
                    elif b.index in spec.skip:
                        self.outcomes[b.id] = Outcome("skipped", spec.skip[b.index])
                    else:
                        source = spec.output_of.get(b.index)
                        before = blocks[b.index - 1] if b.index else None
                        if source is None and before is not None and before.kind == "console":
                            source = f"{before.index}:{len(commands(before)) - 1}"
                        if source is None:
                            self.outcomes[b.id] = Outcome("failed", "a text block that is neither "
                                                          "declared a quoted message nor follows a command")
                        else:
                            self.outcomes[b.id] = Outcome("pending", source)
                else:
                    self.outcomes[b.id] = Outcome("failed", f"a block of kind {b.kind!r}: the test "
                                                  "does not know how to run it")
            for head, members in groups.items():
                code = [(f"<prelude of {page}>", spec.prelude)] if spec.prelude else []
                for b in members:
                    code.append((f"{page}:{b.line}", b.code))
                    if b.index in spec.checks:
                        code.append((f"<check of {page}:{b.line}>", spec.checks[b.index]))
                units.append(dict(id=f"{page}:{blocks[head].line}", dir=str(folder), code=code,
                                  members=[m.id for m in members],
                                  prints={m.id: spec.prints[m.index] for m in members
                                          if m.index in spec.prints},
                                  known={m.id: spec.known_failures[m.index] for m in members
                                         if m.index in spec.known_failures}))
        # a unit expected to fail ends the launch: run it last
        units.sort(key=lambda u: bool(u["known"]))
        return units, console

    # -- running ---------------------------------------------------------------------
    def _launch(self, units: list[dict]) -> None:
        spec_file = self.workdir / "launch.json"
        spec_file.write_text(json.dumps(units))
        harness = self.workdir / "harness.py"
        start = time.perf_counter()
        proc = subprocess.run(
            [_bin("tnt"), "run", "-n", str(RANKS), "--timeout", "120", "--output-on-all-devices",
             "--", str(harness), str(spec_file)],
            cwd=self.workdir, env=_env(), capture_output=True, text=True, timeout=800)
        self.timings.append((f"the launch ({', '.join(u['id'] for u in units)})",
                             time.perf_counter() - start))
        out = proc.stdout
        for unit in units:
            by_rank: dict[int, list[str]] = {}
            status = {}
            for rank in range(RANKS):
                lines = [line[len(f"[{rank}] "):] for line in out.splitlines()
                         if line.startswith(f"[{rank}] ")]
                try:
                    first = lines.index(f"@@start {unit['id']}")
                except ValueError:
                    status[rank] = "not run"
                    continue
                rest = lines[first + 1:]
                end = next((i for i, line in enumerate(rest) if line.startswith("@@")), len(rest))
                by_rank[rank] = rest[:end]
                tail = rest[end] if end < len(rest) else ""
                status[rank] = ("ok" if tail.startswith("@@ok") else
                                "failed" if tail.startswith("@@failed") else "ended")
                if tail.startswith("@@ok"):
                    self.timings.append((unit["id"], float(tail.split()[-1][:-1])))
            failed = [r for r, s in status.items() if s != "ok"]
            output = "\n".join(f"[{r}] {line}" for r, lines in by_rank.items() for line in lines)
            for member in unit["members"]:
                if member in unit["known"]:
                    reason, printed = unit["known"][member]
                    if failed and printed in output:
                        self.outcomes[member] = Outcome("known failure", reason)
                    else:
                        self.outcomes[member] = Outcome(
                            "failed", f"marked as a known failure ({reason}), but it "
                            f"{'failed otherwise' if failed else 'ran'}: remove the mark\n{output[-3000:]}")
                elif all(s == "not run" for s in status.values()):
                    self.outcomes[member] = Outcome("not run", "an earlier block of its launch failed, or "
                                                    f"the launch did not start\n{proc.stderr[-3000:]}")
                elif failed:
                    self.outcomes[member] = Outcome(
                        "failed", f"ranks {failed}: {[status[r] for r in failed]}\n{output[-6000:]}"
                        f"\n{proc.stderr[-3000:]}")
                else:
                    pattern = unit["prints"].get(member)
                    if pattern and not re.search(pattern, "\n".join(by_rank.get(0, [])), re.MULTILINE):
                        self.outcomes[member] = Outcome(
                            "failed", f"the page shows output matching {pattern!r}; rank 0 printed\n"
                            + "\n".join(by_rank.get(0, [])))
                    else:
                        self.outcomes[member] = Outcome("ok", f"ran on {RANKS} ranks")

    def _command(self, item: tuple[Block, int, str, list[str], Page, Path]) -> tuple[str, Outcome]:
        block, n, command, shown, spec, folder = item
        key = f"{block.index}:{n}"
        if key in spec.skip:
            return key, Outcome("skipped", spec.skip[key])
        argv = shlex.split(command, comments=True)
        argv[0] = {"python": sys.executable, "tnt": _bin("tnt"), "tarantella": _bin("tarantella")
                   }.get(argv[0], argv[0])
        files = spec.expect_files.get(key, [])
        existed = {f for f in files if os.path.exists(f)}
        start, started_at = time.perf_counter(), time.time()
        try:
            proc = subprocess.run(argv, cwd=folder, env=_env(), capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            return key, Outcome("failed", f"$ {command}: {e}")
        self.timings.append((f"{block.page} $ {command}", time.perf_counter() - start))
        out = proc.stdout + proc.stderr
        problems = []
        if proc.returncode != 0:
            problems.append(f"exit code {proc.returncode}")
        text_after = [b for b in page_blocks(block.page) if b.kind == "text"]
        shown_elsewhere = [t.code.splitlines() for t in text_after
                           if self.outcomes.get(t.id, Outcome("")).status == "pending"
                           and self.outcomes[t.id].detail == key]
        printed = [_norm(line) for line in proc.stdout.splitlines() if line.strip()]
        for want in [shown, *shown_elsewhere]:
            want = [line for line in want if line.strip()]
            stripped = [line.strip() for line in want]
            if "..." in stripped:   # the page shows the first lines only
                want = want[:stripped.index("...")]
            got = printed[:len(want)] if "..." in stripped else printed
            if want and got != [_norm(line) for line in want]:
                problems.append("the page shows\n" + "\n".join(want) + "\nbut the command printed\n"
                                + proc.stdout)
        pattern = spec.expect.get(key)
        if pattern and not re.search(pattern, out):
            problems.append(f"no output matching {pattern!r}")
        for f in files:
            if not os.path.exists(f) or os.path.getmtime(f) < started_at:
                problems.append(f"{f} was not written")
            elif f not in existed:
                os.remove(f)
        if key in spec.known_failures:
            reason, printed = spec.known_failures[key]
            if problems and printed in "\n".join(problems):
                return key, Outcome("known failure", reason)
            return key, Outcome("failed", f"marked as a known failure ({reason}), but "
                                f"{'it failed otherwise' if problems else 'it ran'}: remove the mark\n"
                                + "\n".join(problems))
        if problems:
            return key, Outcome("failed", f"$ {command}\n" + "\n".join(problems) + f"\n{out[-3000:]}")
        return key, Outcome("ok", f"$ {command}")

    def run(self) -> None:
        (self.workdir / "harness.py").write_text(HARNESS)
        units, console = self.plan()
        started = time.perf_counter()
        # the launch, and beside it one command at a time (the commands mostly wait for their
        # ranks to meet: they add little CPU)
        with ThreadPoolExecutor(max_workers=2) as pool:
            job = pool.submit(self._launch, units)
            results = list(pool.map(self._command, console))
            job.result()
        self.timings.append(("all, side by side", time.perf_counter() - started))
        # a console block's outcome: its commands' together; a text block's: its command's
        by_block: dict[str, list[tuple[str, Outcome]]] = {}
        for item, (_key, outcome) in zip(console, results):
            by_block.setdefault(item[0].id, []).append((f"$ {item[2]}", outcome))
        for block_id, outcomes in by_block.items():
            bad = [(c, o) for c, o in outcomes if o.status == "failed"]
            detail = "\n".join(f"{c}: {o.status}" + (f" ({o.detail})" if o.status != "ok" else "")
                               for c, o in outcomes)
            statuses = {o.status for _, o in outcomes}
            status = ("failed" if bad else "known failure" if "known failure" in statuses
                      else "skipped" if statuses == {"skipped"} else "ok")
            self.outcomes[block_id] = Outcome(status, detail if not bad else
                                              "\n".join(f"{c}: {o.detail}" for c, o in bad))
        for page in user_pages():
            for b in page_blocks(page):
                o = self.outcomes[b.id]
                if o.status == "pending":   # a text block showing a command's output
                    index, n = (int(part) for part in o.detail.split(":"))
                    source = page_blocks(page)[index]
                    ran = by_block.get(source.id, [])
                    if n < len(ran) and ran[n][1].status == "ok":
                        o = Outcome("ok", f"the output of {source.id} {ran[n][0]}")
                    else:
                        o = Outcome(ran[n][1].status if n < len(ran) else "failed",
                                    f"the output of {source.id}, command {n}: "
                                    + (ran[n][1].detail if n < len(ran) else "not run"))
                    self.outcomes[b.id] = o
                first = o.detail.splitlines()[0] if o.detail else ""
                self.listing.append(f"{b.id:<28} {b.kind:<8} {o.status:<14} {first}")


def start_runs(workdir: Path) -> Future | None:
    """Every block's run, started in the background (``tests/conftest.py`` starts it with the
    session's first repository-level test: its launch fills the cores that the one-process
    tests before this module leave idle); None where tnt-keras is not installed."""
    if importlib.util.find_spec("tarantella") is None:   # (not imported here: TensorFlow's start-up)
        return None
    result = Runs(workdir)

    def run() -> Runs:
        result.run()
        return result

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="docs-run")
    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


@pytest.fixture(scope="module")
def runs(docs_runs):
    if docs_runs is None:
        pytest.skip("tnt-keras is not installed")
    result = docs_runs.result()
    print("\nevery block of the user pages:\n" + "\n".join(result.listing))
    print("\nwall seconds:\n" + "\n".join(f"{s:7.1f}  {what}" for what, s in result.timings))
    return result


ALL_BLOCKS = [b for page in user_pages() for b in page_blocks(page)]


def test_every_page_is_declared():
    pages = {p.name for p in DOCS.glob("*.md")}
    undeclared = pages - set(PAGES) - set(DEVELOPER_PAGES)
    assert not undeclared, f"pages the test does not know: {sorted(undeclared)}; declare them in PAGES"
    for page, spec in PAGES.items():
        if isinstance(spec, str):
            continue
        blocks = page_blocks(page)
        kinds = {b.index: b.kind for b in blocks}
        for what, keys, allowed in [("checks", spec.checks, {"python"}), ("prints", spec.prints, {"python"}),
                                    ("as_file", spec.as_file, {"python"}), ("quoted", spec.quoted, {"text"}),
                                    ("output_of", spec.output_of, {"text"}),
                                    ("continues", spec.continues, {"python"})]:
            for key in keys:
                assert kinds.get(key) in allowed, \
                    f"{page}: {what}[{key}] names a {kinds.get(key)} block; the page changed?"
        for key in [*spec.skip, *spec.known_failures, *spec.expect, *spec.expect_files]:
            index, _, n = str(key).partition(":")
            assert int(index) in kinds, f"{page}: no block {index}"
            if n:
                assert kinds[int(index)] == "console" and int(n) < len(commands(blocks[int(index)])), \
                    f"{page}: block {index} has no command {n}; the page changed?"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[f"{b.id} {b.kind}" for b in ALL_BLOCKS])
def test_block(runs, block):
    outcome = runs.outcomes[block.id]
    if outcome.status == "skipped":
        pytest.skip(outcome.detail)
    if outcome.status == "known failure":
        pytest.xfail(outcome.detail)
    assert outcome.status == "ok", f"{block.id} ({block.kind}) {outcome.status}:\n{outcome.detail}"
