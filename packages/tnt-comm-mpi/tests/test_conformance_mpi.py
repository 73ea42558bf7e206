"""tnt-core's backend conformance suite against the mpi backend, ranks started by mpiexec.

The ranks run with Hydra's ``-disable-auto-cleanup``: by default Hydra SIGKILLs every rank
the moment one exits without MPI_Finalize (the dead-peer case), so the survivors could never
report the CommError the suite checks for. ``test_hydra_default_cleanup.py`` covers the
default, where the whole job ends at once.

``TestMpiConformanceTntRun`` runs the same suite with one process per rank started
directly, as ``tnt run``'s own launcher does (no MPI launcher: rank 0's PMI helper joins
the ranks into one MPI job).
"""

from mpi_jobs import mpiexec
from tnt_core.testing.suite import BackendConformance


class TestMpiConformance(BackendConformance):
    backend = "mpi"
    nprocs = (2, 3, 4)
    launcher = staticmethod(mpiexec)


class TestMpiConformanceTntRun(BackendConformance):
    backend = "mpi"
    nprocs = (2, 3, 4)
    launcher = None
