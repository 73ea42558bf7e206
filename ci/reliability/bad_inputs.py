"""The bad-input table: what a user sees first after a mistake, for 150+ mistakes.

Four kinds of input:

- ``tnt run`` command lines: options, hostfiles, scripts;
- ``TNT_*`` values: every variable declared (``tnt_core.installed_settings()``: tnt-core's
  and the installed plugins'; not the internal one) with a value of the wrong kind or out
  of its range, once exported in the shell that runs ``tnt run`` and once passed with
  ``-x NAME=VALUE``; the job's ranks start the backend and run one allreduce (settings
  tarantella reads: a tiny ``fit``), so values read only by a rank are exercised too;
- the Keras API (``import tarantella as tnt``): ``tnt.Model``, ``compile``, ``fit`` and
  friends, callbacks, saving; one process for the single-rank cases, one ``tnt run -n 2``
  job for the cases that need two ranks (each TensorFlow import costs ~10 s);
- the ``tnt_core`` API: ``tnt_core.init`` and the backend's collectives with wrong
  arguments, in one ``tnt run -n 2`` job per backend (gloo, mpi).

For each case: the exit code (CLI, TNT_*), the FIRST line on stderr (API: the exception's
last line, as Python prints it), whether a traceback was printed and how many of its
frames lie inside tarantella/tnt_core/keras/tensorflow (API), and a verdict: ``clear``
(it fails, in one line that names the culprit, with no traceback from inside the
libraries; API: at most 2 frames inside them) or ``✗`` with the reason.

    python ci/reliability/bad_inputs.py [--out table.md] [--only cli,env,api,core]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TNT = str(Path(sys.executable).parent / "tnt")
CASE_TIMEOUT_S = 90
JOB_TIMEOUT_S = 20  # --timeout of the jobs that start ranks, so a mistake cannot hang long
MAX_FRAMES_INSIDE = 2
LIBS = ("/tnt_", "/tarantella", "/keras/", "/tensorflow/", "/site-packages/")
STARTED_GROUPS: list[int] = []


def _kill_started() -> None:
    for pgid in STARTED_GROUPS:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


def _run(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float = CASE_TIMEOUT_S
         ) -> tuple[int | None, str, str]:
    """Run ``argv`` in its own process group; (exit code or None on timeout, stdout, stderr)."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    STARTED_GROUPS.append(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    try:  # nothing of the case may outlive it
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    return code, out, err


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.update(extra)
    return env


def _cell(text: str, width: int = 170) -> str:
    text = " ⏎ ".join(ln.strip() for ln in text.strip().splitlines() if ln.strip())
    text = text.replace("\x1b[1m", "").replace("\x1b[0m", "")
    if len(text) > width:
        text = text[: width - 1] + "…"
    return text.replace("|", "\\|").replace("`", "'")


@dataclass
class Row:
    kind: str
    case: str
    command: str
    code: str
    first: str
    traceback: str
    verdict: str

    def markdown(self) -> str:
        command = f"`{_cell(self.command, 110)}`" if self.command else ""
        return (f"| {self.kind} | {_cell(self.case, 60)} | {command} | {self.code} "
                f"| {_cell(self.first)} | {self.traceback} | {self.verdict} |")


HEADER = ["| kind | mistake | command / snippet | exit | first line the user sees (API: the exception) "
          "| traceback | verdict |", "|---|---|---|---|---|---|---|"]


# -- the command line and TNT_* values ----------------------------------------------------------

@dataclass
class CliCase:
    name: str
    args: list[str]
    #: the culprit a clear first line names (case-insensitive substrings; any one will do)
    names: tuple[str, ...]
    env: dict[str, str] | None = None
    program: str = "run"  # "run": tnt run ARGS; "": tnt ARGS
    #: when set, exit 0 is the right answer (the reason)
    accepted_ok: str = ""
    #: the script's own error: its traceback is the right output (no library frames in it),
    #: and tnt run's last line must name the rank with the error
    own_error: bool = False
    #: accepted (``accepted_ok``) with a warning on stderr that names the culprit
    warns: bool = False


RANK = """\
import numpy as np, tnt_core
rt = tnt_core.init()
rt.backend.allreduce(np.ones(4, dtype=np.float32))
print("ran", rt.rank, flush=True)
"""
FIT = """\
import numpy as np, keras, tarantella as tnt
m = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
m.compile(optimizer="sgd", loss="mse")
m.fit(np.ones((16, 4)), np.ones((16, 2)), batch_size=8, epochs=1, verbose=0)
"""


