"""Helpers shared by tnt-comm-mpi's tests: the venv's mpiexec and its arguments."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

#: mpiexec next to the interpreter (the `mpich` wheel installs it into the venv's bin/)
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
if not os.access(MPIEXEC, os.X_OK):
    MPIEXEC = shutil.which("mpiexec") or MPIEXEC

WORKERS = Path(__file__).parent / "workers"


def mpiexec(n: int, *, cleanup: bool = False) -> list[str]:
    """``mpiexec -n N`` argv prefix. Hydra kills every rank as soon as one exits without
    MPI_Finalize; ``cleanup=False`` turns that off so survivors can report the failure."""
    argv = [MPIEXEC]
    if not cleanup and _is_hydra():
        argv.append("-disable-auto-cleanup")
    return [*argv, "-n", str(n)]


def _is_hydra() -> bool:
    real = os.path.realpath(MPIEXEC)
    return "hydra" in os.path.basename(real) or os.path.exists(Path(real).parent / "hydra_pmi_proxy")


