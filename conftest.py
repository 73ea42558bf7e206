"""What every test session of the repository checks, whichever packages it runs.

Nothing a test's jobs leave may stay behind: a rank that is killed cannot remove the
shared-memory segments its MPI library made, and ``mpiexec`` killed with SIGKILL leaves its
hwloc file in /tmp. The launcher's agents remove what nobody holds any more; this checks,
once per session, that nothing new and unheld is left in /dev/shm or /tmp.
"""

from __future__ import annotations

import pytest

_WATCHED = ("/dev/shm/*", "/tmp/hydra_hwloc_xmlfile_*")


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_dev_shm_or_tmp():
    try:
        from tnt_cli.cleanup import held_by_a_process, shm_segments
    except ImportError:  # a tox environment without tnt-cli
        yield
        return
    before = shm_segments(_WATCHED)
    yield
    new = shm_segments(_WATCHED) - before
    left = sorted(new - held_by_a_process(new)) if new else []
    if left:
        pytest.fail(f"the tests left {len(left)} file(s) that no process holds: {', '.join(left)}",
                    pytrace=False)
