"""The bad-input table: what a user sees first after a mistake, for 80+ mistakes.

Three kinds: ``tnt run`` command lines, ``TNT_*`` values exported in the shell (every
declared variable, with a value of the wrong kind), and API calls (``tnt.Model``, ``fit``,
callbacks, the backend's collectives), run in one process each kind. For each case: the
exit code (CLI), the first line on stderr or the exception's last line, and whether a
Python traceback was printed (CLI) / how many frames it had inside tarantella, tnt_core or
keras (API).

    python ci/reliability/bad_inputs.py [--out table.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

TNT = str(Path(sys.executable).parent / "tnt")


def cli_cases(tmp: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    ok = tmp / "ok.py"
    ok.write_text("print('ran')\n")
    hosts = tmp / "hosts"
    hosts.write_text("nodeA\nnodeA\n")
    empty = tmp / "empty-hosts"
    empty.write_text("# nothing\n")
    s = str(ok)
    cases: list[tuple[str, list[str], dict[str, str]]] = [
        ("unknown option", ["--bogus", "--", s], {}),
        ("-n 0", ["-n", "0", "--", s], {}),
        ("-n -3", ["-n", "-3", "--", s], {}),
        ("-n four", ["-n", "four", "--", s], {}),
        ("-n 100000", ["-n", "100000", "--", s], {}),
        ("no script", ["-n", "2"], {}),
        ("no script after --", ["-n", "2", "--"], {}),
        ("script missing", ["-n", "2", "--", str(tmp / "missing.py")], {}),
        ("script is a directory", ["-n", "2", "--", str(tmp)], {}),
        ("script before --", [s, "--", "x"], {}),
        ("-x without =", ["-x", "NOEQUALS", "--", s], {}),
        ("-x bad name", ["-x", "1A=2", "--", s], {}),
        ("-x TNT_SIZE", ["-x", "TNT_SIZE=5", "--", s], {}),
        ("-x TNT_RANK", ["-x", "TNT_RANK=1", "--", s], {}),
        ("-x TNT_RENDEZVOUS", ["-x", "TNT_RENDEZVOUS=h:1", "--", s], {}),
        ("-x TNT_TIMEOUT_S=abc", ["-x", "TNT_TIMEOUT_S=abc", "--", s], {}),
        ("-x TNT_FUSION_THRESHOLD_KB=-1", ["-x", "TNT_FUSION_THRESHOLD_KB=-1", "--", s], {}),
        ("--timeout 0", ["--timeout", "0", "--", s], {}),
        ("--timeout abc", ["--timeout", "abc", "--", s], {}),
        ("--fusion-threshold -1", ["--fusion-threshold", "-1", "--", s], {}),
        ("--log-level loud", ["--log-level", "loud", "--", s], {}),
        ("unknown backend", ["--backend", "nccl", "--", s], {}),
        ("local backend, 2 ranks", ["-n", "2", "--backend", "local", "--", s], {}),
        ("unknown launcher", ["--launcher", "pbs", "--", s], {}),
        ("hostfile missing", ["--hostfile", str(tmp / "nope"), "--", s], {}),
        ("hostfile is a directory", ["--hostfile", str(tmp), "--", s], {}),
        ("hostfile lists a host twice", ["--hostfile", str(hosts), "--", s], {}),
        ("--force without --cleanup", ["--force", "--", s], {}),
        ("--python-interpreter missing", ["--python-interpreter", "nopython3", "--", s], {}),
        ("program not executable", ["--python-interpreter", "", "--", str(ok)], {}),
        ("--n-per-node 0", ["--n-per-node", "0", "--", s], {}),
        ("--rendezvous-port 70000", ["--rendezvous-port", "70000", "--", s], {}),
        ("empty hostfile", ["--hostfile", str(empty), "--", s], {}),
    ]
    return cases


ENV_BAD = {"int": "abc", "float": "abc", "bool": "maybe", "str": None, "choice": "loud"}


def env_cases(tmp: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    from tnt_cli.job import LAUNCHER_OWNED
    from tnt_core import VARIABLES

    ok = tmp / "ok.py"
    cases = []
    for name, var in VARIABLES.items():
        if name in LAUNCHER_OWNED or var.group == "internal":
            continue
        bad = "loud" if getattr(var, "choices", None) else ENV_BAD.get(var.kind)
        if bad is None:
            continue
        cases.append((f"exported {name}={bad}", ["-n", "2", "--", str(ok)], {name: bad}))
    return cases


def run_cli(cases: list[tuple[str, list[str], dict[str, str]]], tmp: Path) -> list[str]:
    rows = []
    for name, args, extra in cases:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
        env.update(extra)
        res = subprocess.run([TNT, "run", *args], capture_output=True, text=True, timeout=120,
                             env=env, cwd=tmp, stdin=subprocess.DEVNULL)
        first = (res.stderr.strip().splitlines() or [""])[0]
        traceback = "Traceback" in res.stderr
        clear = res.returncode != 0 and first.startswith("tnt run: error: ") and not traceback
        rows.append(f"| CLI | {name} | {res.returncode} | {first[:170].replace('|', '/')} | "
                    f"{'traceback' if traceback else 'one line'} | {'✓' if clear else '✗'} |")
        print(rows[-1], flush=True)
    return rows


API = r'''
import json, sys, traceback
import numpy as np
import keras
import tarantella as tnt
import tnt_core

def model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])

def compiled():
    m = tnt.Model(model()); m.compile(optimizer="sgd", loss="mse"); return m

def read_only():
    b = np.ones(3); b.setflags(write=False); return b

x, y = np.ones((16, 4), "float32"), np.ones((16, 2), "float32")
CASES = {
    "tnt.Model() without a model": lambda: tnt.Model(),
    "tnt.Model(a layer)": lambda: tnt.Model(keras.layers.Dense(2)),
    "tnt.Model(a function)": lambda: tnt.Model(print),
    "tnt.Model(m, bogus=1)": lambda: tnt.Model(model(), bogus=1),
    "tnt.Model(m, parallel_strategy='pipe')": lambda: tnt.Model(model(), parallel_strategy="pipe"),
    "subclass tnt.Model": lambda: type("M", (tnt.Model,), {})(),
    "fit before compile": lambda: tnt.Model(model()).fit(x, y),
    "fit with x and y of different lengths": lambda: compiled().fit(x, y[:5], verbose=0),
    "fit with a wrong feature shape": lambda: compiled().fit(np.ones((16, 3)), y, verbose=0),
    "fit with validation_split=1.5": lambda: compiled().fit(x, y, validation_split=1.5, verbose=0),
    "fit with validation_data of 4 items":
        lambda: compiled().fit(x, y, validation_data=(x, y, y, y), verbose=0),
    "fit with batch_size=0": lambda: compiled().fit(x, y, batch_size=0, verbose=0),
    "fit with a string as x": lambda: compiled().fit("data.csv", y, verbose=0),
    "fit with epochs='3'": lambda: compiled().fit(x, y, epochs="3", verbose=0),
    "evaluate with an unknown argument": lambda: compiled().evaluate(x, y, bogus=1),
    "train_on_batch with class_weight and sample_weight":
        lambda: compiled().train_on_batch(x, y, class_weight={0: 1.0}, sample_weight=np.ones(16)),
    "tnt.keras.callbacks.Callback(not a callback)": lambda: tnt.keras.callbacks.Callback(42),
    "compile with an unknown optimizer": lambda: tnt.Model(model()).compile(optimizer="sgdd", loss="mse"),
    "compile with an unknown loss": lambda: tnt.Model(model()).compile(optimizer="sgd", loss="msee"),
    "load_model of a missing file": lambda: tnt.models.load_model("/nonexistent/m.keras"),
    "save to a missing directory": lambda: compiled().save("/nonexistent/dir/m.keras"),
    "save with a wrong suffix": lambda: compiled().save("model.txt"),
    "init an unknown backend": lambda: (tnt_core.shutdown(), tnt_core.init("nccl")),
    "allreduce of a list": lambda: tnt_core.init().backend.allreduce([1.0, 2.0]),
    "allreduce of a read-only buffer": lambda: tnt_core.init().backend.allreduce(read_only()),
    "allreduce of strings": lambda: tnt_core.init().backend.allreduce(np.array(["a", "b"])),
    "allreduce with op='avg'": lambda: tnt_core.init().backend.allreduce(np.ones(3), "avg"),
    "broadcast from root 5": lambda: tnt_core.init().backend.broadcast(np.ones(3), root=5),
}
INSIDE = ("tarantella", "tnt_core", "keras", "tensorflow")
for name, case in CASES.items():
    try:
        case()
        line, deep = "(no error)", 0
    except BaseException as exc:
        tb = traceback.extract_tb(exc.__traceback__)
        deep = sum(1 for f in tb if any(f"/{p}/" in f.filename for p in INSIDE))
        line = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    print(json.dumps({"case": name, "line": line, "deep": deep}), flush=True)
'''

RANKS2 = r'''
import json, numpy as np, keras, tarantella as tnt
m = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
m.compile(optimizer="sgd", loss="mse")
try:
    m.fit(np.ones((16, 4)), np.ones((16, 2)), batch_size=1, verbose=0)
    line = "(no error)"
except Exception as exc:
    line = f"{type(exc).__name__}: {exc}".splitlines()[0]
if tnt.get_rank() == 0:
    print(json.dumps({"case": "fit with a global batch of 1 on 2 ranks", "line": line, "deep": 0}))
'''


#: no error, as in plain Keras (checked: batch_size=0 trains; an unknown loss name fails
#: at fit, not at compile). A global batch smaller than the ranks trains too (a rank gets
#: no sample in a step); this script does not compare that case with serial training
AS_PLAIN_KERAS = {"fit with batch_size=0", "compile with an unknown loss",
                  "fit with a global batch of 1 on 2 ranks"}


def run_api(tmp: Path) -> list[str]:
    import json

    rows = []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    (tmp / "api.py").write_text(API)
    (tmp / "two.py").write_text(RANKS2)
    outs = [subprocess.run([sys.executable, str(tmp / "api.py")], capture_output=True, text=True,
                           timeout=600, env=env, cwd=tmp).stdout,
            subprocess.run([TNT, "run", "-n", "2", "--", str(tmp / "two.py")], capture_output=True,
                           text=True, timeout=600, env=env, cwd=tmp).stdout]
    for out in outs:
        for raw in out.splitlines():
            if not raw.startswith("{"):
                continue
            case = json.loads(raw)
            if case["case"] in AS_PLAIN_KERAS and case["line"] == "(no error)":
                verdict = "as plain Keras"
            else:
                verdict = "✓" if case["line"] != "(no error)" and case["deep"] <= 4 else "✗"
            rows.append(f"| API | {case['case']} | - | {case['line'][:170].replace('|', '/')} | "
                        f"{case['deep']} frame(s) inside | {verdict} |")
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    head = ["| kind | mistake | exit | first line the user sees | traceback | clear |",
            "|---|---|---|---|---|---|"]
    print("\n".join(head), flush=True)
    with tempfile.TemporaryDirectory(prefix="tnt-bad-") as name:
        tmp = Path(name)
        rows = head + run_cli(cli_cases(tmp) + env_cases(tmp), tmp) + run_api(tmp)
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")
    print(textwrap.dedent(f"""
        {len(rows) - 2} cases, {sum('✗' in r for r in rows)} not clear"""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
