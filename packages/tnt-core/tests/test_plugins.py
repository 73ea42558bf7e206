import sys
from pathlib import Path

import pytest

import tnt_core
from tnt_core import BackendSpec, PluginError, ShardContext
from tnt_core import _hookspecs as hookspecs

HERE = Path(__file__).parent


@pytest.fixture
def plugins_path(clean_runtime):
    clean_runtime.syspath_prepend(str(HERE))
    return clean_runtime


def test_hook_names_are_the_contract():
    assert set(hookspecs.__all__) == {
        "tnt_comm_backends", "tnt_register_settings", "tnt_shard_data", "tnt_wrap_callback",
        "tnt_runtime_started", "tnt_runtime_stopping",
    }
    pm = tnt_core.get_plugin_manager()
    assert pm.project_name == "tnt"
    for name in hookspecs.__all__:
        assert hasattr(pm.hook, name)
    # firstresult hooks: a sharder or wrapper answers alone
    assert pm.hook.tnt_shard_data.spec.opts["firstresult"]
    assert pm.hook.tnt_wrap_callback.spec.opts["firstresult"]
    assert not pm.hook.tnt_comm_backends.spec.opts["firstresult"]


def test_builtin_backends(clean_runtime):
    names = [s.name for s in tnt_core.list_backends()]
    assert "local" in names and "store" in names  # store: registered by conftest


def test_store_backend_is_test_code_not_loaded_unless_asked(clean_runtime):
    clean_runtime.delenv("TNT_PLUGINS")
    names = {s.name for s in tnt_core.list_backends()}
    assert "local" in names and "store" not in names
    assert "tnt_core.testing.store_backend" not in tnt_core._plugins.BUILTIN_PLUGINS
    code = "import sys, tnt_core; tnt_core.list_backends(); print('tnt_core.testing' in sys.modules)"
    env = {k: v for k, v in __import__("os").environ.items() if k != "TNT_PLUGINS"}
    out = __import__("subprocess").run([sys.executable, "-c", code], env=env, check=True,
                                       capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_entry_point_plugins_keep_their_distribution(clean_runtime):
    """Loaded through pluggy's loader: each entry-point plugin knows where it came from."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group=tnt_core.ENTRY_POINT_GROUP)}
    if not names:
        pytest.skip("no tnt entry points installed")
    pm = tnt_core.get_plugin_manager()
    by_plugin = {pm.get_name(plugin): dist.project_name for plugin, dist in pm.list_plugin_distinfo()}
    assert names <= set(by_plugin), by_plugin
    assert all(dist.startswith("tnt") for dist in by_plugin.values()), by_plugin


def test_plugin_module_from_env_is_loaded(plugins_path):
    plugins_path.setenv("TNT_PLUGINS", "plugin_fixtures")
    specs = {s.name: s for s in tnt_core.list_backends()}
    assert specs["echo"].priority == 5
    # the highest-priority available backend wins without TNT_BACKEND
    assert tnt_core.init().backend.name == "echo"
    ctx = ShardContext(rank=0, size=1)
    assert tnt_core.get_plugin_manager().hook.tnt_shard_data(data=[1], context=ctx) == ("sharded", [1], 0)
    assert tnt_core.get_plugin_manager().hook.tnt_shard_data(data=(1,), context=ctx) is None


def test_blocked_plugin_is_not_loaded(plugins_path):
    plugins_path.setenv("TNT_PLUGINS", "plugin_fixtures")
    plugins_path.setenv("TNT_DISABLE_PLUGINS", "plugin_fixtures")
    assert "echo" not in [s.name for s in tnt_core.list_backends()]


def test_unknown_hook_name_fails_at_start_up(plugins_path):
    plugins_path.setenv("TNT_PLUGINS", "plugin_bad_hook")
    with pytest.raises(PluginError, match=r"unknown hook.*tnt_comm_backend"):
        tnt_core.get_plugin_manager()


def test_missing_plugin_module_is_named(plugins_path):
    plugins_path.setenv("TNT_PLUGINS", "no_such_module_xyz")
    with pytest.raises(PluginError, match=r"no_such_module_xyz.*TNT_PLUGINS"):
        tnt_core.get_plugin_manager()


def test_lifecycle_hooks_run_once(plugins_path):
    calls = []

    class Listener:
        @tnt_core.hookimpl
        def tnt_runtime_started(self, runtime):
            calls.append(("started", runtime.rank))

        @tnt_core.hookimpl
        def tnt_runtime_stopping(self, runtime):
            calls.append(("stopping", runtime.size))

    tnt_core.get_plugin_manager().register(Listener())
    tnt_core.init()
    tnt_core.init()
    tnt_core.shutdown()
    tnt_core.shutdown()
    assert calls == [("started", 0), ("stopping", 1)]


def test_bad_return_value_of_a_backend_plugin_is_named(clean_runtime):
    class Broken:
        @tnt_core.hookimpl
        def tnt_comm_backends(self):
            return ["gloo"]

    tnt_core.get_plugin_manager().register(Broken())
    with pytest.raises(PluginError, match=r"must return a list of tnt_core\.BackendSpec"):
        tnt_core.list_backends()


def test_duplicate_backend_names_are_refused(clean_runtime):
    class Dup:
        @tnt_core.hookimpl
        def tnt_comm_backends(self):
            return [BackendSpec(name="local", factory=tnt_core.LocalBackend)]

    tnt_core.get_plugin_manager().register(Dup())
    with pytest.raises(PluginError, match="two installed plugins declare a backend named 'local'"):
        tnt_core.list_backends()


def test_autoload_off_switch(clean_runtime):
    from tnt_core.testing import STORE_PLUGIN

    clean_runtime.setenv("TNT_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = tnt_core.get_plugin_manager()
    assert {name for name, _ in pm.list_name_plugin()} == {
        *tnt_core._plugins.BUILTIN_PLUGINS, STORE_PLUGIN}
