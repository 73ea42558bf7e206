"""The resume soak: 4 ranks train for ~30 minutes on this machine while one rank is killed
(SIGKILL) three times; each time the job is started again and resumes from Keras'
BackupAndRestore. Next to it, the same training runs uninterrupted. The final weights
must be equal.

    python ci/reliability/soak_resume.py --epochs 380 --kill-epochs 95,190,285 --work /tmp/soak

(the defaults: 36 minutes on a 2-core machine, both runs side by side)

Prints one line per attempt (how long it ran, its exit code, tnt run's last line) and the
largest difference between the two final weight sets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TNT = str(Path(sys.executable).parent / "tnt")


def attempt(work: Path, name: str, epochs: int, kill_epochs: str, log: list[str]) -> int:
    out = work / f"{name}.npz"
    cmd = [TNT, "run", "-n", "4", "--backend", "gloo", "--", str(HERE / "soak_train.py"),
           "--backup", str(work / name), "--out", str(out), "--epochs", str(epochs),
           "--kill-epochs", kill_epochs]
    start = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    lines = [line for line in res.stderr.splitlines() if line.startswith("tnt run:")]
    done = [line for line in res.stdout.splitlines() if line.startswith("done:")]
    log.append(f"| {name} | {time.monotonic() - start:.0f} s | {res.returncode} | "
               f"{(lines or done or [''])[-1][:150]} |")
    print(log[-1], flush=True)
    return res.returncode


def run(work: Path, name: str, epochs: int, kill_epochs: str, log: list[str]) -> None:
    (work / name).mkdir(parents=True, exist_ok=True)
    for _ in range(len([e for e in kill_epochs.split(",") if e]) + 2):
        if attempt(work, name, epochs, kill_epochs, log) == 0:
            return
    raise SystemExit(f"{name}: did not finish")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=380)
    parser.add_argument("--kill-epochs", default="95,190,285")
    parser.add_argument("--work", default="/tmp/tnt-soak")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = ["| run | took | exit code | tnt run's last line |", "|---|---|---|---|"]
    start = time.monotonic()
    runs = [threading.Thread(target=run, args=(work, "uninterrupted", args.epochs, "", log)),
            threading.Thread(target=run, args=(work, "killed", args.epochs, args.kill_epochs, log))]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    a, b = np.load(work / "uninterrupted.npz"), np.load(work / "killed.npz")
    diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)
    kills = sorted(p.name for p in (work / "killed").glob("killed-at-epoch-*"))
    print("\n".join(log))
    print(f"total {time.monotonic() - start:.0f} s; kills: {', '.join(kills)}; "
          f"largest |difference| of the final weights: {diff:.3g}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if diff == 0.0 and len(kills) == len(args.kill_epochs.split(",")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
