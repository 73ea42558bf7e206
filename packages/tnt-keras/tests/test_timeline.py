"""``TNT_TIMELINE``: every rank writes a Chrome trace of its steps, and it shows overlap.

2 ranks train ``workers/timeline_worker.py`` (see there why its overlap is deterministic).
Each trace must be valid JSON with, per step, one ``backprop`` span, one ``optimizer apply``
span and one span per fusion bucket; the optimizer runs after every bucket is back; and a
gradient (float32) bucket's allreduce starts before backprop ends — the point of overlap.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tnt_keras_helpers import BACKENDS, run_workers

STEPS = 8


@pytest.fixture(scope="module", params=[b for b in BACKENDS if b != "store"][:1] or BACKENDS[:1])
def traces(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline")
    run_workers("timeline_worker.py", [str(STEPS)], 2, request.param,
                env={"TNT_TIMELINE": str(out / "trace.json"), "TNT_FUSION_THRESHOLD_KB": "0",
                     "TNT_NUM_THREADS": "1"})
    return [json.loads((out / name).read_text()) for name in ("trace.json", "trace.rank1.json")]


def _spans(trace, name):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith(name)]


def test_every_rank_writes_a_trace_with_all_activities(traces):
    for rank, trace in enumerate(traces):
        assert {e["pid"] for e in trace["traceEvents"]} == {rank}
        lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert {"backprop", "optimizer", "bucket 0"} <= lanes
        assert len(_spans(trace, "backprop")) == STEPS
        assert len(_spans(trace, "optimizer apply")) == STEPS
        buckets = _spans(trace, "allreduce bucket")
        # 6 gradients (3 kernels, 3 biases) at threshold 0: 6 buckets (the metric states are
        # summed by their own small allreduce after the step)
        assert len(buckets) == 6 * STEPS
        assert {e["args"]["dtype"] for e in buckets} == {"float32"}


def _steps(trace):
    """Per step: (backprop span, its bucket spans, optimizer span), in time order."""
    backprops = sorted(_spans(trace, "backprop"), key=lambda e: e["ts"])
    optimizers = sorted(_spans(trace, "optimizer apply"), key=lambda e: e["ts"])
    by_step = defaultdict(list)
    for e in _spans(trace, "allreduce bucket"):  # a bucket belongs to the next optimizer apply
        by_step[next(i for i, o in enumerate(optimizers) if o["ts"] >= e["ts"])].append(e)
    return [(b, by_step[i], o) for i, (b, o) in enumerate(zip(backprops, optimizers))]


def test_allreduce_overlaps_backprop_and_optimizer_waits_for_it(traces):
    for trace in traces:
        overlapped = 0
        for backprop, buckets, optimizer in _steps(trace):
            backprop_end = backprop["ts"] + backprop["dur"]
            grads = [e for e in buckets if e["args"]["dtype"] == "float32"]
            assert len(grads) == 6
            if min(e["ts"] for e in grads) < backprop_end:
                overlapped += 1
            last_done = max(e["ts"] + e["dur"] for e in buckets)
            assert optimizer["ts"] >= last_done - 1.0  # µs; the optimizer applies after all
        # by construction (see the worker) nearly every step shows it; ask for most
        assert overlapped >= STEPS - 2, f"only {overlapped}/{STEPS} steps overlapped"
