"""The conformance suite against the reference store backend: proves the suite itself
(it runs, passes on a correct backend, and catches a dead peer within the timeout). One size,
3 ranks: an odd number, with a real group and a lone one in the ``groups`` case; the backend
has no code that depends on the number of ranks."""

from tnt_core.testing.suite import BackendConformance


class TestStoreBackendConformance(BackendConformance):
    backend = "store"
    nprocs = (3,)
    dead_peer_nprocs = 3
    dead_peer_timeout_s = 5.0


def test_suite_catches_a_wrong_reduction(tmp_path):
    import json
    from pathlib import Path

    from tnt_core.testing import launch_ranks

    here = str(Path(__file__).parent)
    result = launch_ranks(
        ["-m", "tnt_core.testing.conformance", "--report", str(tmp_path),
         "--only", "allreduce-max-int32,allreduce-sum-float32"],
        2, backend="offbyone", timeout=120, tnt_timeout_s=30,
        env={"TNT_PLUGINS": "broken_backend", "PYTHONPATH": here},
    )
    assert not result.ok, "a rank with failing cases must exit non-zero"
    for rank in range(2):
        cases = json.loads((tmp_path / f"rank{rank}.json").read_text())["cases"]
        assert cases["allreduce-max-int32"]["status"] == "ok"
        assert cases["allreduce-sum-float32"]["status"] == "fail"
        assert "got" in cases["allreduce-sum-float32"]["detail"]
