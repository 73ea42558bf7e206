"""A hung peer: the collective fails with CommError after TNT_TIMEOUT_S, later ones fail
at once, and closing does not hang."""

from __future__ import annotations

import pytest

TIMEOUT_S = 3.0


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])
def test_hung_peer_times_out_and_poisons(scenario, shm: str) -> None:
    run = scenario("timeout", 2, args=["--hang", str(TIMEOUT_S + 2)], tnt_timeout_s=TIMEOUT_S,
                   env={"TNT_GLOO_SHM": shm})
    run.assert_ok(2)
    info = run.reports[0]["info"]
    assert TIMEOUT_S * 0.9 <= info["seconds"] <= TIMEOUT_S + 3.0, info
    assert info["close_s"] < 2.0, f"closing after the failure took {info['close_s']:.1f}s"
