"""All checks of one rank in one process: TensorFlow is imported once per rank.

``python suite_worker.py --mode serial|tnt --out DIR`` runs ``dataset_worker`` (into
``DIR/data``), ``train_worker`` (``DIR/train``), ``fidelity_worker`` (``DIR/fidelity``),
``loop_worker`` (``DIR/loops``; on 3 ranks only), ``xla_worker`` (``DIR/xla``; 2-rank
launches only) and ``features_worker`` (``DIR/features``; it changes the working directory)
with the same arguments (``--parts`` picks some of them, ``--fidelity-cases`` some of
fidelity_worker's cases); ``--mode serial`` also ``pipeline_resume_worker``
(``DIR/pipeline_resume``), whose tarantella side is a launch of its own.
``--also channel,small_batches,callback_logs,collectives`` (``--mode tnt``) then runs the
workers that compare within the rank or against NumPy or plain Keras in the rank's own
process, and so have no serial part: ``channel_worker``
(``DIR/channel``), ``small_batch_worker`` (``DIR/small_batches``), ``callback_logs_worker``
(``DIR/callback_logs``) and ``user_collectives_worker`` (``DIR/collectives``; last, since its
refusal cases make the ranks disagree on purpose).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dataset_worker
import features_worker
import fidelity_worker
import loop_worker
import pipeline_resume_worker
import train_worker
import xla_worker

#: the parts every launch and the serial run can run -> modules, in the order they run
#: (features last: it changes the working directory)
PARTS = {"data": dataset_worker, "train": train_worker, "fidelity": fidelity_worker,
         "loops": loop_worker, "xla": xla_worker, "features": features_worker}
#: ``--also`` names -> modules; imported only when asked for: they import tarantella, which
#: the plain-Keras serial process never does
ALSO = {"channel": "channel_worker", "small_batches": "small_batch_worker",
        "callback_logs": "callback_logs_worker",
        "collectives": "user_collectives_worker", "elastic_agree": "elastic_agree_worker"}


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """One line per part: its wall and CPU time (the suite's budget is CPU: ranks of several
    launches share two cores)."""
    start, cpu = time.monotonic(), time.process_time()
    yield
    print(f"suite: {name} done in {time.monotonic() - start:.1f} s, "
          f"{time.process_time() - cpu:.1f} CPU-s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("serial", "tnt"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--also", default="", help=f"comma-separated, of {sorted(ALSO)} (--mode tnt)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {list(PARTS)} (default: all)")
    parser.add_argument("--fidelity-cases", default="",
                        help="comma-separated cases of fidelity_worker (default: all)")
    args = parser.parse_args()
    also = [name for name in args.also.split(",") if name]
    unknown = sorted(set(also) - set(ALSO))
    if unknown or (also and args.mode == "serial"):
        parser.error(f"--also takes {sorted(ALSO)} with --mode tnt, not {also}")
    parts = [name for name in args.parts.split(",") if name]
    if set(parts) - set(PARTS):
        parser.error(f"--parts takes {list(PARTS)}, not {parts}")
    cases = [name for name in args.fidelity_cases.split(",") if name]
    if set(cases) - set(fidelity_worker.CASES):
        parser.error(f"--fidelity-cases takes {list(fidelity_worker.CASES)}, not {cases}")
    out = os.path.abspath(args.out)
    for name in [name for name in PARTS if name in parts]:
        extra = ["--only", ",".join(cases)] if name == "fidelity" and cases else []
        with timed(name):
            PARTS[name].main(["--mode", args.mode, "--out", os.path.join(out, name), *extra])
    if args.mode == "serial":  # its tnt side is a launch of its own (tnt run --max-restarts)
        with timed("pipeline_resume"):
            pipeline_resume_worker.main(["serial", os.path.join(out, "pipeline_resume")])
    for name in also:
        with timed(name):
            importlib.import_module(ALSO[name]).main(["--out", os.path.join(out, name)])


if __name__ == "__main__":
    main()
