"""The launcher interface: turn a :class:`~tnt_cli.job.Job` into processes to start here.

A launcher knows how ranks reach their hosts (directly, over ssh, through mpirun or srun)
and nothing else; supervision, output and dry-run rendering are the same for all.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from ..job import Job, Rendezvous
from ..options import RunOptions

__all__ = ["Launcher", "ProcessSpec"]


@dataclass
class ProcessSpec:
    """One process ``tnt run`` starts on this machine (an agent, ssh, mpirun, srun)."""

    argv: list[str]
    #: the host its ranks run on ("" when the launcher places them itself)
    host: str
    ranks: tuple[int, ...]
    #: agent job descriptions, for the dry-run listing (one per rank, or one template)
    specs: list[dict]
    #: written to stdin, which then stays open: closing it asks the process to end
    stdin: bytes | None = None
    #: variables added to the launcher's environment for this process
    env: dict[str, str] = field(default_factory=dict)
    #: signal sent to the process group to end it (besides closing stdin)
    stop_signal: int | None = None
    #: what an exit code of the launching tool itself means (ssh: 255), said when the
    #: rank had not started (its agent's status lines: ``tnt_cli.agent.STATUS_PREFIX``)
    failure_hints: dict[int, str] = field(default_factory=dict)
    #: the launching tool's exit code when its connection to the host ended (ssh: 255): after
    #: the agent said the rank started and before it said the rank exited, the host was lost
    lost_connection_code: int | None = None

    @property
    def label(self) -> str:
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]} on {self.host}"
        span = f"ranks {self.ranks[0]}-{self.ranks[-1]}" if self.ranks else "ranks"
        return f"{span} via {self.argv[0]}"


class Launcher(abc.ABC):
    """How ranks are started. Subclasses register in :mod:`tnt_cli.launchers`."""

    #: the ``--launcher`` name
    name: str = ""
    #: the signal that asks the started process to end its ranks
    stop_signal: int | None = None

    @classmethod
    @abc.abstractmethod
    def detect(cls, options: RunOptions) -> bool:
        """Whether ``--launcher auto`` picks this launcher for ``options``."""

    def hosts_hint(self) -> list[str] | None:
        """Hosts of the job when the user names none (e.g. a Slurm allocation)."""
        return None

    def check(self, job: Job) -> None:  # noqa: B027 - optional: most launchers accept every job
        """Raise :class:`~tnt_cli.errors.UsageError` when this launcher cannot run ``job``."""

    @abc.abstractmethod
    def processes(self, job: Job, rendezvous: Rendezvous) -> list[ProcessSpec]:
        """The processes to start, in rank order."""

