"""Point-to-point beyond the conformance suite (which runs p2p-ring, p2p-order, groups,
p2p-size-mismatch and p2p-recv-timeout against gloo, its ranks on one host: through the
shared-memory rings): not queued behind collectives, progress without wait(), messages
to itself, the tag range, messages larger than a ring, a peer that dies while a receive
waits for it, and one that closes after its last messages; each through the rings and
over TCP (``TNT_GLOO_SHM=0``, as between hosts)."""

from __future__ import annotations

import pytest

TIMEOUT_S = 10.0

TRANSPORTS = {"shm": {}, "tcp": {"TNT_GLOO_SHM": "0"}}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_p2p_beside_collectives_and_edges(scenario, transport) -> None:
    scenario("p2p", 2, env=TRANSPORTS[transport], tnt_timeout_s=30.0).assert_ok(2)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dead_peer_fails_a_waiting_receive(scenario, transport) -> None:
    run = scenario("p2p-dead-peer", 2, env=TRANSPORTS[transport], tnt_timeout_s=TIMEOUT_S,
                   timeout=60.0)
    assert run.result.ok, run.result.describe()
    assert not run.failures, "\n".join(run.failures)
    info = run.reports[0]["info"]
    # the broken connection wakes the receive: no need to wait for TNT_TIMEOUT_S
    assert info["seconds"] < TIMEOUT_S / 2, info
    assert info["close_s"] < 2.0, f"closing after the failure took {info['close_s']:.1f}s"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_closing_after_its_last_messages(scenario, transport) -> None:
    run = scenario("p2p-peer-closes", 2, env=TRANSPORTS[transport], tnt_timeout_s=TIMEOUT_S,
                   timeout=60.0)
    assert run.result.ok, run.result.describe()
    assert not run.failures, "\n".join(run.failures)
    assert set(run.reports[1]["checks"]) == {"gets-the-last-messages", "later-receive-fails"}
