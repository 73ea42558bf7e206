"""The two ends of a pipelined step as the loop around it needs them on every rank: before
it, the check that all ranks read the same batch; after it, the loss's sum over the stages
(the last computes the loss, every stage adds its weight regularisation, and every rank
logs the sum, as serial Keras' step does). An evaluation step has the same two, its sum
being the stages' weight regularisation, which the loop adds to the compiled loss.

Why started, not run, at the ends: both are allreduces over every rank, and run blocking
around the stage's step they are barriers between steps. The first stage could not begin
a step's first forward pass until the last stage had ended the previous step's update and
loop, and the last then waited for that forward pass: the pipeline's fill was paid after
every step's drain instead of under it. So the stage's step starts the batch check as the
first op of its graph (the batch's checksums are graph ops over its tensors) and waits for
it before the stage's first message (so a step whose ranks read different batches, of
other contents or other sizes, fails on every rank before any message leaves or any update
is made, and every rank refuses with the check's message; the first forward pass, which
needs no message, runs meanwhile), and each stage starts its part of the loss's sum inside
its step after its last forward pass; the first stage no longer waits for the last stage's
backward passes and update.

Why inside the step's graph, not in the loop around it: every call into TensorFlow that
follows a stage's step finds the caches it needs evicted by the step's passes and update,
and pays for it (``benchmarks/cold_calls.py``: a trivial traced call 0.45-0.62 ms after
streaming memory, 0.13 ms alone; in the pipeline benchmark's loop the checksums' call took
0.44-0.54 ms, the loss tracker's update 0.59-0.74). So the loop makes one call per step
besides reading the batch: the check starts in the graph, and when the logs are the loss
alone the graph also waits for its sum and updates the loss's tracker
(``StageStep(log_loss=...)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..comm.step_reductions import PendingReduction, StepReductions
from .batch_fingerprint import BatchCheck, batch_tensors

__all__ = ["StepEnds", "StepLog"]


class StepEnds:
    """One step's batch check and loss sum, over ``reductions``' backend: every rank of the
    job. The stage's step starts both (:meth:`start_check` with the checksums of
    :attr:`fingerprinted`, :meth:`loss_part`) and waits for them inside its graph."""

    def __init__(self, reductions: StepReductions, x: Any, y: Any, batch: int,
                 shared: int = 0) -> None:
        self._reductions = reductions
        self.batch = batch
        #: how many values :meth:`from_last` takes (the step's logs' metric states)
        self.shared = shared
        #: what the check fingerprints, on every rank: all of ``x`` and ``y`` (stage 0 reads
        #: x, the last y)
        self.fingerprinted = batch_tensors(x, y)
        # the buffers are agreed on here, where every rank is: inside the step a blocking
        # agreement would wait for a stage that waits for this one's messages
        reductions.agree(1, "sum")
        reductions.agree(BatchCheck.size(len(self.fingerprinted)), "max")
        if shared:
            reductions.agree(shared, "sum")
        self.check: BatchCheck | None = None
        self._sum: PendingReduction | None = None

    def start_check(self, sums: Any) -> None:
        """The checksums of :attr:`fingerprinted` (the step's graph computed them): the
        check starts."""
        self.check = BatchCheck(self._reductions, sums, self.batch)

    def same_batch(self) -> bool:
        """Whether every rank read the same batch (waited for inside the step, before its
        first message)."""
        assert self.check is not None, "the step starts the check"
        return self.check.same()

    @staticmethod
    def refusal() -> Exception:
        """What every rank raises when the ranks read different batches."""
        return BatchCheck.error()

    def loss_part(self, part: float) -> None:
        """This stage's part of the batch's loss, known: its share of the sum starts."""
        self._sum = self._reductions.start([part], "sum")

    def loss(self) -> float:
        """The batch's loss: the sum over the ranks of their parts."""
        assert self._sum is not None, "the step starts the sum"
        return float(self._sum.result()[0])

    def from_last(self, values: np.ndarray, last: bool) -> np.ndarray:
        """``values`` as the last stage holds them, on every rank (a sum over the ranks of
        the last stage's values and everyone else's zeros: exact; called by every rank's
        step after the loss's sum, which it waited for: a buffer of one size is one
        reduction's at a time)."""
        assert values.size == self.shared, "agreed on when made"
        mine = values if last else np.zeros_like(values)
        return self._reductions.start(mine.astype(np.float64), "sum").result()

    @contextlib.contextmanager
    def refusing_different_batches(self) -> Iterator[None]:
        """Around the step: ranks that read different batches refuse on every rank, with
        the check's message (the step fails inside on every rank when the check says so)."""
        try:
            yield
        except Exception as exc:
            try:
                same = self.check is None or self.check.same()
            except Exception:  # noqa: BLE001 - the check failed with the step: the step's error
                same = True
            if not same:
                raise self.refusal() from exc
            raise
        if self.check is not None and not self.check.same():  # (the step raises first)
            raise self.refusal()


@dataclass
class StepLog:
    """What a stage's step makes its logs from, inside its graph (``StageStep(log_step=...)``):
    the batch's loss summed over the ranks and its size, on every stage; the batch's labels,
    sample weights and outputs (all micro-batches', joined) on the last stage only (None
    elsewhere); and :attr:`from_last`, which gives a float64 vector as the last stage holds
    it, on every rank (one collective, after the loss's sum)."""

    loss: Any
    batch: int
    last: bool
    y: Any
    sample_weight: Any
    predictions: Any
    from_last: Callable[[Any], Any]
