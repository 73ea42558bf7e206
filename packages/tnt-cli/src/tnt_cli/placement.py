"""Placement: which rank runs on which host, with which local rank and device.

Ranks are placed in blocks: the first ``k`` ranks on the first host, the next on the
second, ... so that neighbouring ranks share a node (the usual layout of MPI launchers).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError
from .hostfile import Host

__all__ = ["RankSlot", "Placement", "place_ranks", "LOCALHOST"]

LOCALHOST = "localhost"


@dataclass(frozen=True)
class RankSlot:
    rank: int
    host: str
    local_rank: int
    local_size: int
    #: the GPU this rank uses (an entry of CUDA_VISIBLE_DEVICES), None on CPU
    gpu: str | None = None
    #: ``(share, shares)``: the share of its host's cores the rank is bound to (``tnt run
    #: --bind-to core``); None: ``(local_rank, local_size)``. An elastic job's later ranks
    #: take the share a departed rank left, whatever their local rank.
    cores: tuple[int, int] | None = None

    @property
    def core_share(self) -> tuple[int, int]:
        """``(share, shares)`` of the host's cores this rank is bound to."""
        return self.cores if self.cores is not None else (self.local_rank, self.local_size)


@dataclass(frozen=True)
class Placement:
    slots: tuple[RankSlot, ...]

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def hosts(self) -> list[str]:
        """Hosts that run at least one rank, in rank order."""
        seen: dict[str, None] = {}
        for s in self.slots:
            seen.setdefault(s.host, None)
        return list(seen)

    def on_host(self, host: str) -> list[RankSlot]:
        return [s for s in self.slots if s.host == host]

    @property
    def max_local_size(self) -> int:
        return max(s.local_size for s in self.slots)


def _counts(hosts: list[Host], nranks: int | None, per_node: int | None, default_per_node: int) -> list[int]:
    if per_node is not None:
        capacity = [per_node] * len(hosts)
    elif any(h.slots is not None for h in hosts):
        capacity = [h.slots if h.slots is not None else default_per_node for h in hosts]
    else:
        capacity = None
    if nranks is None:
        return capacity if capacity is not None else [default_per_node] * len(hosts)
    if capacity is None:  # spread -n evenly, the first hosts take the remainder
        base, extra = divmod(nranks, len(hosts))
        return [base + (1 if i < extra else 0) for i in range(len(hosts))]
    total = sum(capacity)
    if nranks > total:
        raise UsageError(
            f"-n {nranks} asks for more ranks than the hosts offer ({total}: "
            + ", ".join(f"{h.name}={c}" for h, c in zip(hosts, capacity))
            + "); lower -n, or raise --n-per-node or the hosts' slots (slots=K, -H HOST:K)"
        )
    counts, left = [], nranks
    for c in capacity:
        take = min(c, left)
        counts.append(take)
        left -= take
    return counts


def place_ranks(hosts: list[Host], nranks: int | None, per_node: int | None,
                default_per_node: int, gpus: list[str] | None) -> Placement:
    """Lay out the job's ranks on ``hosts``.

    :param nranks: ``-n``; None means "what the hosts offer".
    :param per_node: ``--n-per-node``; overrides hostfile ``slots=``.
    :param default_per_node: ranks of a host when neither ``-n`` nor slots say.
    :param gpus: GPU ids per node (same on every node); None places ranks on CPUs.
    """
    counts = _counts(hosts, nranks, per_node, default_per_node)
    slots: list[RankSlot] = []
    rank = 0
    for host, count in zip(hosts, counts):
        for local in range(count):
            gpu = gpus[local] if gpus is not None and local < len(gpus) else None
            slots.append(RankSlot(rank, host.name, local, count, gpu))
            rank += 1
    if not slots:
        raise UsageError("the job has no ranks; check -n, --n-per-node and the hostfile")
    return Placement(tuple(slots))
