"""``--launcher srun``: Slurm starts every rank inside the current allocation.

As under mpirun, each rank is an agent that reads its rank from Slurm's variables.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

from ..agent import SPEC_ENV
from ..errors import UsageError
from ..job import Job, Rendezvous
from ..options import RunOptions
from .base import Launcher, ProcessSpec

__all__ = ["SrunLauncher", "slurm_nodes"]


def _allocation_nodes() -> int:
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def slurm_nodes() -> list[str] | None:
    """Host names of the current Slurm allocation, or None outside one."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=20)
            names = out.stdout.split()
            if out.returncode == 0 and names:
                return names
        except (OSError, subprocess.SubprocessError):
            pass
    if "[" not in nodelist:
        return [n for n in nodelist.split(",") if n]
    return None


class SrunLauncher(Launcher):
    name = "srun"
    stop_signal = signal.SIGTERM

    @classmethod
    def detect(cls, options: RunOptions) -> bool:
        return (not options.names_hosts and "SLURM_JOB_ID" in os.environ
                and _allocation_nodes() > 1 and shutil.which("srun") is not None)

    def hosts_hint(self) -> list[str] | None:
        return slurm_nodes()

    def check(self, job: Job) -> None:
        if shutil.which("srun") is None:
            raise UsageError("--launcher srun: srun is not on PATH; run inside a Slurm "
                             "allocation (salloc/sbatch) or pick another --launcher")
        if job.options.ssh_args:
            raise UsageError("--ssh-args: srun starts the ranks without ssh; drop --ssh-args, or "
                             "use --launcher ssh or mpirun")

    def processes(self, job: Job, rendezvous: Rendezvous) -> list[ProcessSpec]:
        spec = job.agent_spec(None, rendezvous, remote=True)
        spec["watch"] = "parent"
        placement = job.placement
        argv = ["srun", f"--ntasks={placement.size}", "--kill-on-bad-exit=1", "--export=ALL"]
        hosts = placement.hosts
        counts = {len(placement.on_host(h)) for h in hosts}
        argv.append(f"--nodes={len(hosts)}")
        if len(counts) == 1:
            argv.append(f"--ntasks-per-node={counts.pop()}")
        if job.options.names_hosts or self.hosts_hint():
            argv.append("--nodelist=" + ",".join(hosts))
        argv += job.agent_command()
        return [ProcessSpec(argv=argv, host="", ranks=tuple(range(placement.size)), specs=[spec],
                            env={SPEC_ENV: job.encode(spec)}, stop_signal=self.stop_signal)]
