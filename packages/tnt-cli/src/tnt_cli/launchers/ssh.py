"""``--launcher ssh``: ranks of remote hosts start over ssh, those of this machine directly.

The agent's job description (with the rendezvous key) travels on ssh's stdin, never on a
command line other users could read with ``ps``. ssh's stdin stays open for the whole
run: when the launcher ends or the connection drops, the remote agent reads end of file
and ends its rank, so no rank outlives its launcher.

A host lost during the job (its link or the host itself went down) sends nothing, not even
a reset: ssh notices through its keep-alive, which :func:`keepalive_options` sizes from the
job's ``TNT_TIMEOUT_S``, so that it ends (exit 255) before the ranks' own collectives time
out and ``tnt run`` names the host rather than a rank that did not arrive. The remote agent's
status lines (``tnt_cli.agent.STATUS_PREFIX``) tell that exit from ssh never reaching the
host and from a rank that exited with 255 itself.
"""

from __future__ import annotations

import math
import shlex
import shutil

from ..errors import UsageError
from ..job import Job, Rendezvous
from ..network import is_local_host
from ..options import RunOptions
from .base import Launcher, ProcessSpec
from .local import local_process

__all__ = ["SshLauncher", "keepalive_options", "ssh_command", "LOST_CONNECTION_CODE"]

#: non-interactive (no password prompt can hang the job), no pseudo-terminal
SSH_OPTIONS = ("-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30")
#: ssh's exit code when it failed itself (could not connect, or lost the connection)
LOST_CONNECTION_CODE = 255
#: unanswered keep-alives after which ssh gives the connection up
KEEPALIVE_COUNT = 2
#: the longest keep-alive interval, seconds: a dead host is noticed within 45 s at most
MAX_KEEPALIVE_S = 15


def keepalive_options(timeout_s: float | None = None) -> list[str]:
    """ssh notices a dead peer after ``KEEPALIVE_COUNT + 1`` silent intervals: about half
    of ``timeout_s`` (the ranks' ``TNT_TIMEOUT_S``), at least 3 s, at most 45 s. Earlier than
    the ranks' collectives time out, so the lost host is what ``tnt run`` reports."""
    interval = MAX_KEEPALIVE_S if timeout_s is None else max(
        1, min(MAX_KEEPALIVE_S, math.floor(timeout_s / (2 * (KEEPALIVE_COUNT + 1)))))
    return ["-o", f"ServerAliveInterval={interval}", "-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}"]


def ssh_command(host: str, remote_argv: list[str], extra: list[str],
                timeout_s: float | None = None) -> list[str]:
    """ssh to ``host`` running ``remote_argv``; ``extra`` (``--ssh-args``) comes before the
    keep-alive options, so a user's own ``-o ServerAliveInterval=...`` wins (ssh takes the
    first value it is given)."""
    return ["ssh", *SSH_OPTIONS, *extra, *keepalive_options(timeout_s), host,
            shlex.join(remote_argv)]


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
        timeout_s = job.settings().timeout_s
        for slot in job.placement.slots:
            if is_local_host(slot.host):
                procs.append(local_process(job, slot, rendezvous))
                continue
            spec = job.agent_spec(slot, rendezvous, remote=True)
            spec["status"] = True  # tells a lost connection from the rank's own exit code
            procs.append(ProcessSpec(
                argv=ssh_command(slot.host, job.agent_command(), job.options.ssh_args, timeout_s),
                host=slot.host, ranks=(slot.rank,), specs=[spec],
                stdin=(job.encode(spec) + "\n").encode(),
                lost_connection_code=LOST_CONNECTION_CODE,
                failure_hints={LOST_CONNECTION_CODE: f"ssh could not reach {slot.host}? "
                               f"`ssh {slot.host} true` must work without a prompt"}))
        return procs