def cli_cases(tmp: Path, busy_port: int) -> list[CliCase]:
    ok = tmp / "ok_rank.py"
    ok.write_text(RANK)
    (tmp / "fit_rank.py").write_text(FIT)
    s = str(ok)

    def hostfile(name: str, text: str) -> str:
        path = tmp / name
        path.write_text(text)
        return str(path)

    syntax = tmp / "syntax_error.py"
    syntax.write_text("def broken(:\n    pass\n")
    notpy = tmp / "notes.txt"
    notpy.write_text("these are my notes, not a program\n")
    raises = tmp / "raises_on_import.py"
    raises.write_text("import tnt_core\ntnt_core.init()\nimport no_such_module_xyz\n")
    mpi = ["--backend", "mpi", "--launcher", "mpirun"]
    return [
        CliCase("unknown option", ["--bogus", "--", s], ("--bogus",)),
        CliCase("Open MPI's -np 2", ["-np", "2", "--", s], ("-n",)),
        CliCase("misspelt option --nprocs", ["--nprocs", "2", "--", s], ("--nprocs",)),
        CliCase("-n 0", ["-n", "0", "--", s], ("-n",)),
        CliCase("-n -3", ["-n", "-3", "--", s], ("-n",)),
        CliCase("-n four", ["-n", "four", "--", s], ("four",)),
        CliCase("-n 2.5", ["-n", "2.5", "--", s], ("2.5",)),
        CliCase("-n 100000", ["-n", "100000", "--", s], ("100000",)),
        CliCase("-n without a value", ["-n", "--", s], ("-n",)),
        CliCase("no script", ["-n", "2"], ("script",)),
        CliCase("nothing after --", ["-n", "2", "--"], ("script",)),
        CliCase("script missing", ["-n", "2", "--", str(tmp / "missing.py")], ("missing.py",)),
        CliCase("script is a directory", ["-n", "2", "--", str(tmp)], ("directory",)),
        CliCase("script before --", [s, "--", "x"], ("--",)),
        CliCase("script has a syntax error", ["-n", "2", "--", str(syntax)], ("SyntaxError",),
                own_error=True),
        CliCase("script is not Python", ["-n", "2", "--", str(notpy)], ("SyntaxError",), own_error=True),
        CliCase("script raises at import (rank 0 and 1)", ["-n", "2", "--", str(raises)],
                ("no_such_module_xyz",), own_error=True),
        CliCase("-x without =", ["-x", "NOEQUALS_XYZ", "--", s], ("NOEQUALS_XYZ",)),
        CliCase("-x bad name", ["-x", "1A=2", "--", s], ("1A",)),
        CliCase("-x empty name", ["-x", "=2", "--", s], ("=2", "name")),
        CliCase("-x without an argument", ["-x"], ("-x",)),
        CliCase("-x TNT_SIZE=5", ["-n", "2", "-x", "TNT_SIZE=5", "--", s], ("TNT_SIZE",)),
        CliCase("-x TNT_RANK=1", ["-n", "2", "-x", "TNT_RANK=1", "--", s], ("TNT_RANK",)),
        CliCase("-x TNT_LOCAL_RANK=1", ["-n", "2", "-x", "TNT_LOCAL_RANK=1", "--", s], ("TNT_LOCAL_RANK",)),
        CliCase("-x TNT_RENDEZVOUS=h:1", ["-n", "2", "-x", "TNT_RENDEZVOUS=h:1", "--", s],
                ("TNT_RENDEZVOUS",)),
        CliCase("-x TNT_RENDEZVOUS_KEY=k", ["-n", "2", "-x", "TNT_RENDEZVOUS_KEY=k", "--", s],
                ("TNT_RENDEZVOUS_KEY",)),
        CliCase("-x TNT_AGENT_SPEC={} (internal), mpirun",
                ["-n", "2", *mpi, "-x", "TNT_AGENT_SPEC={}", "--", s],
                ("TNT_AGENT_SPEC",), accepted_ok="the agents read theirs before -x applies"),
        CliCase("--timeout 0", ["--timeout", "0", "--", s], ("timeout",)),
        CliCase("--timeout -5", ["--timeout", "-5", "--", s], ("timeout",)),
        CliCase("--timeout abc", ["--timeout", "abc", "--", s], ("abc",)),
        CliCase("--timeout nan", ["--timeout", "nan", "--", s], ("nan", "timeout")),
        CliCase("--timeout inf", ["--timeout", "inf", "--", s], ("inf", "timeout")),
        CliCase("--fusion-threshold -1", ["--fusion-threshold", "-1", "--", s], ("fusion",)),
        CliCase("--fusion-threshold abc", ["--fusion-threshold", "abc", "--", s], ("abc",)),
        CliCase("--log-level loud", ["--log-level", "loud", "--", s], ("loud",)),
        CliCase("--backend nccl", ["--backend", "nccl", "--", s], ("nccl",)),
        CliCase("--backend local, 2 ranks", ["-n", "2", "--backend", "local", "--", s], ("local",)),
        CliCase("--backend gloo, 1 rank", ["-n", "1", "--backend", "gloo", "--", s], ("gloo",)),
        CliCase("--backend store (tests only)", ["-n", "2", "--backend", "store", "--", s], ("store",)),
        CliCase("--launcher pbs", ["--launcher", "pbs", "--", s], ("pbs",)),
        CliCase("--launcher srun outside Slurm", ["-n", "2", "--launcher", "srun", "--", s],
                ("srun", "slurm")),
        CliCase("--launcher local + remote host",
                ["--launcher", "local", "--hostfile", hostfile("h_remote", "not-here.invalid\n"), "--", s],
                ("not-here.invalid",)),
        CliCase("hostfile missing", ["--hostfile", str(tmp / "nope"), "--", s], ("nope",)),
        CliCase("hostfile is a directory", ["--hostfile", str(tmp), "--", s], ("hostfile",)),
        CliCase("hostfile lists a host twice", ["--hostfile", hostfile("h_dup", "nodeA\nnodeA\n"), "--", s],
                ("nodeA",)),
        CliCase("hostfile empty", ["--hostfile", hostfile("h_empty", "# nothing\n"), "--", s], ("no hosts",)),
        CliCase("hostfile slots=0", ["--hostfile", hostfile("h_s0", "localhost slots=0\n"), "--", s],
                ("slots",)),
        CliCase("hostfile slots=abc", ["--hostfile", hostfile("h_sa", "localhost slots=abc\n"), "--", s],
                ("slots",)),
        CliCase("hostfile max_slots=2 (Open MPI)",
                ["--hostfile", hostfile("h_ms", "localhost max_slots=2\n"), "--", s], ("max_slots",)),
        CliCase("hostfile 'host:2' (MPICH)", ["--hostfile", hostfile("h_colon", "localhost:2\n"), "--", s],
                ("localhost:2",)),
        CliCase("hostfile: -n above the slots",
                ["-n", "3", "--hostfile", hostfile("h_small", "localhost slots=2\n"), "--", s], ("-n 3",)),
        CliCase("hostfile: unknown host (ssh)",
                ["-n", "1", "--hostfile", hostfile("h_unknown", "no-such-host.invalid\n"), "--", s],
                ("no-such-host.invalid",)),
        CliCase("--n-per-node 0", ["--n-per-node", "0", "--", s], ("n-per-node",)),
        CliCase("--n-per-node abc", ["--n-per-node", "abc", "--", s], ("abc",)),
        CliCase("--rendezvous-port 70000", ["--rendezvous-port", "70000", "--", s], ("70000", "port")),
        CliCase("--rendezvous-port abc", ["--rendezvous-port", "abc", "--", s], ("abc",)),
        CliCase("--rendezvous-host unresolvable", ["-n", "2", "--rendezvous-host", "no-such-host.invalid",
                                                   "--", s], ("no-such-host.invalid",)),
        CliCase("--rendezvous-port in use", ["-n", "2", "--rendezvous-port", str(busy_port), "--", s],
                (str(busy_port),)),
        CliCase("--force without --cleanup", ["--force", "--", s], ("--force",)),
        CliCase("--python-interpreter missing", ["--python-interpreter", "nopython3", "--", s],
                ("nopython3",)),
        CliCase("--python-interpreter '' + non-executable", ["--python-interpreter", "", "--", s],
                ("ok_rank.py",)),
        CliCase("tnt: unknown command", ["frobnicate"], ("frobnicate",), program=""),
        CliCase("tnt: no command", [], ("command",), program=""),
        CliCase("tnt backends --bogus", ["backends", "--bogus"], ("--bogus",), program=""),
    ]


