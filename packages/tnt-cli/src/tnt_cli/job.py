"""A resolved job: what runs, where, with which environment. Launchers only read it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .agent import SPEC_VERSION
from .devices import threads_per_rank
from .options import RunOptions
from .placement import Placement, RankSlot

__all__ = ["Job", "Rendezvous", "FORWARDED_VARIABLES", "TERMINATE_GRACE_S"]

#: seconds between SIGTERM and SIGKILL when ranks are ended
TERMINATE_GRACE_S = 3.0
#: launcher variables remote ranks get too, so they find the same software
FORWARDED_VARIABLES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")


@dataclass(frozen=True)
class Rendezvous:
    """``TNT_RENDEZVOUS`` and ``TNT_RENDEZVOUS_KEY`` (placeholders in a dry run)."""

    url: str
    key: str


@dataclass
class Job:
    options: RunOptions
    placement: Placement
    #: interpreter + script + arguments
    command: list[str]
    cwd: str
    #: GPU ids of a node when ranks use GPUs, else None
    gpus: list[str] | None
    #: set CUDA_VISIBLE_DEVICES=-1 (CPU run on a machine with GPUs)
    hide_gpus: bool
    #: the Python that runs the agent on every host (same path everywhere)
    agent_python: str
    cores: int
    grace_s: float = TERMINATE_GRACE_S
    #: said to the user before the job starts
    warnings: list[str] = field(default_factory=list)

    # -- the launcher contract (DESIGN.md) ------------------------------------------------
    def common_env(self, rendezvous: Rendezvous) -> list[tuple[str, str]]:
        """Variables equal on every rank, in a fixed order."""
        o = self.options
        env: list[tuple[str, str]] = [("TNT_SIZE", str(self.placement.size))]
        if o.backend:
            env.append(("TNT_BACKEND", o.backend))
        env += [
            ("TNT_RENDEZVOUS", rendezvous.url),
            ("TNT_RENDEZVOUS_KEY", rendezvous.key),
        ]
        if o.fusion_threshold_kb is not None:
            env.append(("TNT_FUSION_THRESHOLD_KB", f"{o.fusion_threshold_kb:g}"))
        else:
            from tnt_core import DEFAULT_FUSION_THRESHOLD_KB
            env.append(("TNT_FUSION_THRESHOLD_KB", str(DEFAULT_FUSION_THRESHOLD_KB)))
        env += [
            ("TNT_LOG_LEVEL", o.log_level),
            ("TNT_LOG_ALL", "true" if o.log_all else "false"),
            ("TNT_OUTPUT_ALL", "true" if o.output_all else "false"),
        ]
        if o.timeout_s is not None:
            env.append(("TNT_TIMEOUT_S", f"{o.timeout_s:g}"))
        else:
            from tnt_core import DEFAULT_TIMEOUT_S
            env.append(("TNT_TIMEOUT_S", f"{DEFAULT_TIMEOUT_S:g}"))
        env.append(("PYTHONUNBUFFERED", "1"))  # stream output line by line
        return env

    def rank_env(self, slot: RankSlot, rendezvous: Rendezvous) -> list[tuple[str, str]]:
        """Every variable of one rank, the user's ``-x`` last and in their order."""
        env = [
            ("TNT_RANK", str(slot.rank)),
            ("TNT_LOCAL_RANK", str(slot.local_rank)),
            ("TNT_LOCAL_SIZE", str(slot.local_size)),
            ("TNT_NUM_THREADS", str(threads_per_rank(slot.local_size, self.cores))),
        ]
        if self.hide_gpus:
            env.append(("CUDA_VISIBLE_DEVICES", "-1"))
        elif slot.gpu is not None:
            env.append(("CUDA_VISIBLE_DEVICES", slot.gpu))
        return env + self.common_env(rendezvous) + list(self.options.env)

    def forwarded_env(self) -> list[tuple[str, str]]:
        return [(name, os.environ[name]) for name in FORWARDED_VARIABLES if name in os.environ]

    # -- agent job descriptions -------------------------------------------------------
    def agent_spec(self, slot: RankSlot | None, rendezvous: Rendezvous, *, remote: bool) -> dict:
        """The agent's job description (JSON) for ``slot``.

        ``argv`` command of the rank · ``cwd`` · ``env`` ordered ``[name, value]`` pairs ·
        ``rank`` (None: taken from mpirun/srun variables at run time) · ``size`` · ``host``
        · ``output_all`` · ``pin_cpu`` / ``pin_memory`` · ``gpus`` GPU ids of a node, mapped
        by local rank when the rank is known only at run time · ``hide_gpus`` · ``grace_s``.
        """
        base = self.forwarded_env() if remote else []
        if slot is None:
            env = base + self.common_env(rendezvous) + list(self.options.env)
        else:
            env = base + self.rank_env(slot, rendezvous)
        return {
            "version": SPEC_VERSION,
            "argv": list(self.command),
            "cwd": self.cwd,
            "env": [list(p) for p in env],
            "rank": None if slot is None else slot.rank,
            "size": self.placement.size,
            "host": None if slot is None else slot.host,
            "output_all": self.options.output_all,
            "pin_cpu": self.options.pin_cpu,
            "pin_memory": self.options.pin_memory,
            "gpus": self.gpus,
            "hide_gpus": self.hide_gpus,
            "grace_s": self.grace_s,
        }

    @staticmethod
    def encode(spec: dict) -> str:
        return json.dumps(spec, separators=(",", ":"))

    def agent_command(self) -> list[str]:
        return [self.agent_python, "-m", "tnt_cli.agent"]
