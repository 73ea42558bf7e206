"""What the micro-benchmarks that time TensorFlow calls on one CPU share: their timing
arguments, and TensorFlow started held to that CPU with one intra-op thread (as the
benchmark models' processes run), so that interleaved rounds compare like with like."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser, repeats: int, calls: int) -> None:
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved timed rounds")
    parser.add_argument("--calls", type=int, default=calls, help="calls per round")
    parser.add_argument("--pin", type=int, default=None, help="hold the process to this CPU")


def start_tensorflow(args: argparse.Namespace, inter_op_threads: int):
    """Hold the process to ``--pin`` (before TensorFlow starts a thread), quiet TensorFlow's
    C++ start-up lines, and return the ``tensorflow`` module with its thread pools set."""
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    return tf
