"""Waiting is cheap and overlaps: 2 ranks under mpiexec (tests/workers/progress_worker.py).

* a rank waiting ~1.5 s for a late peer uses < 10 % of a core, in ``allreduce_async(...)
  .wait()`` and in the blocking ``allreduce`` alike (MPICH's blocking
  MPI_Allreduce, measured alongside for the record, busy-polls a whole core);
* the caller's thread keeps running Python while a 64 MiB allreduce is in flight, and
  ``allreduce_async`` returns without waiting for the peer.
"""

from __future__ import annotations

import json

import pytest

from mpi_jobs import WORKERS, mpiexec
from tnt_core.testing import launch_ranks


@pytest.fixture(scope="module")
def reports(have_mpiexec, tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("progress")
    result = launch_ranks([str(WORKERS / "progress_worker.py"), str(out)], 2, backend="mpi",
                          timeout=180.0, tnt_timeout_s=120.0, launcher=mpiexec(2))
    assert result.ok, result.describe()
    found = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(found) == [0, 1], f"reports of ranks {sorted(found)}\n{result.describe()}"
    for rank, report in found.items():  # visible with pytest -s / in the junit log
        print(f"rank {rank}: {json.dumps(report)}")
    return found


def test_waiting_rank_uses_under_10_percent_of_a_core(reports) -> None:
    wait = reports[0]["wait_ours"]
    assert wait["wall_s"] >= 1.0, f"rank 0 did not wait for the late peer: {wait}"
    assert wait["cpu_percent"] < 10.0, (
        f"a rank waiting {wait['wall_s']:.2f}s used {wait['cpu_percent']:.1f}% of a core "
        f"(plain MPI_Allreduce: {reports[0]['wait_mpi']['cpu_percent']:.1f}%)"
    )


def test_a_rank_waiting_in_the_blocking_allreduce_uses_under_10_percent_of_a_core(reports) -> None:
    # the caller's thread runs it itself (no hand-off), with the same spin-then-sleep wait
    wait = reports[0]["wait_blocking"]
    assert wait["wall_s"] >= 1.0, f"rank 0 did not wait for the late peer: {wait}"
    assert wait["cpu_percent"] < 10.0, wait


def test_allreduce_async_returns_before_the_late_peer_arrives(reports) -> None:
    overlap = reports[0]["overlap"]
    assert overlap["correct"], "64 MiB allreduce gave wrong values"
    assert overlap["issue_s"] < 0.2, f"allreduce_async blocked {overlap['issue_s']:.3f}s"
    assert overlap["busy_s"] >= 0.8, f"the allreduce did not wait for the late peer: {overlap}"


def test_python_keeps_running_during_a_large_allreduce(reports) -> None:
    # rank 0 waits ~1 s for the late peer: meanwhile its own thread must get Python work
    # done at a share of its rate alone (a GIL held by the comm thread, or a blocking call,
    # would give ~0 units). The bound is loose because the thread shares its core with the
    # comm thread's 64 MiB reduction and, in the suite, with the other shard's tests: 0.23
    # was measured so on the 2-vCPU development VM (2026-12-01), which failed a bound of 0.3
    overlap = reports[0]["overlap"]
    assert overlap["units"] >= 50, overlap
    assert overlap["rate_ratio"] > 0.1, overlap
    assert reports[1]["overlap"]["correct"], "rank 1: 64 MiB allreduce gave wrong values"
