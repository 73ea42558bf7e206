"""All checks of one rank in one process: TensorFlow is imported once per rank.

``python suite_worker.py --mode serial|tnt --out DIR`` runs ``dataset_worker`` (into
``DIR/data``), ``train_worker`` (``DIR/train``), ``fidelity_worker`` (``DIR/fidelity``),
``loop_worker`` (``DIR/loops``; on 3 ranks only), ``xla_worker`` (``DIR/xla``; 2-rank
launches only) and ``features_worker`` (``DIR/features``; last, because it changes the
working directory) with the same arguments.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dataset_worker
import features_worker
import fidelity_worker
import loop_worker
import train_worker
import xla_worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("serial", "tnt"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    for name, worker in (("data", dataset_worker), ("train", train_worker),
                         ("fidelity", fidelity_worker), ("loops", loop_worker), ("xla", xla_worker),
                         ("features", features_worker)):
        worker.main(["--mode", args.mode, "--out", os.path.join(out, name)])
        print(f"suite: {name} done", flush=True)


if __name__ == "__main__":
    main()
