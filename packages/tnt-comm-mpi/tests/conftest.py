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
