"""Collective agreement: ranks that call different collectives, shapes, dtypes, reductions
or roots all raise CollectiveMismatchError before data moves, and the job goes on."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from tnt_core import (
    CollectiveMismatchError,
    CommBackend,
    CommError,
    CompletedHandle,
    FusedAllreducer,
    Handle,
    TensorSpec,
    plan_buckets,
)
from tnt_core._agreement import HEADER_LEN, disagreement, header, plan_header
from tnt_core._stall_ledger import Ledger
from tnt_core._watched_backend import WatchedBackend
from tnt_core.testing import agreement_job, launch_ranks

pytestmark = pytest.mark.timeout(120)

JOB = agreement_job.__file__


class _Recording(CommBackend):
    """One rank of a job whose peer's headers are ``peer_words(words)``."""

    name = "recording"

    def __init__(self, peer_words=lambda words: words) -> None:
        self.rank, self.size, self.local_rank, self.local_size = 0, 2, 0, 2
        self.peer_words = peer_words
        self.calls: list[str] = []

    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> Handle:
        if op == "max" and buf.dtype == np.int64 and buf.size == 2 * HEADER_LEN:
            self.calls.append("header")  # the agreement's exchange: max over both ranks
            peer = self.peer_words(buf[:HEADER_LEN].copy())
            return CompletedHandle(np.maximum(buf, np.concatenate([peer, -peer])))
        self.calls.append("allreduce")
        return CompletedHandle(buf)

    def broadcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        self.calls.append("broadcast")
        return buf

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        self.calls.append("allgather")
        return np.stack([buf, self.peer_words(buf.copy())])

    def barrier(self) -> None:
        self.calls.append("barrier")

    def close(self) -> None:
        pass


def test_agreeing_ranks_pay_one_small_allreduce_and_a_plan_only_once():
    inner = _Recording()
    watched = WatchedBackend(inner, Ledger())
    watched.allreduce(np.ones(4, np.float32))
    watched.broadcast(np.ones(4, np.float32), root=1)
    watched.barrier()  # the header exchange is the barrier
    assert inner.calls == ["header", "allreduce", "header", "broadcast", "header"]
    inner.calls.clear()
    specs = [TensorSpec((n,), np.dtype(np.float32)) for n in (3, 5, 7)]
    plan = plan_buckets(specs, threshold_bytes=16)
    assert len(plan.buckets) == 2
    reducer = FusedAllreducer(watched, plan)
    for _ in range(4):
        for tid, n in enumerate((3, 5, 7)):
            reducer.push(tid, np.ones(n, np.float32))
        reducer.finish()
    assert inner.calls == ["header"] + ["allreduce"] * 2 * 4


def test_a_buffer_not_in_the_plan_is_checked_even_at_an_agreed_address():
    inner = _Recording()
    watched = WatchedBackend(inner, Ledger())
    buf = np.ones(4, np.float32)
    watched.agree_on_plan([buf])
    watched.allreduce_async(buf).wait()
    watched.allreduce_async(buf, "max").wait()  # another op: not what was agreed
    watched.allreduce_async(buf.copy()).wait()
    assert inner.calls == ["header", "allreduce", "header", "allreduce", "header", "allreduce"]


def test_a_disagreeing_peer_raises_before_the_data_collective():
    def peer_passes_another_shape(words):
        return header("allreduce", np.ones(3, np.float32), op="sum")

    inner = _Recording(peer_passes_another_shape)
    watched = WatchedBackend(inner, Ledger())
    with pytest.raises(CollectiveMismatchError, match=r"collective #1 differs between ranks: "
                       r"rank 0 called allreduce of float32 \(4,\) \(sum\); "
                       r"rank 1 called allreduce of float32 \(3,\) \(sum\)"):
        watched.allreduce(np.ones(4, np.float32))
    assert inner.calls == ["header", "allgather"], "the words of each rank, for the message"


def test_the_message_says_what_each_rank_passed():
    rows = np.stack([header("broadcast", np.ones((2, 3, 4, 5)), root=0),
                     header("broadcast", np.ones((2, 3, 4, 6)), root=0),
                     header("broadcast", np.ones((2, 3, 4, 5)), root=0)])
    assert disagreement(rows) == ("ranks 0, 2 called broadcast of float64 4-d shape of 120 elements "
                                  "from root 0; rank 1 called broadcast of float64 4-d shape of "
                                  "144 elements from root 0")
    assert disagreement(rows[[0, 2]]) is None
    plan = np.stack([plan_header([np.ones(3, np.float32)], "sum"),
                     plan_header([np.ones(3, np.float64)], "sum")])
    assert "a fused allreduce plan of 1 bucket (12 bytes" in disagreement(plan)
    assert "rank 1 called a collective this check does not know" in disagreement(
        np.stack([header("barrier"), np.arange(10)]))


