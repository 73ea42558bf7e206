"""``--launcher mpirun``: one ``mpiexec`` starts every rank (MPICH/Intel MPI or Open MPI).

Each rank is an agent that takes rank, size and local rank from the MPI launcher's
variables and turns them into the ``TNT_*`` contract, so any backend works under mpirun,
and the MPI backend finds the MPI job it needs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from ..agent import SPEC_ENV
from ..errors import UsageError
from ..job import Job, Rendezvous
from ..options import RunOptions
from .base import Launcher, ProcessSpec

__all__ = ["MpirunLauncher", "find_mpiexec"]


def find_mpiexec() -> str | None:
    """``mpiexec``/``mpirun`` on PATH, else next to this Python (an MPI wheel in a venv)."""
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    for name in ("mpiexec", "mpirun"):
        candidate = os.path.join(os.path.dirname(sys.executable), name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _is_open_mpi(mpiexec: str) -> bool:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    text = out.stdout + out.stderr
    return "Open MPI" in text or "OpenRTE" in text or "Open RTE" in text


class MpirunLauncher(Launcher):
    name = "mpirun"
    stop_signal = signal.SIGTERM

    def __init__(self) -> None:
        self.mpiexec = find_mpiexec()

    @classmethod
    def detect(cls, options: RunOptions) -> bool:
        return options.backend == "mpi" and find_mpiexec() is not None

    def check(self, job: Job) -> None:
        if self.mpiexec is None:
            raise UsageError("--launcher mpirun: no mpiexec or mpirun found on PATH; install an "
                             "MPI (e.g. pip install mpich) or pick another --launcher")

    def processes(self, job: Job, rendezvous: Rendezvous) -> list[ProcessSpec]:
        self.check(job)
        mpiexec = self.mpiexec or "mpiexec"
        spec = job.agent_spec(None, rendezvous, remote=True)
        spec["watch"] = "parent"
        placement = job.placement
        counts = [(h, len(placement.on_host(h))) for h in placement.hosts]
        argv = [mpiexec, "-n", str(placement.size)]
        openmpi = _is_open_mpi(mpiexec)
        if len(counts) > 1 or job.options.names_hosts:
            hosts = ",".join(f"{h}:{c}" for h, c in counts)
            argv += ["--host", hosts] if openmpi else ["-hosts", hosts]
        env = {SPEC_ENV: job.encode(spec)}
        ssh_args = _ssh_args(job.options.ssh_args)
        if openmpi:
            argv += ["-x", SPEC_ENV]
            if ssh_args:  # Open MPI's ssh starter
                argv += ["--mca", "plm_rsh_args", ssh_args]
        elif ssh_args:  # MPICH's Hydra (and Intel MPI's) ssh bootstrap
            env["HYDRA_LAUNCHER_EXTRA_ARGS"] = ssh_args
        argv += job.agent_command()
        return [ProcessSpec(argv=argv, host="", ranks=tuple(range(placement.size)), specs=[spec],
                            env=env, stop_signal=self.stop_signal)]


def _ssh_args(words: list[str]) -> str:
    """``--ssh-args`` as mpiexec's ssh bootstrap takes them: one string it splits at spaces."""
    spaced = [w for w in words if any(c.isspace() for c in w)]
    if spaced:
        raise UsageError(f"--ssh-args: mpiexec splits its ssh arguments at spaces, so {spaced[0]!r} "
                         "cannot reach ssh through it; put the option in an ssh config file "
                         "(--ssh-args \"-F FILE\") or use --launcher ssh")
    return " ".join(words)
