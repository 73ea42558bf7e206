"""Sharding arithmetic: which samples of a global batch each rank takes.

A global batch of ``B`` samples on ``N`` ranks gives rank ``r`` ``B // N`` samples, plus one
for the first ``B % N`` ranks, at consecutive offsets, so the ranks' micro-batches
concatenated in rank order are the global batch. Pure integer arithmetic, shared by every
data sharder so all of them split identically.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from ._errors import ShardingError

__all__ = [
    "ShardContext",
    "micro_batch_sizes",
    "micro_batch_size",
    "micro_batch_offset",
    "micro_batch_slice",
]


def _as_int(name: str, value: object) -> int:
    try:
        if isinstance(value, SupportsIndex):
            return operator.index(value)  # rejects 2.5 and "3", accepts numpy ints
    except TypeError:  # e.g. an array of more than one element
        pass
    raise ShardingError(f"{name} must be an integer, got {value!r}")


def _check(global_batch: object, size: object, allow_empty: bool) -> tuple[int, int]:
    b, n = _as_int("global batch size", global_batch), _as_int("number of ranks", size)
    if n < 1:
        raise ShardingError(f"number of ranks must be >= 1, got {n}")
    if b < 0:
        raise ShardingError(f"global batch size must be >= 0, got {b}")
    if b < n and not allow_empty:
        raise ShardingError(
            f"global batch size {b} is smaller than the number of ranks {n}: every rank "
            f"needs at least one sample; use a global batch size >= {n} or fewer ranks"
        )
    return b, n


def micro_batch_sizes(global_batch: int, size: int, *, allow_empty: bool = False) -> list[int]:
    """Samples per rank for one global batch; the remainder goes to the first ranks.

    :param allow_empty: permit ranks with 0 samples (the last, partial batch of an epoch
        may have fewer samples than ranks; all ranks still take the step).
    """
    b, n = _check(global_batch, size, allow_empty)
    base, extra = divmod(b, n)
    return [base + (1 if r < extra else 0) for r in range(n)]


def _check_rank(rank: object, size: int) -> int:
    r = _as_int("rank", rank)
    if not 0 <= r < size:
        raise ShardingError(f"rank {r} is not in [0, {size})")
    return r


def micro_batch_size(global_batch: int, rank: int, size: int, *, allow_empty: bool = False) -> int:
    """Samples of rank ``rank`` in a global batch of ``global_batch``."""
    sizes = micro_batch_sizes(global_batch, size, allow_empty=allow_empty)
    return sizes[_check_rank(rank, len(sizes))]


def micro_batch_offset(global_batch: int, rank: int, size: int, *, allow_empty: bool = False) -> int:
    """Index of rank ``rank``'s first sample inside the global batch."""
    b, n = _check(global_batch, size, allow_empty)
    r = _check_rank(rank, n)
    base, extra = divmod(b, n)
    return r * base + min(r, extra)


def micro_batch_slice(global_batch: int, rank: int, size: int, *, allow_empty: bool = False) -> slice:
    """``slice`` of the global batch that rank ``rank`` takes."""
    start = micro_batch_offset(global_batch, rank, size, allow_empty=allow_empty)
    return slice(start, start + micro_batch_size(global_batch, rank, size, allow_empty=allow_empty))


@dataclass(frozen=True)
class ShardContext:
    """What a data sharder (``tnt_shard_data``) needs to know about the job.

    ``micro_batch_size`` is None unless the user fixed it (``tnt_micro_batch_size``);
    ``extras`` carries framework-specific settings (e.g. whether this is validation data).
    """

    rank: int
    size: int
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_rank(self.rank, _check(1, self.size, True)[1])
        if (self.global_batch_size is not None and self.micro_batch_size is not None
                and self.micro_batch_size * self.size != self.global_batch_size):
            raise ShardingError(
                f"micro batch size {self.micro_batch_size} x {self.size} ranks != global "
                f"batch size {self.global_batch_size}; give one of them, or make them agree"
            )

    @property
    def sizes(self) -> list[int]:
        """Micro-batch sizes of all ranks for a full global batch."""
        if self.global_batch_size is None:
            raise ShardingError("the global batch size is unknown; pass batch_size")
        return micro_batch_sizes(self.global_batch_size, self.size)

    def slice_of(self, batch: int) -> slice:
        """This rank's part of a batch of ``batch`` samples (may be empty for a short last batch)."""
        return micro_batch_slice(batch, self.rank, self.size, allow_empty=True)
