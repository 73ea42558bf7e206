"""tnt-core's backend conformance suite against the mpi backend, ranks started by mpiexec.

The ranks run with Hydra's ``-disable-auto-cleanup``: by default Hydra SIGKILLs every rank
the moment one exits without MPI_Finalize (the dead-peer case), so the survivors could never
report the CommError the suite checks for. ``test_hydra_default_cleanup.py`` covers the
default, where the whole job ends at once.

``TestMpiConformanceTntRun`` runs the same suite with one process per rank started
directly, as ``tnt run``'s own launcher does (no MPI launcher: rank 0's PMI helper joins
the ranks into one MPI job).

One size per launch mode: the backend has no code that depends on the number of ranks
(MPICH's algorithms are MPICH's), so a size shows only how ranks are started and joined.
4 under ``mpiexec`` (two groups of two in the ``groups`` case), 3 through the PMI helper
(it serves two other ranks; ``test_launch_modes.py`` starts 2 and 3 that way too). The dead
peer once, in the mode ``tnt run`` uses: under ``mpiexec`` with Hydra's default cleanup the
job ends at once instead (``test_launch_modes.py``), and the backend's wait that fails is
the same code in both modes.
"""

from mpi_jobs import mpiexec
from tnt_core.testing.suite import BackendConformance


class TestMpiConformance(BackendConformance):
    backend = "mpi"
    nprocs = (4,)
    dead_peer_nprocs = None
    launcher = staticmethod(mpiexec)


class TestMpiConformanceTntRun(BackendConformance):
    backend = "mpi"
    nprocs = (3,)
    dead_peer_nprocs = 3
    #: MPI tells nothing of a peer that left: the survivors fail at TNT_TIMEOUT_S, 5 s
    #: here (the suite's default 15 s would only be waited)
    dead_peer_timeout_s = 5.0
    launcher = None