#: a bad value for every kind of setting
BAD_VALUES: dict[str, list[str]] = {
    "int": ["abc", "-1"],
    "float": ["abc", "-1"],
    "bool": ["maybe"],
    "choice": ["loud"],
}
#: values of str/list settings a user might get wrong; the rank's behaviour is what is checked
#: (TNT_GLOO_SHM_HOST_ID and TNT_GLOO_CUDART have none on a CPU host: any string is taken)
BAD_STR: dict[str, list[str]] = {
    "TNT_BACKEND": ["nccl"],
    "TNT_RENDEZVOUS": ["nohost"],
    "TNT_RENDEZVOUS_KEY": [""],
    "TNT_TIMELINE": ["/dev/null/timeline.json"],  # a path no one can create, root neither
    "TNT_PLUGINS": ["no_such_plugin_module"],
    "TNT_DISABLE_PLUGINS": ["no_such_plugin"],
    "TNT_GLOO_IFACE": ["nope0"],
    "TNT_GLOO_HOSTNAME": ["no-such-host.invalid"],
}
#: out-of-range values beyond ``-1`` for settings with a declared rule
EXTRA: dict[str, list[str]] = {
    "TNT_GLOO_SHM_CHUNK_BYTES": ["100"],
    "TNT_GLOO_SHM_SPIN_US": ["2000000"],
    "TNT_TIMEOUT_S": ["0"],
    "TNT_SIZE": ["0"],
}
#: values that are right to accept, and why; "warns": a warning must name the variable
ACCEPTED = {
    ("TNT_DISABLE_PLUGINS", "no_such_plugin"): ("warns", "a one-line warning names the installed "
                                               "plugins: a site may disable one some nodes lack"),
}
#: settings read by tarantella (Keras) only: their jobs train a tiny model
KERAS_SETTINGS = {"TNT_TIMELINE"}
#: a message that names the value instead of the variable names the culprit too
VALUE_NAMED = {"TNT_BACKEND"}


def env_cases(tmp: Path) -> list[CliCase]:
    from tnt_cli.job import LAUNCHER_OWNED
    from tnt_core import installed_settings

    cases = []
    for name, var in installed_settings().variables.items():
        if var.group == "internal":
            continue
        values = list(BAD_VALUES.get(var.kind, [])) + BAD_STR.get(name, []) + EXTRA.get(name, [])
        if var.kind in ("int", "float") and var.minimum is None and var.above is None:
            values = [v for v in values if v != "-1"]
        backend = ["--backend", "mpi", "--launcher", "local"] if var.group == "mpi" else []
        timeout = [] if name == "TNT_TIMEOUT_S" else ["--timeout", str(JOB_TIMEOUT_S)]
        ok = str(tmp / ("fit_rank.py" if name in KERAS_SETTINGS else "ok_rank.py"))
        if name == "TNT_TIMELINE":  # a missing directory is made, as Keras' TensorBoard does
            values.append(str(tmp / "new-dir" / "timeline.json"))
        for value in values:
            names = (name, value) if name in VALUE_NAMED else (name,)
            warns, why = ACCEPTED.get((name, value), (False, ""))
            if value.startswith(str(tmp)):
                why = "the missing directory is created, as Keras' TensorBoard creates its log_dir"
            cases.append(CliCase(f"exported {name}={value!r}", ["-n", "2", *timeout, *backend, "--", ok],
                                 names, env={name: value}, warns=bool(warns),
                                 accepted_ok="tnt run sets it itself" if name in LAUNCHER_OWNED else why))
            cases.append(CliCase(f"-x {name}={value!r}",
                                 ["-n", "2", *timeout, *backend, "-x", f"{name}={value}", "--", ok],
                                 names, accepted_ok=why, warns=bool(warns)))
    return cases


