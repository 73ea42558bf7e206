"""Point-to-point beyond the conformance suite (which runs p2p-ring, p2p-order, groups,
p2p-size-mismatch and p2p-recv-timeout against gloo): not queued behind collectives,
progress without wait(), messages to itself, the tag range, a peer that dies while a
receive waits for it, and one that closes after its last messages."""

from __future__ import annotations

TIMEOUT_S = 10.0


def test_p2p_beside_collectives_and_edges(scenario) -> None:
    scenario("p2p", 2, tnt_timeout_s=30.0).assert_ok(2)


def test_dead_peer_fails_a_waiting_receive(scenario) -> None:
    run = scenario("p2p-dead-peer", 2, tnt_timeout_s=TIMEOUT_S, timeout=60.0)
    assert run.result.ok, run.result.describe()
    assert not run.failures, "\n".join(run.failures)
    info = run.reports[0]["info"]
    # the broken connection wakes the receive: no need to wait for TNT_TIMEOUT_S
    assert info["seconds"] < TIMEOUT_S / 2, info
    assert info["close_s"] < 2.0, f"closing after the failure took {info['close_s']:.1f}s"


def test_peer_closing_after_its_last_messages(scenario) -> None:
    run = scenario("p2p-peer-closes", 2, tnt_timeout_s=TIMEOUT_S, timeout=60.0)
    assert run.result.ok, run.result.describe()
    assert not run.failures, "\n".join(run.failures)
    assert set(run.reports[1]["checks"]) == {"gets-the-last-messages", "later-receive-fails"}
