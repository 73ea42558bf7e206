"""The entry point and the backend declaration tnt-core sees."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

import tnt_core
from tnt_comm_gloo import plugin, settings
from tnt_core import Config


def test_entry_point_is_registered_in_the_tnt_group() -> None:
    eps = [ep for ep in entry_points(group=tnt_core.ENTRY_POINT_GROUP) if ep.name == "gloo"]
    assert len(eps) == 1, "tnt-comm-gloo is not installed with its `tnt` entry point"
    assert eps[0].value == "tnt_comm_gloo.plugin"
    assert eps[0].load() is plugin


def test_plugin_manager_lists_gloo_above_local() -> None:
    specs = {s.name: s for s in tnt_core.list_backends(tnt_core.get_plugin_manager())}
    assert "gloo" in specs
    assert specs["gloo"].priority > specs["local"].priority
    assert specs["gloo"].factory is plugin.make_backend


@pytest.mark.parametrize(("cfg", "available"), [
    (Config(rank=0, size=1), False),
    (Config(rank=0, size=2, local_size=2), False),  # no rendezvous
    (Config(rank=1, size=2, local_rank=1, local_size=2, rendezvous="127.0.0.1:1"), True),
    (Config(rank=0, size=3, local_size=3, rendezvous="file:///tmp/x"), True),
])
def test_available_only_when_it_can_serve(cfg: Config, available: bool) -> None:
    (spec,) = plugin.tnt_comm_backends()
    assert spec.is_available(cfg) is available


def test_selected_by_default_for_a_launched_job() -> None:
    cfg = Config(rank=0, size=2, local_size=2, rendezvous="127.0.0.1:1")
    assert tnt_core.select_backend(cfg).name == "gloo"
    assert tnt_core.select_backend(Config()).name == "local"


def test_importing_the_package_does_not_load_the_native_module() -> None:
    import subprocess
    import sys

    code = ("import sys, tnt_comm_gloo, tnt_comm_gloo.plugin; "
            "print('tnt_comm_gloo._gloo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_its_settings_reach_tnt_core_through_the_hook() -> None:
    installed = tnt_core.installed_settings(tnt_core.get_plugin_manager())
    assert installed.groups["gloo"] is settings.GLOO
    assert installed.owner("gloo") == "plugin 'gloo' (tnt-comm-gloo)"
    assert set(settings.GLOO.variables) == set(settings.__all__) - {"GLOO"}
    assert "TNT_GLOO_SHM" not in tnt_core.VARIABLES  # tnt-core keeps its own only
