"""The declarations of every TNT_* variable (tnt-core's and the installed plugins'):
complete, parsed by their rules, written back by Config.to_env so that Config.from_env
reads the same config."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

import tnt_core
from tnt_core import Config, ConfigError, installed_settings, read_setting
from tnt_core import _settings as settings

PACKAGES = Path(__file__).resolve().parents[2]
LITERAL = re.compile(r"TNT_[A-Z0-9_]+")


def _installed(package: Path) -> bool:
    try:
        metadata.distribution(package.name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _sources() -> list[Path]:
    """The sources of tnt-core and of the installed packages of the repository (a plugin's
    names are declared only when it is installed, e.g. not in tox's tnt-core env)."""
    packages = [p for p in PACKAGES.iterdir() if p.name == "tnt-core" or _installed(p)]
    files = [f for p in packages for f in p.glob("src/**/*.py")]
    files += [f for p in packages for f in p.glob("csrc/*") if f.is_file()]
    return files


#: the C names of tnt-core's headers (the native hand-off, the stall ledger): identifiers,
#: not environment variables
ABI_NAMES = {name for header in Path(tnt_core.NativeComm.include_dir()).glob("*.h")
             for pair in re.findall(r"#define (TNT_\w+)|\b(TNT_[A-Z0-9_]+) =", header.read_text())
             for name in pair if name}


def test_every_tnt_literal_in_the_sources_is_declared():
    declared = installed_settings().variables
    sources = _sources()
    assert len(sources) > 20
    assert any(p.suffix == ".cpp" for p in sources) or not _installed(PACKAGES / "tnt-comm-gloo")
    assert {"TNT_NATIVE_COMM_CAPSULE", "TNT_NATIVE_FLOAT32", "TNT_NATIVE_SUM",
            "TNT_STALL_LEDGER_ABI_VERSION", "TNT_STALL_ALLREDUCE"} <= ABI_NAMES
    missing = {}
    for path in sources:
        for name in set(LITERAL.findall(path.read_text(errors="replace"))) - ABI_NAMES:
            if name.endswith("_"):  # a prefix such as ``TNT_GLOO_*`` in a docstring
                if not any(v.startswith(name) for v in declared):
                    missing[name] = path
            elif name not in declared:
                missing[name] = path
    assert not missing, "declared neither by tnt-core nor by an installed plugin: " + ", ".join(
        f"{n} ({p.relative_to(PACKAGES)})" for n, p in sorted(missing.items()))


def test_declarations_are_complete():
    installed = installed_settings()
    for group in installed.groups.values():
        for name, var in group.variables.items():
            assert var.name == name and var.group == group.name
            assert name.startswith(group.prefix or "TNT_"), name
            assert var.kind in settings.KINDS, name
            assert var.doc and len(var.doc.splitlines()) == 1, name
            assert var.default_text, name
    for name, var in settings.VARIABLES.items():
        assert getattr(settings, name) is var  # tnt-core's: a module attribute of the same name


def test_config_round_trips_through_to_env():
    cfg = Config(rank=2, size=4, local_rank=0, local_size=2, backend="gloo",
                 rendezvous="10.0.0.1:29500", rendezvous_key="k", fusion_threshold_kb=0.5,
                 log_level="INFO", log_all=True, num_threads=3, timeout_s=12.5, launched=True)
    env = cfg.to_env()
    assert list(env) == ["TNT_RANK", "TNT_LOCAL_RANK", "TNT_LOCAL_SIZE", "TNT_NUM_THREADS",
                         "TNT_SIZE", "TNT_BACKEND", "TNT_RENDEZVOUS", "TNT_RENDEZVOUS_KEY",
                         "TNT_FUSION_THRESHOLD_KB", "TNT_LOG_LEVEL", "TNT_LOG_ALL",
                         "TNT_OUTPUT_ALL", "TNT_TIMEOUT_S"]
    assert env["TNT_FUSION_THRESHOLD_KB"] == "0.5" and env["TNT_LOG_ALL"] == "true"
    assert Config.from_env(env) == cfg


def test_to_env_of_defaults_and_of_chosen_names():
    env = Config().to_env()
    assert "TNT_BACKEND" not in env and "TNT_NUM_THREADS" not in env  # None: left out
    assert env["TNT_FUSION_THRESHOLD_KB"] == "2048" and env["TNT_TIMEOUT_S"] == "1800"
    assert Config(overlap=False).to_env(["TNT_OVERLAP", "TNT_SIZE"]) == {
        "TNT_SIZE": "1", "TNT_OVERLAP": "false"}
    with pytest.raises(ConfigError, match="TNT_GLOO_SHM"):
        Config().to_env(["TNT_GLOO_SHM"])


def test_defaults_come_from_the_declarations():
    cfg = Config.from_env({})
    assert cfg.fusion_threshold_kb == settings.TNT_FUSION_THRESHOLD_KB.default == 2048
    assert cfg.timeout_s == settings.TNT_TIMEOUT_S.default
    assert cfg.overlap is True and cfg.tensorboard_on_all_devices is False


@pytest.mark.parametrize("value, expected", [("1", True), ("Yes", True), ("off", False),
                                             ("", False), ("  ", False)])
def test_tensorboard_on_all_devices_accessor(value, expected):
    env = {"TNT_TENSORBOARD_ON_ALL_DEVICES": value}
    assert read_setting("TNT_TENSORBOARD_ON_ALL_DEVICES", env) is expected
    assert Config.from_env(env).tensorboard_on_all_devices is expected


@pytest.mark.parametrize("env, words", [
    ({"TNT_TENSORBOARD_ON_ALL_DEVICES": "sometimes"}, "TNT_TENSORBOARD_ON_ALL_DEVICES='sometimes'"),
    ({"TNT_OVERLAP": "maybe"}, "TNT_OVERLAP='maybe' is not a boolean"),
    ({"TNT_NUM_THREADS": "0"}, "TNT_NUM_THREADS=0 must be >= 1"),
])
def test_bad_settings_name_the_variable(env, words):
    with pytest.raises(ConfigError) as err:
        Config.from_env(env)
    assert words in str(err.value)


def test_kinds():
    assert read_setting("TNT_PLUGINS", {"TNT_PLUGINS": " a, b ,,"}) == ["a", "b"]
    assert read_setting("TNT_PLUGINS", {}) == []
    assert read_setting("TNT_MPI_CUDA_AWARE", {"TNT_MPI_CUDA_AWARE": "auto"}) is None
    assert read_setting("TNT_MPI_CUDA_AWARE", {"TNT_MPI_CUDA_AWARE": "0"}) is False
    assert read_setting("TNT_GLOO_SHM", {"TNT_GLOO_SHM": " AUTO "}) == "auto"
    with pytest.raises(ConfigError, match=r"TNT_GLOO_SHM='yes' is not one of auto \(.*\), 0 .* or 1"):
        read_setting("TNT_GLOO_SHM", {"TNT_GLOO_SHM": "yes"})
    with pytest.raises(ConfigError, match="TNT_NOPE is not a Tarantella-NT variable"):
        read_setting("TNT_NOPE", {})
