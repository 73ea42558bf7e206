"""Rendezvous through Gloo's file store (``TNT_RENDEZVOUS=file:///shared/dir``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("nprocs", [2, 3])
def test_collectives_over_file_store_rendezvous(scenario, tmp_path: Path, nprocs: int) -> None:
    store_dir = tmp_path / "shared" / "store"  # does not exist yet: the backend creates it
    run = scenario("file-store", nprocs, env={"TNT_RENDEZVOUS": f"file://{store_dir}"})
    run.assert_ok(nprocs)
    assert all(r["info"]["backend"] == "gloo" for r in run.reports.values())
    assert any(store_dir.iterdir()), "nothing was written to the file store"
