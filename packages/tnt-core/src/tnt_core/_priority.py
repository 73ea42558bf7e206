"""A launched process keeps its launcher's CPU priority in a session of its own.

Launchers start ranks with ``setsid`` (a rank's process group is killed as one). With the
kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on in most
distributions' kernels) every session is a scheduling group of its own, and a nice value
only ranks threads within their group: the group's weight against other sessions is the
nice value in ``/proc/<pid>/autogroup``, 0 for a new session. So ``nice tnt run ...`` would
start ranks as heavy as any other session on a shared machine, whatever their threads' nice
value. ``carry_priority`` writes the nice value into the new session.
"""

from __future__ import annotations

import errno
import os
import time

__all__ = ["carry_priority"]


def carry_priority(pid: int = 0) -> None:
    """Give the session (autogroup) of ``pid`` (0: this process) the calling thread's nice
    value when it is positive: only lowered, never raised (that needs privileges).

    Call it in the child between fork and exec (``preexec_fn``, after ``setsid``), or in the
    parent right after starting the child (the child then runs its first instants at the
    session's default weight). A kernel without autogroups has no such file: the nice value
    the child inherited is then its whole priority, and nothing is done.

    Without CAP_SYS_ADMIN the kernel takes one such write per tenth of a second, machine-wide,
    and answers EAGAIN to the others: ranks started together would all but one stay at the
    default weight. So EAGAIN is retried for up to half a second."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # Linux: the calling thread's
    if nice <= 0:
        return
    for _ in range(_ATTEMPTS):
        try:  # unbuffered: the kernel's answer is the write's, not a later close's
            fd = os.open(f"/proc/{pid or 'self'}/autogroup", os.O_WRONLY)
            try:
                os.write(fd, str(nice).encode())
            finally:
                os.close(fd)
            return
        except OSError as e:  # no autogroup scheduling here, or the process has ended
            if e.errno != errno.EAGAIN:
                return
        time.sleep(_RATE_LIMIT_S / 2)


_RATE_LIMIT_S = 0.1  # the kernel's HZ / 10 between two unprivileged autogroup writes
_ATTEMPTS = 10
