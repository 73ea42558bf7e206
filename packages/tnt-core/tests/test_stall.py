"""The stall inspector: ranks simulated in one process, each with its own ledger, talking
through a real rendezvous store; a collective that blocks until the test releases it."""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import tnt_core
from tnt_core import CommBackend, CommError, Config, Handle, StoreServer
from tnt_core._stall_inspector import NOT_ARRIVED_KEY, StallInspector, start_inspector
from tnt_core._stall_ledger import Ledger
from tnt_core._watched_backend import WatchedBackend, WatchedHandle

pytestmark = pytest.mark.timeout(60)


class _Blocking(Handle):
    """Done when the test sets ``release``; a CommError after ``timeout``, as backends do."""

    def __init__(self, buf: np.ndarray, release: threading.Event) -> None:
        self.buf, self.release = buf, release

    def wait(self, timeout: float | None = None) -> np.ndarray:
        if not self.release.wait(5.0 if timeout is None else timeout):
            raise CommError("did not complete within the timeout", rank=0, operation="allreduce #1")
        return self.buf

    def done(self) -> bool:
        return self.release.is_set()


class _Fake(CommBackend):
    name = "fake"

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.local_rank, self.local_size = rank, size, rank, size
        self.release = threading.Event()
        self.calls: list[str] = []
        self.extra = "the backend's own attribute"

    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> Handle:
        self.calls.append(f"allreduce_async {op}")
        return _Blocking(buf, self.release)

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        self.calls.append(f"broadcast {root}")
        return buf

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        self.calls.append("allgather")
        return np.stack([buf] * self.size)

    def barrier(self) -> None:
        self.calls.append("barrier")

    def close(self) -> None:
        self.calls.append("close")


def test_the_watched_backend_counts_collectives_and_marks_only_blocking_waits():
    fake, ledger = _Fake(0, 2), Ledger()
    watched = WatchedBackend(fake, ledger, agree=False)
    assert (watched.rank, watched.size, watched.name, watched.extra) == (0, 2, "fake", fake.extra)
    assert isinstance(watched, CommBackend) and watched.inner is fake
    buf = np.ones(3, dtype=np.float32)
    watched.broadcast(buf, 0)
    watched.allgather(buf)
    watched.barrier()
    handle = watched.allreduce_async(buf, "max")
    assert isinstance(handle, WatchedHandle) and handle.seq == 4 and ledger.entered == 4
    seen: list[tuple[int, str]] = []

    def watch() -> None:
        while not fake.release.is_set():
            if ledger.waiting_for:
                seen.append((ledger.waiting_for, ledger.waiting_op))
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    threading.Timer(0.2, fake.release.set).start()
    assert handle.wait() is buf
    t.join()
    assert seen and set(seen) == {(4, "allreduce")}
    assert ledger.waiting_for == 0, "the wait is over"
    # a wait for a finished operation is no wait
    assert tnt_core.wait_all([watched.allreduce_async(buf), watched.allreduce_async(buf)]) == [buf, buf]
    assert ledger.entered == 6 and ledger.waiting_for == 0
    watched.close()
    assert fake.calls == ["broadcast 0", "allgather", "barrier", "allreduce_async max",
                          "allreduce_async sum", "allreduce_async sum", "close"]


def test_a_failed_wait_keeps_the_backends_error_without_an_inspector():
    fake = _Fake(0, 2)
    watched = WatchedBackend(fake, Ledger(), agree=False)
    with pytest.raises(CommError, match=r"did not complete within the timeout$"):
        watched.allreduce_async(np.ones(1)).wait(0.05)


@pytest.fixture()
def store():
    with StoreServer("127.0.0.1", 0) as server:
        yield server


def _rank(store: StoreServer, rank: int, size: int, warn_s: float, timeout_s: float = 30.0):
    fake, ledger = _Fake(rank, size), Ledger()
    watched = WatchedBackend(fake, ledger, agree=False)
    host, port = store.address
    config = Config(rank=rank, size=size, rendezvous=f"{host}:{port}", rendezvous_key=store.key,
                    timeout_s=timeout_s, stall_warn_s=warn_s, launched=True)
    inspector = start_inspector(watched, config, warn_s)
    assert isinstance(inspector, StallInspector)
    return SimpleNamespace(fake=fake, ledger=ledger, watched=watched, inspector=inspector)


def _stop(*ranks: SimpleNamespace) -> None:
    for r in ranks:
        r.fake.release.set()
        r.inspector.stop()


def _record(store: StoreServer, key: str) -> dict:
    client = tnt_core.StoreClient(*store.address, store.key, timeout=5)
    try:
        return json.loads(client.get(key))
    finally:
        client.close()


