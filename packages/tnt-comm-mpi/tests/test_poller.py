"""The communication thread's waiting loop, with scripted requests (no MPI needed)."""

from __future__ import annotations

import time

import pytest

from tnt_comm_mpi import Poller, PollSettings
from tnt_core import CommError, ConfigError


class ScriptedRequest:
    """Completes after ``after_s`` seconds; counts the tests it received."""

    def __init__(self, after_s: float) -> None:
        self.done_at = time.perf_counter() + after_s
        self.tests = 0

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.tests += 1
        return time.perf_counter() >= self.done_at


def test_settings_defaults_and_env() -> None:
    def values(s: PollSettings) -> tuple[float, float, float]:
        return s.spin_min_s, s.spin_max_s, s.max_sleep_s

    assert values(PollSettings.from_env({})) == pytest.approx((200e-6, 1e-3, 1e-3))
    s = PollSettings.from_env({"TNT_MPI_SPIN_US": "10", "TNT_MPI_MAX_SPIN_MS": "5",
                               "TNT_MPI_MAX_SLEEP_US": "200"})
    assert values(s) == pytest.approx((10e-6, 5e-3, 200e-6))
    with pytest.raises(ConfigError, match="TNT_MPI_MAX_SLEEP_US"):
        PollSettings.from_env({"TNT_MPI_MAX_SLEEP_US": "fast"})
    with pytest.raises(ConfigError, match=">= 0"):
        PollSettings.from_env({"TNT_MPI_SPIN_US": "-1"})


def test_spin_budget_grows_with_size_and_is_capped() -> None:
    p = Poller(PollSettings(50e-6, 20e-3, 1e-3), 0, lambda: None)
    small, large, huge = p.spin_budget(0), p.spin_budget(1 << 20), p.spin_budget(1 << 30)
    assert small == pytest.approx(50e-6)
    assert small < large < huge
    assert huge == pytest.approx(20e-3)


def test_long_wait_sleeps_instead_of_spinning() -> None:
    p = Poller(PollSettings(50e-6, 1e-3, 1e-3), 0, lambda: None)
    req = ScriptedRequest(0.5)
    t0, c0 = time.perf_counter(), time.process_time()
    p.wait(req, "allreduce #1", 1024, timeout_s=10)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert wall >= 0.5
    # spinning would test ~10^6 times in 0.5 s; sleeping with a 1 ms cap about 500 times
    assert req.tests < 2000, f"{req.tests} tests in {wall:.2f}s: the loop spins"
    assert cpu < 0.25 * wall, f"waiting used {cpu:.3f}s CPU in {wall:.3f}s"


def test_timeout_raises_comm_error_naming_rank_and_operation() -> None:
    p = Poller(PollSettings(), 3, lambda: None)
    t0 = time.perf_counter()
    with pytest.raises(CommError) as info:
        p.wait(ScriptedRequest(60.0), "allreduce #7 (float32, sum)", 4, timeout_s=0.3)
    assert 0.3 <= time.perf_counter() - t0 < 2.0
    assert info.value.rank == 3 and info.value.operation == "allreduce #7 (float32, sum)"
    assert "rank 3" in str(info.value) and "TNT_TIMEOUT_S" in str(info.value)


def test_abort_ends_the_wait_early() -> None:
    reason = CommError("peer gone", rank=0)
    aborted = {"now": False}
    p = Poller(PollSettings(), 0, lambda: reason if aborted["now"] else None)
    req = ScriptedRequest(60.0)
    t0 = time.perf_counter()
    aborted["now"] = True
    with pytest.raises(CommError, match="peer gone"):
        p.wait(req, "barrier #1", 0, timeout_s=30)
    assert time.perf_counter() - t0 < 1.0


def test_completed_request_returns_at_once() -> None:
    p = Poller(PollSettings(), 0, lambda: None)
    req = ScriptedRequest(0.0)
    p.wait(req, "barrier #1", 0, timeout_s=1)
    assert req.tests == 1


def test_waited_settings_default_and_env() -> None:
    assert PollSettings.from_env({}).spin_waited_max_s == pytest.approx(50e-3)
    s = PollSettings.from_env({"TNT_MPI_MAX_WAITED_SPIN_MS": "7"})
    assert s.spin_waited_max_s == pytest.approx(7e-3)
    with pytest.raises(ConfigError, match="TNT_MPI_MAX_WAITED_SPIN_MS"):
        PollSettings.from_env({"TNT_MPI_MAX_WAITED_SPIN_MS": "lots"})
    # never below the cap for an operation nobody waits for
    assert PollSettings.from_env({"TNT_MPI_MAX_SPIN_MS": "9", "TNT_MPI_MAX_WAITED_SPIN_MS": "2"}
                                 ).spin_waited_max_s == pytest.approx(9e-3)


def test_a_waited_transfer_is_polled_without_sleeping(monkeypatch) -> None:
    # 256 MiB at the initial 1 GB/s guess: a transfer longer than both caps
    settings = PollSettings(50e-6, 1e-3, 1e-3, spin_waited_max_s=200e-3)
    nbytes = 256 << 20
    waited = Poller(settings, 0, lambda: None, waited=lambda: True)
    alone = Poller(settings, 0, lambda: None, waited=lambda: False)
    assert waited.spin_budget(nbytes, waited=True) > 100 * alone.spin_budget(nbytes)
    sleeps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))
    # the sleeps counted, not the tests: how often a loop tests depends on how much CPU a
    # loaded machine leaves it; whether it sleeps within its spin budget does not
    waited.wait(ScriptedRequest(0.1), "allreduce #1", nbytes, timeout_s=10)  # 0.2 s budget
    assert sleeps == []
    alone.wait(ScriptedRequest(0.1), "allreduce #2", nbytes, timeout_s=10)  # 1 ms, then sleeps
    assert len(sleeps) > 5, sleeps


def test_a_waited_operation_still_backs_off_for_a_late_peer() -> None:
    p = Poller(PollSettings(50e-6, 1e-3, 1e-3, spin_waited_max_s=20e-3), 0, lambda: None,
               waited=lambda: True)
    req = ScriptedRequest(0.5)
    c0 = time.process_time()
    p.wait(req, "allreduce #1", 1 << 20, timeout_s=10)
    cpu = time.process_time() - c0
    assert cpu < 0.15, f"waiting 0.5 s for a late peer cost {cpu:.3f}s CPU"
