"""Fixtures of tnt-comm-mpi's tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# the repository runs pytest with --import-mode=importlib (test files of different packages
# share names), so helper modules next to this file are put on the path explicitly
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from mpi_jobs import MPIEXEC


@pytest.fixture(scope="session")
def have_mpiexec() -> str:
    if not os.access(MPIEXEC, os.X_OK):
        pytest.skip("no mpiexec found (pip install 'tnt-comm-mpi[mpich]')")
    return MPIEXEC


_SHM = Path("/dev/shm")


@pytest.fixture(autouse=True)
def no_leftover_mpich_segments():
    """MPICH unlinks its shared-memory segments in MPI_Finalize; a rank these tests kill, or
    that leaves without finalising on purpose after a failure, cannot, so the segments it
    made would pile up in /dev/shm. Remove what the test's jobs left (they have ended)."""
    before = set(_SHM.glob("mpich_shm_*")) if _SHM.is_dir() else set()
    yield
    if _SHM.is_dir():
        for path in set(_SHM.glob("mpich_shm_*")) - before:
            path.unlink(missing_ok=True)
