"""How tnt run builds the ranks' environment: -x > options > exported variables > defaults,
written through tnt_core's declarations (Config.to_env). No processes."""

from __future__ import annotations

import dataclasses

import pytest

from tnt_cli.hostfile import Host
from tnt_cli.job import Job, Rendezvous, job_settings
from tnt_cli.options import parse_run_args
from tnt_cli.placement import place_ranks
from tnt_cli.run import run_command
from tnt_core import VARIABLES, Config, ConfigError, installed_settings

RDV = Rendezvous("127.0.0.1:4000", "k" * 32)


def _job(*args: str) -> Job:
    options = parse_run_args([*args, "--", "train.py"])
    placement = place_ranks([Host("localhost")], 2, None, 1, None)
    return Job(options=options, placement=placement, command=["python", "train.py"], cwd="/",
               gpus=None, hide_gpus=False, agent_python="python", cores=8)


def _env(monkeypatch, exported: dict[str, str], *args: str) -> dict[str, str]:
    for name in installed_settings().variables:  # tnt-core's and the plugins'
        monkeypatch.delenv(name, raising=False)
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    job = _job(*args)
    return dict(job.rank_env(job.placement.slots[1], RDV))


def test_defaults_come_from_the_declarations(monkeypatch):
    env = _env(monkeypatch, {})
    assert env["TNT_FUSION_THRESHOLD_KB"] == "2048"
    assert env["TNT_TIMEOUT_S"] == "1800" and env["TNT_LOG_LEVEL"] == "WARNING"
    assert env["TNT_LOG_ALL"] == env["TNT_OUTPUT_ALL"] == "false"
    assert "TNT_BACKEND" not in env
    assert (env["TNT_RANK"], env["TNT_SIZE"], env["TNT_LOCAL_RANK"]) == ("1", "2", "1")
    assert env["TNT_NUM_THREADS"] == "4" and env["TNT_RENDEZVOUS_KEY"] == "k" * 32
    assert Config.from_env(env).fusion_threshold_kb == VARIABLES["TNT_FUSION_THRESHOLD_KB"].default


def test_exported_variables_are_not_overwritten_by_defaults(monkeypatch):
    env = _env(monkeypatch, {"TNT_TIMEOUT_S": "60", "TNT_FUSION_THRESHOLD_KB": "512",
                             "TNT_LOG_LEVEL": "info", "TNT_OUTPUT_ALL": "1"})
    assert env["TNT_TIMEOUT_S"] == "60" and env["TNT_FUSION_THRESHOLD_KB"] == "512"
    assert env["TNT_LOG_LEVEL"] == "INFO" and env["TNT_OUTPUT_ALL"] == "true"


def test_options_win_over_exported_variables(monkeypatch):
    env = _env(monkeypatch, {"TNT_TIMEOUT_S": "60", "TNT_FUSION_THRESHOLD_KB": "512",
                             "TNT_LOG_LEVEL": "INFO"},
               "--timeout", "5", "--fusion-threshold", "64", "--log-level", "error")
    assert env["TNT_TIMEOUT_S"] == "5" and env["TNT_FUSION_THRESHOLD_KB"] == "64"
    assert env["TNT_LOG_LEVEL"] == "ERROR"


def test_x_wins_over_options_and_comes_last(monkeypatch):
    monkeypatch.setenv("TNT_TIMEOUT_S", "60")
    job = _job("--timeout", "5", "-x", "TNT_TIMEOUT_S=7", "TNT_OUTPUT_ALL=yes")
    pairs = job.rank_env(job.placement.slots[0], RDV)
    assert pairs[-2:] == [("TNT_TIMEOUT_S", "7"), ("TNT_OUTPUT_ALL", "yes")]
    assert dict(pairs)["TNT_TIMEOUT_S"] == "7"
    settings_ = job.settings()
    assert settings_.timeout_s == 7 and settings_.output_all is True
    assert job.agent_spec(None, RDV, remote=False)["output_all"] is True


def test_the_agent_binds_a_rank_to_its_slots_share_of_the_host():
    """The agent spec's ``share``: the local rank among the host's ranks, or the share an
    elastic job gave a later rank (``RankSlot.cores``)."""
    job = _job()
    slot = job.placement.slots[1]
    assert job.agent_spec(slot, RDV, remote=False)["share"] == [1, 2]
    moved = dataclasses.replace(slot, cores=(0, 2))
    assert job.agent_spec(moved, RDV, remote=False)["share"] == [0, 2]
    assert job.agent_spec(None, RDV, remote=False)["share"] is None  # mpirun/srun's rank


@pytest.mark.parametrize("exported, words", [
    ({"TNT_FUSION_THRESHOLD_KB": "abc"}, "TNT_FUSION_THRESHOLD_KB='abc' is not a number"),
    ({"TNT_TIMEOUT_S": "0"}, "TNT_TIMEOUT_S=0.0 must be > 0"),
    ({"TNT_LOG_LEVEL": "loud"}, "TNT_LOG_LEVEL='LOUD' is not one of DEBUG"),
    ({"TNT_LOG_ALL": "maybe"}, "TNT_LOG_ALL='maybe' is not a boolean"),
])
def test_an_exported_bad_value_fails_naming_the_variable(monkeypatch, exported, words):
    with pytest.raises(ConfigError) as err:
        _env(monkeypatch, exported)
    assert words in str(err.value) and "exported" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_x_value_of_a_declared_variable_fails(monkeypatch):
    with pytest.raises(ConfigError, match=r"TNT_OVERLAP='sometimes' is not a boolean.*-x"):
        _env(monkeypatch, {}, "-x", "TNT_OVERLAP=sometimes")


def test_an_exported_bad_value_ends_tnt_run_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("TNT_FUSION_THRESHOLD_KB", "abc")
    code = run_command(["-n", "2", "--dry-run", "--python-interpreter", "", "--", "true"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        "tnt run: error: TNT_FUSION_THRESHOLD_KB='abc' is not a number "
        "(exported in the shell that runs tnt run)"]


def test_job_settings_without_options(monkeypatch):
    cfg = job_settings(parse_run_args(["--", "x"]), 3, {"TNT_BACKEND": "gloo", "TNT_RANK": "9"})
    assert cfg.backend == "gloo" and cfg.size == 3
    assert cfg.rank == 0  # only the job-wide settings are taken from the shell


def test_x_with_a_plugins_prefix_names_the_plugins_settings():
    """A typo (-x TNT_GLOO_SHMM=0) would reach the ranks and be ignored there."""
    installed = installed_settings()
    if not installed.plugin_groups:
        pytest.skip("no installed plugin declares settings")
    group = installed.plugin_groups[0]
    name = f"{group.prefix}NO_SUCH_SETTING"
    with pytest.raises(ConfigError) as err:
        job_settings(parse_run_args(["-x", f"{name}=1", "--", "x"]), 2, {})
    assert str(err.value) == (
        f"{name} is not a setting of {installed.owner(group.name)}; its settings are "
        f"{', '.join(group.variables)} (-x {name}=...)")
