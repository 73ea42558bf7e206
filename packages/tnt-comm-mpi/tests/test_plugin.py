"""Launcher detection and backend registration: single process, MPI not initialised."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

import tnt_comm_mpi
from tnt_comm_mpi import MpiLaunch, detect_mpi_launch
from tnt_comm_mpi import plugin as mpi_plugin
from tnt_core import Config


@pytest.mark.parametrize(("env", "expected"), [
    ({"PMI_RANK": "2", "PMI_SIZE": "4"}, MpiLaunch("hydra", 2, 4)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8", "PMIX_RANK": "1"},
     MpiLaunch("openmpi", 1, 8)),
    ({"PMIX_RANK": "3", "SLURM_NTASKS": "16"}, MpiLaunch("pmix", 3, 16)),
    ({"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS": "64"},
     MpiLaunch("slurm", 5, 6)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, None),  # a batch script: no step
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "batch"}, None),
    ({"TNT_RANK": "1", "TNT_SIZE": "2", "TNT_RENDEZVOUS": "127.0.0.1:5000"}, None),  # tnt run
    ({"PMI_RANK": "not-a-number"}, None),
    ({}, None),
])
def test_detect_mpi_launch(env, expected) -> None:
    assert detect_mpi_launch(env) == expected


def test_entry_point_group_names_the_plugin_module() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="tnt")}
    assert eps.get("mpi") == "tnt_comm_mpi.plugin", f"tnt entry points: {eps}"


def _spec():
    (spec,) = mpi_plugin.tnt_comm_backends()
    return spec


def test_available_under_an_mpi_launcher_and_outranks_gloo(monkeypatch) -> None:
    spec = _spec()
    assert spec.name == "mpi" and spec.priority == tnt_comm_mpi.PRIORITY
    assert spec.priority > 100, "must outrank tnt-comm-gloo (100) under mpiexec"
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert spec.is_available(Config(rank=0, size=2, rendezvous="127.0.0.1:1"))


def test_unavailable_under_tnt_run_unless_asked_for(monkeypatch) -> None:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    spec = _spec()
    cfg = Config(rank=0, size=2, rendezvous="127.0.0.1:1", launched=True)
    assert not spec.is_available(cfg), "must leave tnt run's ranks to Gloo by default"
    assert spec.is_available(cfg.with_overrides(backend="mpi")), (
        "asked for by name, the backend itself must explain what is missing")


def test_no_launcher_and_no_rendezvous_is_a_clear_config_error(monkeypatch) -> None:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    from tnt_core import ConfigError

    cfg = Config(rank=1, size=4, backend="mpi", launched=True)
    with pytest.raises(ConfigError) as info:
        tnt_comm_mpi.MpiBackend(cfg)
    message = str(info.value)
    for hint in ("mpiexec -n 4", "tnt run -n 4 --backend mpi", "TNT_RENDEZVOUS"):
        assert hint in message, f"{hint!r} missing from: {message}"
