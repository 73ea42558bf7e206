"""Settings a plugin declares through ``tnt_register_settings``: listed and read like
tnt-core's own; a name outside the plugin's prefix, a group without one, and a prefix or
group name that another plugin or tnt-core has are refused, naming whose they are."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import tnt_core
from tnt_core import ConfigError, PluginError, SettingGroup, installed_settings, read_setting
from tnt_core.testing import STORE_PLUGIN


def _plugin(*groups: SettingGroup):
    class Plugin:
        @tnt_core.hookimpl
        def tnt_register_settings(self, registry):
            for group in groups:
                registry.add(group)

    return Plugin()


def _group(name: str, prefix: str | None, *names: str) -> SettingGroup:
    group = SettingGroup(name, f"the {name} test plugin", prefix=prefix)
    for var in names:
        group.declare(var, "int", 7, "a test setting", minimum=0)
    return group


def test_a_plugins_settings_are_listed_and_read_like_tnt_cores(clean_runtime):
    tnt_core.get_plugin_manager().register(_plugin(_group("echo", "TNT_ECHO_", "TNT_ECHO_N")),
                                           name="echo")
    installed = installed_settings()
    assert list(installed.groups)[:4] == ["launcher", "settings", "plugins", "internal"]
    assert "echo" in installed.groups and installed.owner("echo") == "plugin 'echo'"
    assert installed.owner("launcher") == "tnt-core"
    assert installed.variables["TNT_ECHO_N"].group == "echo"
    assert read_setting("TNT_ECHO_N", {}) == 7
    assert read_setting("TNT_ECHO_N", {"TNT_ECHO_N": "12"}) == 12
    with pytest.raises(ConfigError, match=r"^TNT_ECHO_N=-1 must be >= 0$"):
        read_setting("TNT_ECHO_N", {"TNT_ECHO_N": "-1"})
    with pytest.raises(ConfigError, match=r"^TNT_ECHO_M is not a setting of plugin 'echo'; its "
                                          r"settings are TNT_ECHO_N$"):
        installed.variable("TNT_ECHO_M")  # a typo under the plugin's prefix


@pytest.mark.parametrize(("args", "words"), [
    (("TNT_OTHER_N",), "TNT_OTHER_N: the variables of setting group 'g' start with its prefix "
                       "TNT_G_"),
    (("TNT_G_",), "'TNT_G_' is not a TNT_* variable name"),
    (("TNT_G_N", "TNT_G_N"), "TNT_G_N declared twice in setting group 'g'"),
])
def test_a_name_outside_the_prefix_is_refused_where_it_is_declared(args, words):
    with pytest.raises(PluginError, match=f"^{re.escape(words)}"):
        _group("g", "TNT_G_", *args)
    with pytest.raises(PluginError, match=r"prefix 'TNT_G' must look like 'TNT_<NAME>_'"):
        SettingGroup("g", "title", prefix="TNT_G")


@pytest.mark.parametrize(("second", "words"), [
    (_group("b", "TNT_A_"), "tnt plugin 'one' and plugin 'two' both declare settings with the "
                            "prefix TNT_A_; uninstall one, or skip one with TNT_DISABLE_PLUGINS=two"),
    (_group("b", "TNT_A_B_"), "tnt plugin 'one' and plugin 'two' both declare settings with the "
                              "overlapping prefixes TNT_A_ and TNT_A_B_"),
    (_group("a", "TNT_B_"), "tnt plugin 'one' and plugin 'two' both declare a setting group named "
                            "'a'"),
])
def test_a_clash_between_two_plugins_names_both(clean_runtime, second, words):
    pm = tnt_core.get_plugin_manager()
    pm.register(_plugin(_group("a", "TNT_A_", "TNT_A_X")), name="one")
    pm.register(_plugin(second), name="two")
    with pytest.raises(PluginError) as err:
        installed_settings()
    assert str(err.value).startswith(words), str(err.value)


@pytest.mark.parametrize(("group", "words"), [
    (_group("mine", None), "tnt plugin 'p' declares the setting group 'mine' without a prefix; "
                           "a plugin's variables need one of their own, e.g. "
                           "SettingGroup('mine', ..., prefix='TNT_MINE_')"),
    (_group("log", "TNT_LOG_"), "tnt plugin 'p' declares settings with the prefix TNT_LOG_, which "
                                "tnt-core's TNT_LOG_LEVEL starts with"),
    (_group("launcher", "TNT_L_"), "tnt plugin 'p' declares a setting group named 'launcher', "
                                   "which is tnt-core's; rename it"),
    ("TNT_P_X", "tnt plugin 'p' passed 'TNT_P_X' to registry.add in tnt_register_settings; it "
                "takes a tnt_core.SettingGroup"),
])
def test_a_plugin_cannot_take_tnt_cores_names_or_go_without_a_prefix(clean_runtime, group, words):
    tnt_core.get_plugin_manager().register(_plugin(group), name="p")
    with pytest.raises(PluginError) as err:
        installed_settings()
    assert str(err.value).startswith(words), str(err.value)


def test_a_plugin_that_fails_while_declaring_is_named(clean_runtime):
    class Broken:
        @tnt_core.hookimpl
        def tnt_register_settings(self, registry):
            raise KeyError("oops")

    tnt_core.get_plugin_manager().register(Broken(), name="broken")
    with pytest.raises(PluginError, match=r"^tnt plugin 'broken' failed to declare its settings "
                                          r"\(tnt_register_settings\): KeyError: 'oops'$"):
        installed_settings()


def test_an_uncaught_clash_is_one_line_naming_both_plugins(tmp_path):
    """Through TNT_PLUGINS, as modules a user would write: the process ends with one line."""
    for name in ("first_plugin", "second_plugin"):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""\
            from tnt_core import SettingGroup, hookimpl

            GROUP = SettingGroup("{name.split('_')[0]}", "a test plugin", prefix="TNT_SAME_")
            GROUP.declare("TNT_SAME_N", "int", 1, "a test setting")


            @hookimpl
            def tnt_register_settings(registry):
                registry.add(GROUP)
            """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TNT_PLUGINS=f"{STORE_PLUGIN},first_plugin,second_plugin", PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", "import tnt_core; tnt_core.installed_settings()"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "tnt_core.PluginError: tnt plugin 'first_plugin' and plugin 'second_plugin' both "
        "declare settings with the prefix TNT_SAME_; uninstall one, or skip one with "
        "TNT_DISABLE_PLUGINS=second_plugin"], proc.stderr
