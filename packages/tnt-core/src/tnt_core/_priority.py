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

import os

__all__ = ["carry_priority"]


def carry_priority(pid: int = 0) -> None:
    """Give the session (autogroup) of ``pid`` (0: this process) the calling thread's nice
    value when it is positive: only lowered, never raised (that needs privileges).

    Call it in the child between fork and exec (``preexec_fn``, after ``setsid``), or in the
    parent right after starting the child (the child then runs its first instants at the
    session's default weight). A kernel without autogroups has no such file: the nice value
    the child inherited is then its whole priority, and nothing is done."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # Linux: the calling thread's
    if nice <= 0:
        return
    try:
        with open(f"/proc/{pid or 'self'}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup scheduling here, or the process has already ended
        pass
