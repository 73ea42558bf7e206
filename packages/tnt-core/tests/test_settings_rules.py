"""The rules of TNT_* values beyond their kind, and how a bad value ends a process.

* A rule is part of the declaration (``minimum``/``maximum``/``multiple_of``), so every
  reader and ``tnt run`` apply the same one; ``host_check`` is a rule about the host that
  uses the value (checked by the rank, and by ``tnt run`` for ranks on its own host).
* A bad value, a plugin module that cannot be imported: when nothing catches the error, the
  process ends with ONE line (``module.Class: message``), not a traceback through tnt-core
  (all of it with ``TNT_LOG_LEVEL=DEBUG``).
* ``TNT_DISABLE_PLUGINS`` naming no installed plugin: one warning line, no failure (a site
  may disable a plugin that only some of its nodes have).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import pytest

import tnt_core
from tnt_core import ConfigError, SettingGroup, Timeline
from tnt_core import _settings as settings

#: variables of a plugin's kind, declared here so that tnt-core's tests need no plugin
RULES = SettingGroup("rules", "variables of this test", prefix="TNT_RULES_")
CHUNK = RULES.declare("TNT_RULES_CHUNK_BYTES", "int", 1 << 20, "bytes per slot",
                      minimum=4096, maximum=64 << 20, multiple_of=64, unit="bytes")
IFACE = RULES.declare("TNT_RULES_IFACE", "str", None, "an interface",
                      host_check=settings.interface_problem)


def test_a_declared_rule_reads_the_same_as_it_is_listed():
    assert CHUNK.read({CHUNK.name: "65536"}) == 65536
    assert CHUNK.allowed == "an integer, a multiple of 64 between 4096 and 67108864 (bytes)"
    for bad in ("100", "4100", str(128 << 20), "0"):
        with pytest.raises(ConfigError, match=rf"^TNT_RULES_CHUNK_BYTES={bad} must be a "
                                              r"multiple of 64 between 4096 and 67108864$"):
            CHUNK.read({CHUNK.name: bad})


@pytest.mark.parametrize(("kwargs", "value", "words"), [
    ({"minimum": 0}, "-1", "must be >= 0"),
    ({"above": 0.0}, "0", "must be > 0.0"),
    ({"minimum": 0, "maximum": 10}, "11", "must be between 0 and 10"),
    ({"multiple_of": 8}, "12", "must be a multiple of 8"),
    ({"multiple_of": 8, "minimum": 8}, "4", "must be a multiple of 8 and >= 8"),
])
def test_number_rules_read_the_same_everywhere(kwargs, value, words):
    with pytest.raises(ConfigError, match=rf"^X={value} {words}$"):
        settings.env_number({"X": value}, "X", 0, integer=True, **kwargs)


def test_host_rules():
    loopback = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    assert settings.interface_problem(loopback) is None
    assert "is not a network interface of" in settings.interface_problem("nope0")
    assert settings.local_address_problem("127.0.0.1") is None
    assert settings.local_address_problem("localhost") is None
    assert "does not resolve on" in settings.local_address_problem("no-such-host.invalid")
    assert "not an address of" in settings.local_address_problem("192.0.2.1")  # TEST-NET-1
    with pytest.raises(ConfigError, match=r"^TNT_RULES_IFACE='nope0' is not a network interface"):
        IFACE.check_host("nope0")


def test_timeline_directory_rule(tmp_path):
    assert settings.directory_problem(str(tmp_path / "a" / "b" / "t.json")) is None
    assert settings.directory_problem(str(tmp_path / "{rank}" / "t.json")) is None
    (tmp_path / "file").write_text("")
    assert settings.directory_problem(str(tmp_path / "file" / "t.json")) == (
        f"cannot be written: {tmp_path / 'file'} is not a directory")


def test_a_timeline_makes_its_directory_at_the_start_or_fails_naming_the_variable(tmp_path):
    """Before, a missing directory was made (or failed, with a warning) when the trace was
    written, after the training."""
    tl = Timeline(tmp_path / "new" / "dir" / "t.json", rank=1)
    assert (tmp_path / "new" / "dir").is_dir()
    assert tl.close() == tmp_path / "new" / "dir" / "t.rank1.json"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^TNT_TIMELINE='.*/file/t.json' cannot be written: "):
        Timeline(tmp_path / "file" / "t.json")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=60)


def test_an_uncaught_bad_value_ends_the_process_with_one_line():
    code = "import tnt_core\ntnt_core.read_setting('TNT_STALL_WARN_S')\n"
    proc = _python(code, TNT_STALL_WARN_S="-1")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "tnt_core.ConfigError: TNT_STALL_WARN_S=-1.0 must be >= 0.0"]
    debug = _python(code, TNT_STALL_WARN_S="-1", TNT_LOG_LEVEL="debug")
    assert debug.returncode == 1 and debug.stderr.startswith("Traceback"), debug.stderr


def test_a_plugin_module_that_cannot_be_imported_is_one_line():
    proc = _python("import tnt_core\ntnt_core.init()\n", TNT_PLUGINS="no_such_plugin_module")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "tnt_core.PluginError: cannot import plugin module 'no_such_plugin_module' named "
        "in TNT_PLUGINS: No module named 'no_such_plugin_module'"]


def test_other_errors_keep_their_traceback():
    code = ("import tnt_core\ntry:\n    tnt_core.read_setting('TNT_OVERLAP')\nexcept ValueError:\n"
            "    pass\nraise KeyError('mine')\n")
    proc = _python(code, TNT_OVERLAP="maybe")
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback") and proc.stderr.endswith("KeyError: 'mine'\n")


def test_disabling_an_unknown_plugin_warns_naming_the_installed_ones(clean_runtime, caplog):
    clean_runtime.setenv("TNT_DISABLE_PLUGINS", "no_such_plugin")
    with caplog.at_level(logging.WARNING, logger="tnt.plugins"):
        tnt_core.get_plugin_manager()
    lines = [r.getMessage() for r in caplog.records if r.name == "tnt.plugins"]
    assert len(lines) == 1 and lines[0].startswith(
        "TNT_DISABLE_PLUGINS names 'no_such_plugin', which no installed tnt plugin is called "
        "(installed: "), lines
    assert "local" in [s.name for s in tnt_core.list_backends()]  # nothing else changed


def test_disabling_a_known_plugin_says_nothing(clean_runtime, caplog):
    from importlib.metadata import entry_points

    names = [ep.name for ep in entry_points(group=tnt_core.ENTRY_POINT_GROUP)]
    clean_runtime.setenv("TNT_DISABLE_PLUGINS", ",".join(names + ["tnt_core.testing.store_backend"]))
    with caplog.at_level(logging.WARNING, logger="tnt.plugins"):
        tnt_core.get_plugin_manager()
    assert not [r for r in caplog.records if r.name == "tnt.plugins"]

