"""Handles stamp their completion on the perf_counter clock, so timelines (TNT_TIMELINE)
show when each bucket's allreduce really finished, not when somebody waited for it."""

from pathlib import Path

from tnt_core.testing import launch_ranks

WORKER = Path(__file__).with_name("_completion_time_worker.py")


def test_completion_time_lies_between_issue_and_wait_return():
    result = launch_ranks([str(WORKER)], 2, backend="gloo", timeout=120, tnt_timeout_s=60)
    result.check()
    assert all(r.stdout.startswith("ok") for r in result.ranks), result.describe()
