"""Launcher detection: one reading of the MPI launchers' variables for the MPI backend and
``tnt run``'s rank agent. Environment only, MPI never initialised."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tnt_core import MpiLaunch, detect_mpi_launch
from tnt_core._launch_env import expand_tasks_per_node
from tnt_core.testing import launch_ranks


@pytest.mark.parametrize(("env", "expected"), [
    ({"PMI_RANK": "2", "PMI_SIZE": "4"}, MpiLaunch("hydra", 2, 4)),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     MpiLaunch("hydra", 3, 4, 1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8", "PMIX_RANK": "1"},
     MpiLaunch("openmpi", 1, 8)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     MpiLaunch("openmpi", 5, 8, 1, 4)),
    ({"PMIX_RANK": "3", "SLURM_NTASKS": "16"}, MpiLaunch("pmix", 3, 16)),
    ({"PMIX_RANK": "3", "PMIX_SIZE": "4", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"},
     MpiLaunch("pmix", 3, 4, 1, 2)),
    ({"PMIX_RANK": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "64", "SLURM_LOCALID": "1",
      "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
     MpiLaunch("pmix", 3, 4, 1, 2)),
    ({"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS": "64"},
     MpiLaunch("slurm", 5, 6)),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
      "SLURM_STEP_ID": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"},
     MpiLaunch("slurm", 4, 5, 0, 1)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, None),  # a batch script: no step
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "batch"}, None),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEPID": "extern"}, None),
    ({"TNT_RANK": "1", "TNT_SIZE": "2", "TNT_RENDEZVOUS": "127.0.0.1:5000"}, None),  # tnt run
    ({"PMI_RANK": "not-a-number"}, None),
    ({}, None),
])
def test_detect_mpi_launch(env, expected) -> None:
    assert detect_mpi_launch(env) == expected


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node("") == []
    assert expand_tasks_per_node("garbage") == []


def test_ranks_launched_from_a_niced_thread_stay_niced_in_their_sessions(tmp_path) -> None:
    """A niced caller's ranks: each runs in a session of its own, an autogroup that would
    weigh as much as any other session unless it carries the caller's nice value."""
    script = tmp_path / "priority.py"
    # the launcher weighs a rank's session right after starting it, retrying while the
    # kernel rate-limits unprivileged writes (CI has no CAP_SYS_ADMIN): a rank looks for
    # up to 2 s, then prints what its session carries
    script.write_text("import os, time\n"
                      "group = 'none'\n"
                      "for _ in range(40 if os.path.exists('/proc/self/autogroup') else 0):\n"
                      "    group = open('/proc/self/autogroup').read().split()[-1]\n"
                      "    if group != '0':\n"
                      "        break\n"
                      "    time.sleep(0.05)\n"
                      "print(os.getpriority(os.PRIO_PROCESS, 0), group)\n")

    def niced_launch():  # Linux: a nice value belongs to the thread; processes inherit it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        return launch_ranks([str(script)], 2, timeout=60)

    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(niced_launch).result()
    group = "10" if os.path.exists("/proc/self/autogroup") else "none"
    assert [r.stdout.split() for r in result.check().ranks] == [["10", group]] * 2
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the test's own thread is untouched
