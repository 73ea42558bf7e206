"""``--launcher local``: every rank is an agent process on this machine."""

from __future__ import annotations

from ..errors import UsageError
from ..job import Job, Rendezvous
from ..network import is_local_host
from ..options import RunOptions
from ..placement import RankSlot
from .base import Launcher, ProcessSpec

__all__ = ["LocalLauncher", "local_process"]


def local_process(job: Job, slot: RankSlot, rendezvous: Rendezvous) -> ProcessSpec:
    """The agent process of one rank on this machine."""
    spec = job.agent_spec(slot, rendezvous, remote=False)
    return ProcessSpec(argv=job.agent_command(), host=slot.host, ranks=(slot.rank,), specs=[spec],
                       stdin=(job.encode(spec) + "\n").encode())


class LocalLauncher(Launcher):
    name = "local"

    @classmethod
    def detect(cls, options: RunOptions) -> bool:
        return True  # the fallback

    def check(self, job: Job) -> None:
        remote = [h for h in job.placement.hosts if not is_local_host(h)]
        if remote:
            raise UsageError(f"host {remote[0]!r} is not this machine; the local launcher runs "
                             "ranks here only (use --launcher ssh, mpirun or srun)")

    def processes(self, job: Job, rendezvous: Rendezvous) -> list[ProcessSpec]:
        return [local_process(job, slot, rendezvous) for slot in job.placement.slots]
