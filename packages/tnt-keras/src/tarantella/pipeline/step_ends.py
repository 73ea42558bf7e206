"""The two ends of a pipelined training step as the loop around it needs them on every
rank: before it, the check that all ranks read the same batch; after it, the loss's sum
over the stages (the last computes the loss, every stage adds its weight regularisation,
and every rank logs the sum, as serial Keras' step does).

Why started, not run, at the ends: both are allreduces over every rank, and run blocking
around the stage's step they are barriers between steps. The first stage could not begin
a step's first forward pass until the last stage had ended the previous step's update and
loop, and the last then waited for that forward pass: the pipeline's fill was paid after
every step's drain instead of under it. So the batch check is started before the step and
waited for inside it, before the stage's first message (so a step whose ranks read
different batches, of other contents or other sizes, fails on every rank before any
message leaves or any update is made, and every rank refuses with the check's message;
the first forward pass, which needs no message, runs meanwhile), and each stage starts its
part of the loss's sum inside its step after its last forward pass; the loop waits for the
sum after the step, which on the first stage no longer waits for the last stage's backward
passes and update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..comm.step_reductions import PendingReduction, StepReductions
from .batch_fingerprint import BatchCheck

__all__ = ["StepEnds"]


class StepEnds:
    """One step's batch check (started when made) and loss sum (started by the stage's step
    through :meth:`loss_part`), over ``reductions``' backend: every rank of the job."""

    def __init__(self, reductions: StepReductions, x: Any, y: Any, batch: int) -> None:
        self._reductions = reductions
        # the sum's buffer is agreed on here, where every rank is: inside the step a blocking
        # agreement would wait for a stage that waits for this one's messages
        reductions.agree(1, "sum")
        self.check = BatchCheck(reductions, x, y, batch)
        self._sum: PendingReduction | None = None

    def same_batch(self) -> bool:
        """Whether every rank read the same batch (waited for inside the step, before its
        first message)."""
        return self.check.same()

    def refusal(self) -> Exception:
        """What every rank raises when the ranks read different batches."""
        return self.check.error()

    def loss_part(self, part: float) -> None:
        """This stage's part of the batch's loss, known: its share of the sum starts."""
        self._sum = self._reductions.start([part], "sum")

    def loss(self) -> float:
        """The batch's loss: the sum over the ranks of their parts."""
        assert self._sum is not None, "the step starts the sum"
        return float(self._sum.result()[0])

    @contextlib.contextmanager
    def refusing_different_batches(self) -> Iterator[None]:
        """Around the step: ranks that read different batches refuse on every rank, with
        the check's message (the step fails inside on every rank when the check says so)."""
        try:
            yield
        except Exception as exc:
            try:
                same = self.check.same()
            except Exception:  # noqa: BLE001 - the check failed with the step: the step's error
                same = True
            if not same:
                raise self.refusal() from exc
            raise
        if not self.check.same():  # (the step raises first; without ends it does not wait)
            raise self.refusal()
