"""The native hand-off (``GlooBackend.native_comm``, tnt_core/include/tnt_native_comm.h)
with real ranks: results bitwise those of the Python path over TCP and shared memory, one
order with Python-path collectives, done() exactly once on success and failure, refusals
of bad arguments and of a closed communicator; point-to-point (ABI 2) on the streams of
the Python methods, both ways, with a size mismatch failing one receive. The
backend-generic checks are in tnt-core's conformance suite (native-* cases), which
test_conformance_gloo.py runs."""

from __future__ import annotations

import pytest

from tnt_comm_gloo.backend import GlooSettings

# small thresholds, so small test buffers take every TCP algorithm of the plan
SMALL = {"TNT_GLOO_BCUBE_MAX_BYTES": "8192"}


@pytest.mark.parametrize(("nprocs", "shm"), [(2, "1"), (2, "0"), (3, "0")],
                         ids=["np2-shm", "np2-tcp", "np3-tcp"])
def test_native_matches_python_path_and_keeps_order(scenario, nprocs: int, shm: str) -> None:
    run = scenario("native", nprocs, env={"TNT_GLOO_SHM": shm, **SMALL}, tnt_timeout_s=30.0)
    run.assert_ok(nprocs)
    want = "shm" if shm == "1" else "tcp"
    assert all(r["info"]["transport"] == want for r in run.reports.values()), run.reports


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])
@pytest.mark.parametrize("variant", ["kill", "abort"])
def test_native_failure_calls_done_once(scenario, variant: str, shm: str) -> None:
    # A peer that exits fails the allreduce at once. An abort on this rank stops it at
    # once too, over shared memory and over TCP, where it waits on a peer that sends
    # nothing: 1 MiB on 2 ranks is recursive doubling, tnt-comm-gloo's own, whose waits
    # the abort ends (closing the connections alone wakes the peers, not this rank).
    # Over TCP the same holds for the ring, bcube, broadcast, allgather and barrier
    # (abort-ends-* checks, each on a communicator of its own).
    limit = 5.0
    run = scenario("native-failure", 2, args=["--variant", variant],
                   env={"TNT_GLOO_SHM": shm}, tnt_timeout_s=60.0, timeout=90.0)
    assert not run.result.timed_out, run.result.describe()
    report = run.reports[0]  # kill: rank 1 exits; abort: rank 0 aborts, rank 1 stays out
    failed = {c: status for c, status in report["checks"].items() if status != "ok"}
    aborted = 5 if (variant, shm) == ("abort", "0") else 0
    assert len(report["checks"]) == 3 + aborted and not failed, \
        "\n".join(f"{c}:\n{status}" for c, status in failed.items()) + run.result.describe()
    info = report["info"]
    assert info["seconds"] < limit, f"the failure took {info['seconds']:.1f}s: {info}"
    assert info["close_s"] < 5.0, f"closing after it took {info['close_s']:.1f}s"
    for name, seconds in info.get("abort_s", {}).items():
        assert seconds < limit, f"{name} ended {seconds:.1f}s after the abort: {info}"


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("settings", [
    GlooSettings(),
    GlooSettings(bcube_max_bytes=1000, doubling_max_bytes=100),
    GlooSettings(bcube_max_bytes=100, doubling_max_bytes=1000),
    GlooSettings(bcube_max_bytes=0, doubling_max_bytes=0),
    GlooSettings(algorithm="ring"),
    GlooSettings(algorithm="bcube"),
], ids=["defaults", "doubling-below-bcube", "doubling-above-bcube", "zero", "ring", "bcube"])
@pytest.mark.parametrize("per_host", [1, 3])
def test_algorithm_plan_is_algorithm_for(settings: GlooSettings, size: int, per_host: int) -> None:
    """The plan the native table is given chooses as the Python path does (per_host 3: the
    hierarchical allreduce, whose TCP algorithm runs on slices of a third)."""
    plan = settings.algorithm_plan(size, per_host)
    assert plan[-1][0] >= 2**62, "the last step must fit every buffer"

    def from_plan(nbytes: int) -> str:
        return next(algorithm for limit, algorithm in plan if nbytes <= limit)

    edges = {e * per_host for e in (settings.bcube_max_bytes, settings.doubling_max_bytes)}
    sizes = {0, 1, 4096, 10**9} | {e + d for e in edges for d in (-1, 0, 1, per_host - 1,
                                                                  per_host, per_host + 1)
                                   if e + d >= 0}
    for nbytes in sorted(sizes):
        assert from_plan(nbytes) == settings.algorithm_for(nbytes, size, per_host), (nbytes, plan)
