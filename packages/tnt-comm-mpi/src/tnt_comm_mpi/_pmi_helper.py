"""``python -m tnt_comm_mpi._pmi_helper``: the PMI server process rank 0 starts under
``tnt run`` (see :mod:`tnt_comm_mpi.pmi_server`). A module of its own so that running it
does not re-execute a module the package has already imported."""

from tnt_comm_mpi.pmi_server import main

if __name__ == "__main__":
    raise SystemExit(main())