def test_local_mistakes_are_refused_before_any_exchange():
    inner = _Recording()
    watched = WatchedBackend(inner, Ledger())
    with pytest.raises(ValueError, match="root 2 is not a rank of this job"):
        watched.broadcast(np.ones(2, np.float32), root=2)
    with pytest.raises(TypeError, match="root must be a rank number"):
        watched.broadcast(np.ones(2, np.float32), root="0")
    with pytest.raises(ValueError, match="unknown reduction op"):
        watched.allreduce(np.ones(2, np.float32), "mean")
    with pytest.raises(TypeError, match="does not support dtype"):
        watched.allreduce(np.ones(2, np.uint8))
    assert inner.calls == []


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf"), "10"])
def test_a_wait_with_a_nonsense_timeout_is_refused_and_the_handle_still_works(bad):
    watched = WatchedBackend(_Recording(), Ledger())
    handle = watched.allreduce_async(np.ones(2, np.float32))
    with pytest.raises((ValueError, TypeError), match="timeout must be"):
        handle.wait(timeout=bad)
    with pytest.raises((ValueError, TypeError), match="timeout must be"):
        type(handle).wait_all([handle], timeout=bad)
    assert handle.wait(timeout=5).tolist() == [1.0, 1.0]


def _run_job(tmp_path, backend, **kw):
    result = launch_ranks([JOB, str(tmp_path)], 2, backend=backend, timeout=90, tnt_timeout_s=30,
                          python=sys.executable, **kw)
    assert result.ok, result.describe()
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("backend", ["store", "gloo"])
def test_every_rank_refuses_a_mismatch_and_the_job_goes_on(tmp_path, backend):
    if backend == "gloo" and importlib.util.find_spec("tnt_comm_gloo") is None:
        pytest.skip("tnt-comm-gloo is not installed")
    agreement_job.check_reports(_run_job(tmp_path, backend))


class _Gate(Handle):
    """A header exchange that completes when the test opens the gate (the late peer)."""

    def __init__(self, buf: np.ndarray, gate) -> None:
        self.buf, self.gate = buf, gate

    def wait(self, timeout: float | None = None) -> np.ndarray:
        assert self.gate.wait(10), "the gate never opened"
        return self.buf

    def done(self) -> bool:
        return self.gate.is_set()


class _LatePeer(_Recording):
    """A peer that arrives at the next header exchange after ``late = True`` only when
    ``gate`` is set (or the backend closes, which ends what is in flight)."""

    def __init__(self, peer_words=lambda words: words) -> None:
        import threading
        super().__init__(peer_words)
        self.gate = threading.Event()
        self.late = True

    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> Handle:
        handle = super().allreduce_async(buf, op)
        if self.calls[-1] == "header" and self.late:
            self.late = False
            return _Gate(handle.wait(), self.gate)
        return handle

    def close(self) -> None:
        self.gate.set()


def test_allreduce_async_returns_before_the_agreement_and_keeps_program_order():
    inner = _LatePeer()
    inner.late = False
    watched = WatchedBackend(inner, Ledger())
    planned = np.ones(3, np.float32)
    watched.agree_on_plan([planned])
    inner.calls.clear()
    inner.late = True
    first = watched.allreduce_async(np.ones(4, np.float32))       # its peer is late
    second = watched.allreduce_async(planned)                     # no header, but after it
    third = watched.allreduce_async(np.ones(2, np.float32), "max")
    assert not first.done() and inner.calls == ["header"], "started before the agreement"
    inner.gate.set()
    watched.allreduce(np.ones(5, np.float32))                     # blocking: after all three
    assert [h.wait(5).size for h in (first, second, third)] == [4, 3, 2]
    assert inner.calls == ["header", "allreduce", "allreduce", "header", "allreduce",
                           "header", "allreduce"]
    assert first.done() and watched.ledger.entered == 8, "the plan, then 3 headers and 4 allreduces"


def test_a_disagreement_on_allreduce_async_is_raised_by_wait_and_no_data_moves():
    def peer_passes_another_op(words):
        return header("allreduce", np.ones(4, np.float32), op="max")

    inner = _Recording(peer_passes_another_op)
    watched = WatchedBackend(inner, Ledger())
    handle = watched.allreduce_async(np.ones(4, np.float32))
    with pytest.raises(CollectiveMismatchError, match=r"rank 1 called allreduce of float32 \(4,\) \(max\)"):
        handle.wait(5)
    assert inner.calls == ["header", "allgather"]
    assert handle.done()


def test_a_wait_that_times_out_before_the_agreement_says_so_and_can_be_retried():
    inner = _LatePeer()
    watched = WatchedBackend(inner, Ledger())
    handle = watched.allreduce_async(np.ones(4, np.float32))
    with pytest.raises(CommError, match=r"not every rank entered the allreduce within 0.2 s"):
        handle.wait(0.2)
    inner.gate.set()
    assert handle.wait(5).tolist() == [1.0] * 4


def test_closing_fails_the_launches_not_yet_started():
    inner = _LatePeer()
    watched = WatchedBackend(inner, Ledger())
    first = watched.allreduce_async(np.ones(4, np.float32))
    queued = watched.allreduce_async(np.ones(2, np.float32))
    watched.close()  # ends the first one's header exchange, as a backend's close does
    try:  # started before the close, or not
        assert first.wait(5).tolist() == [1.0] * 4
    except CommError as exc:
        assert "closed before this allreduce started" in str(exc)
    with pytest.raises(CommError, match="closed before this allreduce started"):
        queued.wait(5)
    assert first.done() and queued.done()
