import pytest

from tnt_core import Config, ConfigError
from tnt_core._config import DEFAULT_FUSION_THRESHOLD_KB, DEFAULT_TIMEOUT_S


def test_defaults_describe_a_plain_single_process_run():
    cfg = Config.from_env({})
    assert (cfg.rank, cfg.size, cfg.local_rank, cfg.local_size) == (0, 1, 0, 1)
    assert cfg.launched is False
    assert cfg.backend is None and cfg.rendezvous is None
    assert cfg.fusion_threshold_kb == DEFAULT_FUSION_THRESHOLD_KB
    assert cfg.fusion_threshold_bytes == DEFAULT_FUSION_THRESHOLD_KB * 1024
    assert cfg.timeout_s == DEFAULT_TIMEOUT_S


def test_launcher_environment_is_read():
    cfg = Config.from_env({
        "TNT_RANK": "2", "TNT_SIZE": "4", "TNT_LOCAL_RANK": "0", "TNT_LOCAL_SIZE": "2",
        "TNT_BACKEND": "gloo", "TNT_RENDEZVOUS": "10.0.0.1:29500", "TNT_RENDEZVOUS_KEY": "k",
        "TNT_FUSION_THRESHOLD_KB": "0", "TNT_LOG_LEVEL": "debug", "TNT_LOG_ALL": "true",
        "TNT_OUTPUT_ALL": "0", "TNT_NUM_THREADS": "3", "TNT_TIMEOUT_S": "12.5",
    })
    assert (cfg.rank, cfg.size, cfg.local_rank, cfg.local_size) == (2, 4, 0, 2)
    assert cfg.launched and not cfg.is_master
    assert cfg.backend == "gloo"
    assert cfg.rendezvous_address() == ("10.0.0.1", 29500)
    assert cfg.fusion_threshold_bytes == 0
    assert cfg.log_level == "DEBUG" and cfg.log_all and not cfg.output_all
    assert cfg.num_threads == 3 and cfg.timeout_s == 12.5


def test_local_ranks_default_to_single_node():
    cfg = Config.from_env({"TNT_RANK": "1", "TNT_SIZE": "3"})
    assert (cfg.local_rank, cfg.local_size) == (1, 3)


@pytest.mark.parametrize("env, words", [
    ({"TNT_RANK": "x", "TNT_SIZE": "2"}, "TNT_RANK='x' is not an integer"),
    ({"TNT_RANK": "2", "TNT_SIZE": "2"}, "TNT_RANK=2 must be in [0, TNT_SIZE=2)"),
    ({"TNT_RANK": "0"}, "TNT_SIZE is not"),
    ({"TNT_SIZE": "0"}, "TNT_SIZE=0 must be >= 1"),
    ({"TNT_LOG_ALL": "maybe"}, "TNT_LOG_ALL='maybe' is not a boolean"),
    ({"TNT_LOG_LEVEL": "loud"}, "TNT_LOG_LEVEL='LOUD'"),
    ({"TNT_TIMEOUT_S": "-1"}, "TNT_TIMEOUT_S=-1.0 must be > 0"),
    ({"TNT_FUSION_THRESHOLD_KB": "big"}, "TNT_FUSION_THRESHOLD_KB='big' is not a number"),
    ({"TNT_SIZE": "2", "TNT_LOCAL_SIZE": "3", "TNT_LOCAL_RANK": "0"}, "larger than TNT_SIZE"),
])
def test_bad_environment_names_the_variable(env, words):
    with pytest.raises(ConfigError) as err:
        Config.from_env(env)
    assert words in str(err.value)


@pytest.mark.parametrize("value", ["nohost", "host:", ":80", "host:99999", "host:http"])
def test_bad_rendezvous_address(value):
    with pytest.raises(ConfigError, match="HOST:PORT"):
        Config(rendezvous=value).rendezvous_address()


def test_missing_rendezvous_says_how_to_launch():
    with pytest.raises(ConfigError, match="tnt run"):
        Config().rendezvous_address()


def test_ipv6_rendezvous():
    assert Config(rendezvous="[::1]:4000").rendezvous_address() == ("::1", 4000)


def test_overrides_are_validated():
    cfg = Config.from_env({"TNT_RANK": "0", "TNT_SIZE": "2"})
    assert cfg.with_overrides(rank=1).rank == 1
    with pytest.raises(ConfigError):
        cfg.with_overrides(rank=5)
    with pytest.raises(ConfigError, match="unknown config field"):
        cfg.with_overrides(ranks=1)
