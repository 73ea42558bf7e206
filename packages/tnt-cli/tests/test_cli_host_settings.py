"""TNT_* values with a rule beyond their kind: checked by tnt run before any rank starts.

A declared rule (TNT_GLOO_SHM_CHUNK_BYTES: a multiple of 64 in [4096, 64 MiB]) is part of
the declaration, so the launcher's check of every exported and ``-x`` value covers it. A
rule about a host (an interface that exists, a name of this host, a directory that can be
written) is checked for the ranks tnt run starts on its own host, and a backend's
variables only when the job runs that backend. Before, each of these failed on the ranks,
with a traceback each (TNT_GLOO_HOSTNAME: inside Gloo's connect, without naming it).
"""

from __future__ import annotations

import pytest

from tnt_cli.hostfile import Host
from tnt_cli.job import Job
from tnt_cli.options import parse_run_args
from tnt_cli.placement import place_ranks
from tnt_core import ConfigError, installed_settings

pytestmark = pytest.mark.timeout(60)


def _job(monkeypatch, exported: dict[str, str], *args: str, host: str = "localhost") -> Job:
    for name in installed_settings().variables:  # tnt-core's and the plugins'
        monkeypatch.delenv(name, raising=False)
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    options = parse_run_args([*args, "--", "train.py"])
    placement = place_ranks([Host(host)], 2, None, 1, None)
    return Job(options=options, placement=placement, command=["python", "train.py"], cwd="/",
               gpus=None, hide_gpus=False, agent_python="python", cores=8)


BAD = [
    ("TNT_GLOO_SHM_CHUNK_BYTES", "100",
     "TNT_GLOO_SHM_CHUNK_BYTES=100 must be a multiple of 64 between 4096 and 67108864"),
    ("TNT_GLOO_SHM_CHUNK_BYTES", "4100", "must be a multiple of 64"),
    ("TNT_GLOO_IFACE", "nope0", "TNT_GLOO_IFACE='nope0' is not a network interface of "),
    ("TNT_GLOO_HOSTNAME", "no-such-host.invalid",
     "TNT_GLOO_HOSTNAME='no-such-host.invalid' does not resolve on "),
    ("TNT_TIMELINE", "/dev/null/timeline.json",
     "TNT_TIMELINE='/dev/null/timeline.json' cannot be written: /dev/null is not a directory"),
]


@pytest.mark.parametrize(("name", "value", "expected"), BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_a_value_against_its_rule_fails_in_the_launcher(monkeypatch, name, value, expected):
    with pytest.raises(ConfigError) as err:
        _job(monkeypatch, {name: value}, "--backend", "gloo").settings()
    assert expected in str(err.value) and str(err.value).endswith(
        "(exported in the shell that runs tnt run)")
    with pytest.raises(ConfigError, match=rf"\(-x {name}=\.\.\.\)$"):
        _job(monkeypatch, {}, "--backend", "gloo", "-x", f"{name}={value}").settings()


def test_the_rules_of_a_backend_apply_only_when_the_job_runs_it(monkeypatch):
    exported = {"TNT_GLOO_IFACE": "nope0", "TNT_GLOO_HOSTNAME": "no-such-host.invalid"}
    _job(monkeypatch, exported, "--backend", "mpi").settings()  # gloo's settings: not used
    pytest.importorskip("tnt_comm_gloo")
    with pytest.raises(ConfigError, match="TNT_GLOO_IFACE"):  # the ranks would choose gloo
        _job(monkeypatch, {"TNT_GLOO_IFACE": "nope0"}).settings()


def test_host_rules_are_left_to_remote_ranks(monkeypatch):
    """An interface of another host need not exist here: its ranks check it as they start."""
    _job(monkeypatch, {"TNT_GLOO_IFACE": "ib7"}, "--backend", "gloo",
         host="remote-node.invalid").settings()


def test_good_values_pass(monkeypatch, tmp_path):
    import socket

    loopback = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    _job(monkeypatch, {"TNT_GLOO_IFACE": loopback, "TNT_GLOO_HOSTNAME": "127.0.0.1",
                       "TNT_GLOO_SHM_CHUNK_BYTES": "65536",
                       "TNT_TIMELINE": str(tmp_path / "new" / "dir" / "t.json")},
         "--backend", "gloo").settings()
    assert not (tmp_path / "new").exists(), "a check makes no directory; the ranks do"


def test_tnt_run_refuses_in_one_line_before_any_rank_starts(run_tnt, h, tmp_path):
    res = run_tnt("-n", "2", "--", h.rank_script("marker.py"),
                  env={"TNT_GLOO_SHM_CHUNK_BYTES": "100"})
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        "tnt run: error: TNT_GLOO_SHM_CHUNK_BYTES=100 must be a multiple of 64 between 4096 and "
        "67108864 (exported in the shell that runs tnt run)"]
    assert not list(tmp_path.glob("ran.*"))