def test_the_lowest_waiting_rank_names_the_ranks_that_did_not_arrive(store, caplog):
    """Rank 1 waits in collective #2; rank 0 is still in epoch 2, step 5 (it entered only
    one collective); rank 2 waits too. Rank 1 reports, once; rank 2 stays quiet."""
    ranks = [_rank(store, r, 3, warn_s=0.6) for r in range(3)]
    try:
        for r in ranks:
            r.ledger.entered = 1
        tnt_core._stall_ledger._ledger = ranks[0].ledger  # where tnt-keras' reports go in rank 0
        tnt_core.report_position(epoch=1, step=5, phase="fit")
        waits = []
        for r in ranks[1:]:
            handle = r.watched.allreduce_async(np.ones(1))
            waits.append(threading.Thread(target=handle.wait, daemon=True))
        with caplog.at_level(logging.WARNING, logger="tnt.stall"):
            for t in waits:
                t.start()
            deadline = time.monotonic() + 10
            while not [r for r in caplog.records if "stall:" in r.getMessage()] \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.5)  # rank 2 had its chance to report too
        reports = [r.getMessage() for r in caplog.records if "stall:" in r.getMessage()]
        assert len(reports) == 1, reports
        assert reports[0].startswith("stall: rank 1 has waited "), reports
        assert "in allreduce #2 (TNT_STALL_WARN_S=0.6;" in reports[0]
        assert "not arrived: rank 0 (epoch 2, step 5, fit, outside any collective, after #1; " \
               "alive, heartbeat " in reports[0], reports[0]
        assert "rank 2" not in reports[0].split("not arrived:")[1]
        assert all(getattr(r, "tnt_any_rank", False) for r in caplog.records if "stall:" in r.getMessage())
    finally:
        _stop(*ranks)
        tnt_core._stall_ledger._ledger = Ledger()


def test_a_wait_that_fails_says_who_did_not_arrive_and_tells_the_launcher(store, monkeypatch):
    monkeypatch.setattr(tnt_core._errors, "_first_comm_error", [])  # a fresh process's
    r0, r1 = (_rank(store, r, 2, warn_s=0.5) for r in range(2))
    try:
        time.sleep(0.8)  # both published a heartbeat: rank 0 is before its first collective
        # failing fast (a peer closed its connection), the backend's error says it all
        with pytest.raises(CommError, match=r"within the timeout$"):
            r1.watched.allreduce_async(np.ones(1)).wait(0.1)
        tnt_core._errors._first_comm_error.clear()
        handle = r1.watched.allreduce_async(np.ones(1))
        with pytest.raises(CommError) as info:
            handle.wait(0.6)
        message = str(info.value)
        assert message.startswith("[rank 0: allreduce #1] did not complete within the timeout; "
                                  "not arrived: rank 0 (before its first collective; alive, "
                                  "heartbeat "), message
        assert isinstance(info.value.__cause__, CommError), "the backend's own error is kept"
        # what a rank prints at exit when a framework re-raised the error as its own type
        assert tnt_core._errors._first_comm_error == [info.value]
        verdict = _record(store, NOT_ARRIVED_KEY)
        assert verdict["ranks"] == [0] and verdict["generation"] == 0
        assert verdict["text"] == "rank 0 did not arrive at allreduce #2 within 30s (hung or too slow?)"
        assert verdict["seen"].startswith("last seen: rank 0 (before its first collective; alive")
    finally:
        _stop(r0, r1)


def test_a_rank_whose_heartbeat_stopped_is_called_silent(store):
    r0, r1 = (_rank(store, r, 2, warn_s=0.5) for r in range(2))
    try:
        time.sleep(0.8)
        r0.inspector.stop()  # rank 0's process froze: its inspector thread publishes no more
        time.sleep(2.5)
        text, reporter, missing = r1.inspector.diagnose(1) or ("", False, [])
        assert [p.rank for p in missing] == [0] and reporter
        assert "silent for " in text and "(dead, or frozen holding Python's lock)" in text, text
    finally:
        _stop(r0, r1)


def test_without_a_store_the_waiting_rank_still_warns(caplog):
    fake, ledger = _Fake(1, 2), Ledger()
    watched = WatchedBackend(fake, ledger, agree=False)
    inspector = start_inspector(watched, Config(rank=1, size=2, timeout_s=30.0), 0.5)
    assert inspector is not None
    try:
        with caplog.at_level(logging.WARNING, logger="tnt.stall"):
            t = threading.Thread(target=watched.allreduce_async(np.ones(1)).wait, daemon=True)
            t.start()
            deadline = time.monotonic() + 10
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "stall: rank 1 has waited" in caplog.records[0].getMessage()
        assert "unknown without tnt run's rendezvous store" in caplog.records[0].getMessage()
    finally:
        fake.release.set()
        inspector.stop()


def test_off_for_one_rank_or_zero_seconds():
    assert start_inspector(WatchedBackend(_Fake(0, 1)), Config(), 60.0) is None
    assert start_inspector(WatchedBackend(_Fake(0, 2)), Config(size=2), 0.0) is None


def test_the_runtime_watches_only_multi_rank_backends():
    tnt_core.shutdown()
    runtime = tnt_core.init("local")
    try:
        assert not isinstance(runtime.backend, WatchedBackend) and runtime.stall_inspector is None
    finally:
        tnt_core.shutdown()
