"""Backend registration and selection: single process, MPI not initialised.

Reading the launchers' variables is tnt-core's (``tnt_core.detect_mpi_launch``, tested there).
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

import tnt_comm_mpi
import tnt_core
from tnt_comm_mpi import plugin as mpi_plugin
from tnt_comm_mpi import settings as mpi_settings
from tnt_core import Config


def test_entry_point_group_names_the_plugin_module() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="tnt")}
    assert eps.get("mpi") == "tnt_comm_mpi.plugin", f"tnt entry points: {eps}"


def test_its_settings_reach_tnt_core_through_the_hook() -> None:
    installed = tnt_core.installed_settings(tnt_core.get_plugin_manager())
    assert installed.groups["mpi"] is mpi_settings.MPI
    assert installed.owner("mpi") == "plugin 'mpi' (tnt-comm-mpi)"
    assert set(mpi_settings.MPI.variables) == set(mpi_settings.__all__) - {"MPI"}


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


def test_loading_the_plugin_does_not_import_mpi4py() -> None:
    """Every process loads the plugin, also those that end up on Gloo: no MPI there."""
    import subprocess
    import sys

    code = ("import sys, importlib.metadata as md\n"
            "(ep,) = [e for e in md.entry_points(group='tnt') if e.name == 'mpi']\n"
            "plugin = ep.load()\n"
            "plugin.tnt_comm_backends()\n"
            "import tnt_comm_mpi\n"
            "heavy = sorted(m for m in sys.modules if m.startswith(('mpi4py', 'tnt_comm_mpi.backend')))\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
