"""Collective agreement over MPI: ranks that call different collectives, shapes, dtypes,
reductions or roots all raise CollectiveMismatchError, and MPI is not left corrupted
(before, MPI returned normally with wrong results for these calls)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(150)


def test_every_rank_refuses_a_mismatch_and_mpi_goes_on(have_mpiexec, tmp_path) -> None:
    from mpi_jobs import mpiexec
    from tnt_core.testing import agreement_job, launch_ranks

    result = launch_ranks([agreement_job.__file__, str(tmp_path)], 2, backend="mpi",
                          timeout=120.0, tnt_timeout_s=30.0, launcher=mpiexec(2))
    assert result.ok, result.describe()
    agreement_job.check_reports([json.loads((tmp_path / f"rank{r}.json").read_text())
                                 for r in range(2)])
