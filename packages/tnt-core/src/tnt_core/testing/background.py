"""Launches a test session runs beside its tests, at a lower CPU priority.

A suite of multi-process tests leaves cores idle while its tests wait on peers and
timeouts; launches started in the background fill them. At the same priority they also
take the cores from the tests in front, slowing them and their timings by as much as they
gain. Niced, they get what the tests leave: on Linux a nice value belongs to a thread and a
process inherits it from the thread that starts it, so the threads of ``background_pool``
start every launch at ``BACKGROUND_NICE``.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["BACKGROUND_NICE", "background_pool", "lower_thread_priority"]

#: the nice value of background launches: CFS gives such a process about a tenth of a
#: normal one's share of a busy core, all of an idle one, and never none (19 would starve
#: a background rank long enough for its peers' collective timeouts)
BACKGROUND_NICE = 10


def lower_thread_priority() -> None:
    """Set the calling thread's nice value to ``BACKGROUND_NICE`` (never raise it back:
    that needs privileges). Processes it starts from now on inherit it."""
    tid = threading.get_native_id()
    if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
        os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)


def background_pool(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads, and every process they start, run at
    ``BACKGROUND_NICE``."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                              initializer=lower_thread_priority)
