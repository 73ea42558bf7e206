"""The ``TNT_MPI_*`` settings of the ``mpi`` backend: declared here, once.

The request poller (:mod:`tnt_comm_mpi.progress`) and the CUDA check
(:mod:`tnt_comm_mpi.library`) read them through these declarations, and the plugin hands
the group to tnt-core (``tnt_register_settings`` in :mod:`tnt_comm_mpi.plugin`), so that
``tnt run`` checks a value before any rank starts and ``tnt settings`` and the docs list
them. Imports nothing but tnt-core: loading the plugin stays cheap (no mpi4py).
"""

from __future__ import annotations

from tnt_core import SettingGroup

__all__ = [
    "MPI",
    "TNT_MPI_CUDA_AWARE",
    "TNT_MPI_MAX_SLEEP_US",
    "TNT_MPI_MAX_SPIN_MS",
    "TNT_MPI_MAX_WAITED_SPIN_MS",
    "TNT_MPI_SPIN_US",
]

MPI = SettingGroup("mpi", "the `mpi` backend (tnt-comm-mpi)", prefix="TNT_MPI_")

TNT_MPI_SPIN_US = MPI.declare("TNT_MPI_SPIN_US", "float", 200.0,
                              "minimum spin phase of the request poller, µs", minimum=0)
TNT_MPI_MAX_SPIN_MS = MPI.declare(
    "TNT_MPI_MAX_SPIN_MS", "float", 1.0,
    "longest spin phase while nobody waits for the result, ms", minimum=0)
TNT_MPI_MAX_WAITED_SPIN_MS = MPI.declare(
    "TNT_MPI_MAX_WAITED_SPIN_MS", "float", 50.0,
    "longest spin phase while a caller is blocked on the result, ms", minimum=0)
TNT_MPI_MAX_SLEEP_US = MPI.declare(
    "TNT_MPI_MAX_SLEEP_US", "float", 1000.0,
    "longest sleep between two tests once spinning stopped, µs", minimum=0)
TNT_MPI_CUDA_AWARE = MPI.declare(
    "TNT_MPI_CUDA_AWARE", "bool", None,
    "`1`/`0` overrides the check whether the MPI library takes CUDA buffers",
    default_doc="`auto`")
