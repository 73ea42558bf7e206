"""The shared-memory allreduce (all ranks on one host): results, start-up decisions,
a peer that exits mid-allreduce, and nothing left behind in /dev/shm."""

from __future__ import annotations

from pathlib import Path

import pytest

SHM = Path("/dev/shm")
CHUNK = 64 << 10  # > the 32 KiB up to which every rank reduces a chunk whole


def _assert_no_leftovers(reports: dict[int, dict]) -> None:
    infos = [r["info"] for r in reports.values()]
    for info in infos:
        if info.get("segment"):
            assert not (SHM / info["segment"].lstrip("/")).exists(), info
    prefixes = {info["job_prefix"] for info in infos if "job_prefix" in info}
    assert prefixes, "no rank reported its segment prefix"
    for prefix in prefixes:
        left = sorted(p.name for p in SHM.glob(prefix + "*"))
        assert not left, f"left in /dev/shm: {left}"


@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_dtype_and_op_matches_numpy(scenario, nprocs: int) -> None:
    # 3 ranks reduce-scatter the full 64 KiB chunks and reduce small ones whole, copying
    # into the slots with non-temporal stores (the unaligned view: head and tail too); 2
    # ranks reduce whole, and take the defaults of TNT_GLOO_SHM (auto: shm here) and
    # TNT_GLOO_SHM_COPY (auto: both ways timed in turn on the first large copies, so the
    # bits are checked with both, then the faster kept)
    env = {"TNT_GLOO_SHM_CHUNK_BYTES": str(CHUNK)}
    if nprocs == 3:
        env.update(TNT_GLOO_SHM="1", TNT_GLOO_SHM_COPY="stream")
    run = scenario("shm-reduce", nprocs, args=["--chunk", str(CHUNK)], env=env)
    run.assert_ok(nprocs)
    assert all(r["info"]["transport"] == "shm" for r in run.reports.values())
    copies = {r["info"]["copy"] for r in run.reports.values()}
    assert copies == {"stream"} if nprocs == 3 else copies <= {"stream", "cache"}, copies
    _assert_no_leftovers(run.reports)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_peer_exiting_mid_allreduce_fails_the_others_fast(scenario, nprocs: int) -> None:
    # 4 KiB chunks: a 64 MiB allreduce is thousands of steps, so the exit lands inside one
    run = scenario("shm-kill", nprocs, args=["--after", "0.3"],
                   env={"TNT_GLOO_SHM": "1", "TNT_GLOO_SHM_CHUNK_BYTES": "4096"},
                   tnt_timeout_s=60.0, timeout=90.0)
    assert not run.result.timed_out, run.result.describe()
    victim = nprocs - 1
    dies_at = run.reports[victim]["info"]["dies_at"]
    for rank in range(nprocs - 1):
        report = run.reports[rank]
        assert report["checks"]["fails"] == "ok", report["checks"]["fails"]
        info = report["info"]
        pid = run.reports[victim]["info"]["pid"]
        assert f"rank {victim} (pid {pid}) exited" in info["error"], info["error"]
        assert info["failed_at"] - dies_at < 3.0, (rank, info.get("error"), info)
        assert info["close_s"] < 2.0, f"closing after the failure took {info['close_s']:.1f}s"
    _assert_no_leftovers(run.reports)


@pytest.mark.parametrize(("variant", "variable", "why"), [
    ("hosts-required", "TNT_GLOO_SHM=1", "not all on one host"),
    ("hosts-hierarchy-required", "TNT_GLOO_HIERARCHY=1", "one rank per host"),
])
def test_required_but_ranks_on_different_hosts_is_a_config_error(
        scenario, variant: str, variable: str, why: str) -> None:
    run = scenario("shm-setup", 2, args=["--variant", variant])
    assert run.result.ok, run.result.describe()
    for report in run.reports.values():
        error = report["info"].get("error", "")
        assert variable in error and why in error, report


@pytest.mark.parametrize(("variant", "reason"), [
    ("hosts-auto", "not all on one host"),
    ("hosts-unequal", "needs as many ranks on every host, and rank 0's host has 2, rank 2's 1"),
    ("chunks-differ", "TNT_GLOO_SHM_CHUNK_BYTES must be the same on every rank"),
    ("one-rank-off", "TNT_GLOO_SHM=0 on rank 1"),
])
def test_auto_falls_back_to_tcp_on_every_rank(scenario, variant: str, reason: str) -> None:
    run = scenario("shm-setup", 3, args=["--variant", variant])
    run.assert_ok(3)
    for report in run.reports.values():
        info = report["info"]
        assert info["transport"] == "tcp" and reason in info["reason"], info
        assert "allreduce over tcp" in info["repr"], info
    # rank 0 says why, once
    stderr = run.result.ranks[0].stderr
    assert stderr.count("allreduce over TCP, not shared memory") == 1, stderr
    assert reason in stderr, stderr
    assert all("not shared memory" not in r.stderr for r in run.result.ranks[1:])
    _assert_no_leftovers(run.reports)


def test_hierarchical_allreduce_across_emulated_hosts(scenario) -> None:
    # 4 ranks, 2 per "host" (per-rank TNT_GLOO_SHM_HOST_ID); 4 KiB slots: many steps
    run = scenario("hierarchy", 4, args=["--after", "0.3"],
                   env={"TNT_GLOO_SHM_CHUNK_BYTES": "4096", "TNT_LOG_LEVEL": "INFO"},
                   tnt_timeout_s=60.0, timeout=90.0)
    assert not run.result.timed_out, run.result.describe()
    assert sorted(run.reports) == [0, 1, 2, 3], run.result.describe()
    assert not run.failures, "\n".join(run.failures)
    assert all(r["info"]["layout"] == [2, 2] for r in run.reports.values())
    assert "allreduce hierarchical: 2 hosts x 2 ranks" in run.result.ranks[0].stderr
    dies_at = run.reports[3]["info"]["dies_at"]
    for rank in range(3):
        info = run.reports[rank]["info"]
        assert info["failed_at"] - dies_at < 3.0, (rank, info.get("error"), info)
        assert info["close_s"] < 2.0, info
    assert "rank 3" in run.reports[2]["info"]["error"], run.reports[2]["info"]
    _assert_no_leftovers(run.reports)
