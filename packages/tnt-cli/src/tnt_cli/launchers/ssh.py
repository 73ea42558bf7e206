"""``--launcher ssh``: ranks of remote hosts start over ssh, those of this machine directly.

The agent's job description (with the rendezvous key) travels on ssh's stdin, never on a
command line other users could read with ``ps``. ssh's stdin stays open for the whole
run: when the launcher ends or the connection drops, the remote agent reads end of file
and ends its rank, so no rank outlives its launcher.
"""

from __future__ import annotations

import shlex
import shutil

from ..errors import UsageError
from ..job import Job, Rendezvous
from ..network import is_local_host
from ..options import RunOptions
from .base import Launcher, ProcessSpec
from .local import local_process

__all__ = ["SshLauncher", "ssh_command"]

#: non-interactive (no password prompt can hang the job), no pseudo-terminal, and a dead
#: peer is noticed within a minute
SSH_OPTIONS = ("-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30",
               "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4")


def ssh_command(host: str, remote_argv: list[str], extra: list[str]) -> list[str]:
    return ["ssh", *SSH_OPTIONS, *extra, host, shlex.join(remote_argv)]


class SshLauncher(Launcher):
    name = "ssh"

    @classmethod
    def detect(cls, options: RunOptions) -> bool:
        return options.names_hosts

    def check(self, job: Job) -> None:
        if any(not is_local_host(h) for h in job.placement.hosts) and shutil.which("ssh") is None:
            raise UsageError("ssh is not installed (install openssh-client) but the job's hosts "
                             "(--hostfile, -H) include remote ones")

    def processes(self, job: Job, rendezvous: Rendezvous) -> list[ProcessSpec]:
        procs = []
        for slot in job.placement.slots:
            if is_local_host(slot.host):
                procs.append(local_process(job, slot, rendezvous))
                continue
            spec = job.agent_spec(slot, rendezvous, remote=True)
            procs.append(ProcessSpec(
                argv=ssh_command(slot.host, job.agent_command(), job.options.ssh_args),
                host=slot.host, ranks=(slot.rank,), specs=[spec],
                stdin=(job.encode(spec) + "\n").encode(),
                failure_hints={255: f"ssh could not reach {slot.host}? `ssh {slot.host} true` must work "
                                    "without a prompt"}))
        return procs