def _verdict_cli(case: CliCase, code: int | None, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    why = []
    if case.own_error:
        deep = [ln for ln in lines if ln.strip().startswith("File ") and any(p in ln for p in LIBS)]
        if code in (0, None):
            why.append(f"exit {code}")
        if not any(n in err for n in case.names):
            why.append(f"the script's error ({case.names[0]}) is not shown")
        if not (lines and lines[-1].startswith("tnt run: rank ") and "failed" in lines[-1]):
            why.append("tnt run's last line does not name the failed rank")
        if deep:
            why.append(f"{len(deep)} library frame(s) in the traceback")
        return "clear (the script's own error, then tnt run names the rank)" if not why else (
            "✗ " + "; ".join(why))
    if code is None:
        why.append(f"did not end within {CASE_TIMEOUT_S} s")
    elif code == 0:
        if case.accepted_ok and case.warns and not any(n in err for n in case.names):
            return f"✗ accepted without the warning that names {case.names[0]}"
        if case.accepted_ok:
            return f"fine: accepted ({case.accepted_ok})"
        why.append("accepted: exit 0" + (", no message" if not lines else ""))
    if "Traceback (most recent call last)" in err:
        deep = [ln for ln in err.splitlines()
                if ln.strip().startswith("File ") and any(p in ln for p in LIBS)]
        if deep:
            why.append(f"traceback with {len(deep)} library frame(s)")
    if lines and not any(n.lower() in first.lower() for n in case.names):
        why.append(f"first line does not name {case.names[0]}")
    if lines and first.lower().startswith(("warning", "tnt run: warning")):
        why.append("first line is a warning")
    return "clear" if not why else "✗ " + "; ".join(why)


def run_cli(cases: list[CliCase], tmp: Path, kind: str) -> list[Row]:
    rows = []
    for case in cases:
        argv = [TNT, *(["run"] if case.program == "run" else []), *case.args]
        shown = " ".join([("tnt run" if case.program == "run" else "tnt"),
                          *(a.replace(str(tmp) + "/", "").replace(str(tmp), "DIR") if a else "''"
                            for a in case.args)])
        if case.env:
            shown = " ".join(f"{k}={v!r}" for k, v in case.env.items()) + " " + shown
        code, _, err = _run(argv, env=_clean_env(**(case.env or {})), cwd=tmp)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        tb = "yes" if "Traceback (most recent call last)" in err else "no"
        rows.append(Row(kind, case.name, shown, "timeout" if code is None else str(code),
                        lines[0] if lines else "(nothing)", tb, _verdict_cli(case, code, err)))
        print(rows[-1].markdown(), flush=True)
    return rows


# -- the APIs: cases run inside one process, each reported as one JSON line ------------------------

HARNESS = r'''
import json, os, sys, traceback

INSIDE = ("/tarantella/", "/tnt_core/", "/tnt_comm_", "/keras/", "/tensorflow/", "/numpy/",
          "/site-packages/")
OUT = open(os.environ["BI_OUT"] + "." + os.environ.get("TNT_RANK", "0"), "w")


def same_as_keras(call, rtol=1e-5):
    """A case plain Keras accepts: ``call(model)`` on a tnt.Model must give plain Keras'
    weights and result (AssertionError with the difference otherwise)."""
    import keras, numpy as np, tarantella as tnt

    def run(wrap):
        keras.utils.set_random_seed(1)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        m = tnt.Model(m) if wrap else m
        m.compile(optimizer="sgd", loss="mse")
        out = call(m)
        out = out.history if hasattr(out, "history") else out
        flat = [np.ravel(np.asarray(v, "float64")) for v in keras.tree.flatten(out)]
        return np.concatenate([np.ravel(w) for w in m.get_weights()] + flat)

    def check():
        serial, dist = run(False), run(True)
        if serial.shape != dist.shape or not np.allclose(dist, serial, rtol=rtol, atol=0):
            raise AssertionError(f"differs from plain Keras: {dist[:6]} vs {serial[:6]}")
    return check


def report(name, snippet, fn, *, names=(), ok=""):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        frames = traceback.extract_tb(exc.__traceback__)
        inside = sum(1 for f in frames if any(p in f.filename for p in INSIDE))
        chained = exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__)
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        rec = {"line": line, "inside": inside, "frames": len(frames), "chained": chained, "raised": True}
    else:
        rec = {"line": "(no error)", "inside": 0, "frames": 0, "chained": False, "raised": False}
    rec.update(case=name, snippet=snippet, names=list(names), ok=ok)
    OUT.write(json.dumps(rec) + "\n")
    OUT.flush()
'''

KERAS_CASES = r'''
import numpy as np
import keras
import tarantella as tnt
import tensorflow as tf

x, y = np.ones((16, 4), "float32"), np.ones((16, 2), "float32")
def model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
def compiled():
    m = tnt.Model(model()); m.compile(optimizer="sgd", loss="mse"); return m
def subclass_instance():
    class M(tnt.Model):
        pass
    return M()
def reg_sum_loss():
    m = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, kernel_regularizer="l2")]))
    m.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    m.fit(x, y, batch_size=8, verbose=0)
def direct_train_step():
    m = compiled(); m.fit(x, y, batch_size=8, verbose=0)
    m.train_step((tf.constant(x[:8]), tf.constant(y[:8])))
def wrong_weights():
    m = compiled(); m.set_weights([np.ones((3, 3))])
def bad_keras_file():
    open("not_a_model.keras", "w").write("hello")
    tnt.models.load_model("not_a_model.keras")
def fit_strings():
    compiled().fit(np.array([["a"] * 4] * 16), y, verbose=0)

# (name, snippet, call, words a clear message names)
C = [
    ("tnt.Model() without a model", "tnt.Model()", lambda: tnt.Model(), ("model",)),
    ("tnt.Model of a layer", "tnt.Model(keras.layers.Dense(2))", lambda: tnt.Model(keras.layers.Dense(2)), ("Dense", "keras.Model")),
    ("tnt.Model of a path", "tnt.Model('model.keras')", lambda: tnt.Model("model.keras"), ("str", "keras.Model")),
    ("tnt.Model of the class", "tnt.Model(keras.Sequential)", lambda: tnt.Model(keras.Sequential), ("type", "instance", "class")),
    ("tnt.Model unknown kwarg", "tnt.Model(m, bogus=1)", lambda: tnt.Model(model(), bogus=1), ("bogus",)),
    ("tnt.Model Keras-style kwargs", "tnt.Model(inputs=i, outputs=o)", lambda: tnt.Model(inputs=keras.Input((4,)), outputs=None), ("inputs",)),
    ("tnt.Model parallel_strategy='pipeline'", "tnt.Model(m, parallel_strategy='pipeline')", lambda: tnt.Model(model(), parallel_strategy="pipeline"), ("pipeline",)),
    ("tnt.Model two positional strategies", "tnt.Model(m, 'data', 3)", lambda: tnt.Model(model(), "data", 3), ("argument",)),
    ("subclassing tnt.Model", "class M(tnt.Model): ...; M()", subclass_instance, ("subclass",)),
    ("fit before compile", "tnt.Model(m).fit(x, y)", lambda: tnt.Model(model()).fit(x, y), ("compile",)),
    ("evaluate before compile", "tnt.Model(m).evaluate(x, y)", lambda: tnt.Model(model()).evaluate(x, y), ("compile",)),
    ("train_on_batch before compile", "tnt.Model(m).train_on_batch(x, y)", lambda: tnt.Model(model()).train_on_batch(x, y), ("compile",)),
    ("compile unknown optimizer", "m.compile(optimizer='sgdd', loss='mse')", lambda: tnt.Model(model()).compile(optimizer="sgdd", loss="mse"), ("sgdd",)),
    ("compile unknown loss, then fit", "m.compile(loss='msee'); m.fit(x, y)", lambda: (lambda m: (m.compile(optimizer="sgd", loss="msee"), m.fit(x, y, verbose=0)))(tnt.Model(model())), ("msee",)),
    ("compile a TF1 optimizer", "m.compile(optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))", lambda: tnt.Model(model()).compile(optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1), loss="mse"), ("optimizer",)),
    ("sum loss + regularizer", "loss=MSE(reduction='sum'), kernel_regularizer='l2'; fit", reg_sum_loss, ("reduction",)),
    ("fit x/y lengths differ", "m.fit(x[16], y[5])", lambda: compiled().fit(x, y[:5], verbose=0), ("16", "5")),
    ("fit wrong feature shape", "m.fit(ones((16, 3)), y)", lambda: compiled().fit(np.ones((16, 3), "float32"), y, verbose=0), ("shape",)),
    ("fit string data", "m.fit(strings, y)", fit_strings, ("str", "string", "dtype")),
    ("fit a file name as x", "m.fit('data.csv', y)", lambda: compiled().fit("data.csv", y, verbose=0), ("str", "data.csv")),
    ("fit validation_split=1.5", "m.fit(x, y, validation_split=1.5)", lambda: compiled().fit(x, y, validation_split=1.5, verbose=0), ("validation_split",)),
    ("fit validation_data of 4", "m.fit(x, y, validation_data=(x, y, y, y))", lambda: compiled().fit(x, y, validation_data=(x, y, y, y), verbose=0), ("validation_data",)),
    ("fit batch_size=0", "m.fit(x, y, batch_size=0)", lambda: compiled().fit(x, y, batch_size=0, verbose=0), ("batch",)),
    ("fit batch_size=-4", "m.fit(x, y, batch_size=-4)", lambda: compiled().fit(x, y, batch_size=-4, verbose=0), ("batch",)),
    ("fit batch_size='32'", "m.fit(x, y, batch_size='32')", lambda: compiled().fit(x, y, batch_size="32", verbose=0), ("batch",)),
    ("fit epochs='3'", "m.fit(x, y, epochs='3')", lambda: compiled().fit(x, y, epochs="3", verbose=0), ("epochs",)),
    ("fit steps_per_epoch=0", "m.fit(x, y, steps_per_epoch=0)", lambda: compiled().fit(x, y, steps_per_epoch=0, verbose=0), ("steps_per_epoch",)),
    ("fit sample_weight wrong length", "m.fit(x, y, sample_weight=ones(3))", lambda: compiled().fit(x, y, sample_weight=np.ones(3), verbose=0), ("sample_weight", "3")),
    ("fit dataset + batch_size", "m.fit(ds.batch(8), batch_size=4)", lambda: compiled().fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), batch_size=4, verbose=0), ("batch_size",)),
    ("fit unbatched dataset", "m.fit(Dataset.from_tensor_slices((x, y)))", lambda: compiled().fit(tf.data.Dataset.from_tensor_slices((x, y)), verbose=0), ("batch",)),
    ("fit tnt_micro_batch_size=0", "m.fit(x, y, tnt_micro_batch_size=0)", lambda: compiled().fit(x, y, tnt_micro_batch_size=0, verbose=0), ("tnt_micro_batch_size",)),
    ("fit micro x ranks != batch_size", "m.fit(x, y, batch_size=10, tnt_micro_batch_size=4)", lambda: compiled().fit(x, y, batch_size=10, tnt_micro_batch_size=4, verbose=0), ("tnt_micro_batch_size",)),
    ("fit unknown kwarg", "m.fit(x, y, bogus=1)", lambda: compiled().fit(x, y, bogus=1), ("bogus",)),
    ("evaluate unknown kwarg", "m.evaluate(x, y, bogus=1)", lambda: compiled().evaluate(x, y, bogus=1), ("bogus",)),
    ("predict wrong shape", "m.predict(ones((4, 7)))", lambda: compiled().predict(np.ones((4, 7), "float32"), verbose=0), ("shape",)),
    ("train_on_batch class_weight + sample_weight", "m.train_on_batch(x, y, class_weight=..., sample_weight=...)", lambda: compiled().train_on_batch(x, y, class_weight={0: 1.0}, sample_weight=np.ones(16)), ("class_weight",)),
    ("calling train_step directly", "m.train_step((x, y))", direct_train_step, ("train_step", "fit")),
    ("set_weights wrong shapes", "m.set_weights([ones((3, 3))])", wrong_weights, ("shape", "weights")),
    ("callbacks not a list", "m.fit(x, y, callbacks=EarlyStopping())", same_as_keras(lambda m: m.fit(x, y, epochs=3, verbose=0, callbacks=keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=0))), (), "as plain Keras, which takes a single callback"),
    ("callbacks=[42]", "m.fit(x, y, callbacks=[42])", lambda: compiled().fit(x, y, verbose=0, callbacks=[42]), ("callback", "int")),
    ("tnt Callback(42)", "tnt.keras.callbacks.Callback(42)", lambda: tnt.keras.callbacks.Callback(42), ("callback", "int")),
    ("tnt Callback(class)", "tnt.keras.callbacks.Callback(keras.callbacks.EarlyStopping)", lambda: tnt.keras.callbacks.Callback(keras.callbacks.EarlyStopping), ("instance", "class", "type")),
    ("tnt Callback() without a callback", "tnt.keras.callbacks.Callback()", lambda: tnt.keras.callbacks.Callback(), ("callback",)),
    ("tnt Callback run_on_all_ranks='no'", "Callback(cb, run_on_all_ranks='no')", lambda: tnt.keras.callbacks.Callback(keras.callbacks.History(), run_on_all_ranks="no"), ("run_on_all_ranks",)),
    ("tnt Callback unknown kwarg", "Callback(cb, on_all_ranks=False)", lambda: tnt.keras.callbacks.Callback(keras.callbacks.History(), on_all_ranks=False), ("on_all_ranks",)),
    ("load_model of a missing file", "tnt.models.load_model('/nonexistent/m.keras')", lambda: tnt.models.load_model("/nonexistent/m.keras"), ("/nonexistent/m.keras",)),
    ("load_model of a non-model file", "tnt.models.load_model('not_a_model.keras')", bad_keras_file, ("not_a_model.keras", "zip")),
    ("save into a missing directory", "m.save('/nonexistent/dir/m.keras')", lambda: compiled().save("/nonexistent/dir/m.keras"), ("/nonexistent/dir",)),
    ("save with a wrong suffix", "m.save('model.txt')", lambda: compiled().save("model.txt"), (".keras",)),
    ("save_weights with a wrong suffix", "m.save_weights('w.h5')", lambda: compiled().save_weights("w.h5"), (".weights.h5",)),
    ("load_weights of a missing file", "m.load_weights('/nonexistent/w.weights.h5')", lambda: compiled().load_weights("/nonexistent/w.weights.h5"), ("/nonexistent/w.weights.h5",)),
    ("tnt_core.init switching backend", "tnt_core.init('gloo') after import tarantella", lambda: __import__("tnt_core").init("gloo"), ("gloo",)),
]
for name, snippet, fn, names, *ok in C:
    report(name, snippet, fn, names=names, ok=ok[0] if ok else "")
'''  # noqa: E501 (the cases of one rank-side script, one per line)

TWO_RANK_KERAS_CASES = r'''
import numpy as np
import keras
import tarantella as tnt
import tensorflow as tf

x, y = np.ones((16, 4), "float32"), np.ones((16, 2), "float32")
SERIAL = "the plain Keras result: ranks without a sample take part with weight 0"
def compiled():
    m = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    m.compile(optimizer="sgd", loss="mse"); return m
C = [
    ("fit global batch 1 on 2 ranks", "m.fit(x, y, batch_size=1)", same_as_keras(lambda m: m.fit(x, y, batch_size=1, verbose=0)), (), SERIAL),
    ("fit dataset batched 1 on 2 ranks", "m.fit(ds.batch(1))", same_as_keras(lambda m: m.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(1), verbose=0)), (), SERIAL),
    ("evaluate global batch 1 on 2 ranks", "m.evaluate(x, y, batch_size=1)", same_as_keras(lambda m: m.evaluate(x, y, batch_size=1, verbose=0)), (), SERIAL),
    ("train_on_batch of 1 row on 2 ranks", "m.train_on_batch(x[:1], y[:1])", same_as_keras(lambda m: m.train_on_batch(x[:1], y[:1])), (), SERIAL),
    ("fit micro x 2 ranks != batch_size", "m.fit(x, y, batch_size=10, tnt_micro_batch_size=4)", lambda: compiled().fit(x, y, batch_size=10, tnt_micro_batch_size=4, verbose=0), ("tnt_micro_batch_size",)),
    ("fit 3 samples, batch 2 on 2 ranks", "m.fit(x[:3], y[:3], batch_size=2)", same_as_keras(lambda m: m.fit(x[:3], y[:3], batch_size=2, verbose=0)), (), SERIAL),
]
for name, snippet, fn, names, *ok in C:
    report(name, snippet, fn, names=names, ok=ok[0] if ok else "")
'''  # noqa: E501 (the cases of one rank-side script, one per line)

CORE_CASES = r'''
import numpy as np
import tnt_core

def read_only():
    b = np.ones(4, "float32"); b.setflags(write=False); return b
def works():
    r = b.allreduce(np.ones(4, "float32"))
    if r[0] != rt.size:
        raise AssertionError(f"allreduce gave {r}")
C = [
    ("init an unknown backend", "tnt_core.init(backend='nccl')", lambda: tnt_core.init(backend="nccl"), ("nccl",)),
    ("init a backend that cannot serve", "tnt_core.init(backend='local') on 2 ranks", lambda: tnt_core.init(backend="local"), ("local",)),
    ("init backend=42", "tnt_core.init(backend=42)", lambda: tnt_core.init(backend=42), ("42", "backend")),
]
for name, snippet, fn, names, *ok in C:
    report(name, snippet, fn, names=names, ok=ok[0] if ok else "")
rt = tnt_core.init()
b = rt.backend
other = "mpi" if b.name != "mpi" else "gloo"
R = rt.rank
C = [
    ("init another backend while running", f"tnt_core.init('{other}') after init()", lambda: tnt_core.init(other), (other,)),
    ("allreduce of a list", "b.allreduce([1.0, 2.0])", lambda: b.allreduce([1.0, 2.0]), ("ndarray", "list")),
    ("allreduce of a scalar", "b.allreduce(3.0)", lambda: b.allreduce(3.0), ("ndarray", "float")),
    ("allreduce of strings", "b.allreduce(np.array(['a']))", lambda: b.allreduce(np.array(["a", "b"])), ("dtype",)),
    ("allreduce of bool", "b.allreduce(np.ones(4, bool))", lambda: b.allreduce(np.ones(4, bool)), ("dtype", "bool")),
    ("allreduce of uint8", "b.allreduce(np.ones(4, 'uint8'))", lambda: b.allreduce(np.ones(4, "uint8")), ("dtype", "uint8")),
    ("allreduce of complex128", "b.allreduce(np.ones(4, complex))", lambda: b.allreduce(np.ones(4, complex)), ("dtype", "complex")),
    ("allreduce of a read-only buffer", "b.allreduce(read_only)", lambda: b.allreduce(read_only()), ("read-only",)),
    ("allreduce of a strided view", "b.allreduce(np.ones(8)[::2])", lambda: b.allreduce(np.ones(8, "float32")[::2]), ("contiguous",)),
    ("allreduce of a Fortran 2-D array", "b.allreduce(np.ones((3, 4), order='F'))", lambda: b.allreduce(np.ones((3, 4), "float32", order="F")), ("contiguous",)),
    ("allreduce op='avg'", "b.allreduce(x, op='avg')", lambda: b.allreduce(np.ones(4, "float32"), op="avg"), ("avg",)),
    ("allreduce op='SUM'", "b.allreduce(x, op='SUM')", lambda: b.allreduce(np.ones(4, "float32"), op="SUM"), ("SUM",)),
    ("broadcast root=5 of 2 ranks", "b.broadcast(x, root=5)", lambda: b.broadcast(np.ones(4, "float32"), root=5), ("root", "5")),
    ("broadcast root=-1", "b.broadcast(x, root=-1)", lambda: b.broadcast(np.ones(4, "float32"), root=-1), ("root", "-1")),
    ("broadcast root='0'", "b.broadcast(x, root='0')", lambda: b.broadcast(np.ones(4, "float32"), root="0"), ("root",)),
    ("broadcast of a read-only buffer", "b.broadcast(read_only)", lambda: b.broadcast(read_only()), ("read-only",)),
    ("allgather of a list", "b.allgather([1, 2])", lambda: b.allgather([1, 2]), ("ndarray", "list")),
    ("allgather of objects", "b.allgather(np.array([None]))", lambda: b.allgather(np.array([None, 1])), ("dtype", "object")),
]
for name, snippet, fn, names, *ok in C:
    report(name, snippet, fn, names=names, ok=ok[0] if ok else "")
report("the backend works after the mistakes", "b.allreduce(np.ones(4))", works)
# mistakes that may break the communicator: last
C = [
    ("allreduce: shapes differ between ranks", "b.allreduce(np.ones(4 + rank))", lambda: b.allreduce(np.ones(4 + R, "float32")), ("shape", "size", "differ")),
    ("allreduce: dtypes differ between ranks", "b.allreduce(np.ones(4, float32 if rank else float64))", lambda: b.allreduce(np.ones(4, "float32" if R else "float64")), ("dtype", "differ")),
    ("allgather: shapes differ between ranks", "b.allgather(np.ones(2 + rank))", lambda: b.allgather(np.ones(2 + R, "float32")), ("shape", "differ")),
    ("broadcast: roots differ between ranks", "b.broadcast(x, root=rank)", lambda: b.broadcast(np.ones(4, "float32"), root=R), ("root", "differ")),
    ("allreduce_async(...).wait(timeout=-1)", "b.allreduce_async(x).wait(timeout=-1)", lambda: b.allreduce_async(np.ones(4, "float32")).wait(timeout=-1), ("timeout",)),
]
for name, snippet, fn, names, *ok in C:
    report(name, snippet, fn, names=names, ok=ok[0] if ok else "")
'''  # noqa: E501 (the cases of one rank-side script, one per line)


def _api_rows(kind: str, label: str, records: dict[int, list[dict]], code: int | None,
              err: str) -> list[Row]:
    rows: list[Row] = []
    lines = [ln for ln in err.splitlines() if ln.strip()]
    by_case1 = {r["case"]: r for r in records.get(1, [])}
    for rec in records.get(0, []):
        why = []
        if not rec["raised"] and rec.get("ok"):
            rows.append(Row(kind, rec["case"], rec["snippet"], "-", "(no error)", "-",
                            f"fine: {rec['ok']}"))
            print(rows[-1].markdown(), flush=True)
            continue
        if rec.get("ok"):
            why.append(f"should give {rec['ok']}")
        if not rec["raised"]:
            why.append("accepted: no error")
        else:
            if rec["inside"] > MAX_FRAMES_INSIDE:
                why.append(f"{rec['inside']} frames inside the libraries")
            if rec["chained"]:
                why.append("a chained traceback ('During handling ...')")
            if rec["names"] and not any(n.lower() in rec["line"].lower() for n in rec["names"]):
                why.append(f"message does not name {rec['names'][0]!r}")
        other = by_case1.get(rec["case"])
        line = rec["line"]
        if other is not None and other["line"] != rec["line"]:
            line = f"rank 0: {rec['line']} / rank 1: {other['line']}"
        if rec["case"] == "the backend works after the mistakes":
            why = [] if not rec["raised"] else ["the backend broke: " + rec["line"]]
        tb = f"{rec['inside']} of {rec['frames']} frame(s) inside" if rec["raised"] else "-"
        rows.append(Row(kind, rec["case"], rec["snippet"], "exc" if rec["raised"] else "-", line, tb,
                        "clear" if not why else "✗ " + "; ".join(why)))
        print(rows[-1].markdown(), flush=True)
    if code not in (0,):  # the job itself ended badly (a case hung or killed a rank)
        rows.append(Row(kind, f"({label}: the job's end)", "", "timeout" if code is None else str(code),
                        lines[-1] if lines else "", "-",
                        "✗ the job did not end cleanly (see the line)" if code is None or not rows
                        else "(the job's exit after its cases)"))
        print(rows[-1].markdown(), flush=True)
    return rows


def _records(prefix: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for path in sorted(prefix.parent.glob(prefix.name + ".*")):
        rank = int(path.suffix[1:])
        out[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return out


def run_api(tmp: Path, which: set[str]) -> list[Row]:
    rows: list[Row] = []
    jobs: list[tuple[str, str, str, list[str]]] = []
    if "api" in which:
        jobs += [("API", "keras, 1 rank (python script.py)", KERAS_CASES, [sys.executable]),
                 ("API", "keras, 2 ranks (tnt run -n 2)", TWO_RANK_KERAS_CASES,
                  [TNT, "run", "-n", "2", "--timeout", "60", "--"])]
    if "core" in which:
        jobs += [("core API", "tnt_core on gloo (tnt run -n 2)", CORE_CASES,
                  [TNT, "run", "-n", "2", "--backend", "gloo", "--timeout", str(JOB_TIMEOUT_S), "--"]),
                 ("core API", "tnt_core on mpi (tnt run -n 2)", CORE_CASES,
                  [TNT, "run", "-n", "2", "--backend", "mpi", "--launcher", "local", "--timeout",
                   str(JOB_TIMEOUT_S), "--"])]
    for index, (kind, label, body, launch) in enumerate(jobs):
        script = tmp / f"api_{index}.py"
        script.write_text(HARNESS + body)
        prefix = tmp / f"api_{index}.out"
        code, _, err = _run([*launch, str(script)], env=_clean_env(BI_OUT=str(prefix)), cwd=tmp,
                            timeout=600)
        rows += [Row(kind, f"— {label} —", "", "", "", "", "")]
        print(rows[-1].markdown(), flush=True)
        rows += _api_rows(kind, label, _records(prefix), code, err)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown table to this path")
    parser.add_argument("--only", default="cli,env,api,core",
                        help="comma-separated parts to run: cli, env, api (Keras), core (tnt_core)")
    args = parser.parse_args()
    which = {w.strip() for w in args.only.split(",")}
    atexit.register(_kill_started)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    started = time.monotonic()
    print("\n".join(HEADER), flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="relbad-") as name, socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        tmp = Path(name)
        cli = cli_cases(tmp, busy.getsockname()[1])
        if "cli" in which:
            rows += run_cli(cli, tmp, "CLI")
        if "env" in which:
            rows += run_cli(env_cases(tmp), tmp, "TNT_*")
        rows += run_api(tmp, which)
    cases = [r for r in rows if r.command]
    bad = [r for r in cases if r.verdict.startswith("✗")]
    summary = (f"\n{len(cases)} cases, {len(cases) - len(bad)} clear or fine, {len(bad)} ✗, "
               f"{time.monotonic() - started:.0f} s in all")
    print(summary, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(HEADER + [r.markdown() for r in rows]) + "\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
