"""Policy in backend.py that needs no second process: settings, addresses, algorithm."""

from __future__ import annotations

import socket

import pytest

from tnt_comm_gloo.backend import (
    DEFAULT_BCUBE_MAX_BYTES,
    DEFAULT_DOUBLING_MAX_BYTES,
    DEFAULT_SHM_CHUNK_BYTES,
    GlooBackend,
    GlooSettings,
    _file_store_dir,
)
from tnt_core import Config, ConfigError


def test_defaults() -> None:
    s = GlooSettings.from_env({})
    assert (s.iface, s.hostname, s.algorithm, s.bcube_max_bytes, s.doubling_max_bytes) == (
        None, None, "auto", DEFAULT_BCUBE_MAX_BYTES, DEFAULT_DOUBLING_MAX_BYTES)
    assert (s.shm, s.shm_chunk_bytes, s.shm_spin_us, s.shm_host_id, s.hierarchy) == (
        "auto", DEFAULT_SHM_CHUNK_BYTES, None, None, "auto")


def test_shm_settings() -> None:
    for raw, value in (("auto", "auto"), (" AUTO ", "auto"), ("0", "0"), ("1", "1"), ("", "auto")):
        assert GlooSettings.from_env({"TNT_GLOO_SHM": raw}).shm == value
        assert GlooSettings.from_env({"TNT_GLOO_HIERARCHY": raw}).hierarchy == value
    s = GlooSettings.from_env({"TNT_GLOO_SHM_CHUNK_BYTES": "65536", "TNT_GLOO_SHM_SPIN_US": "0",
                               "TNT_GLOO_SHM_HOST_ID": " box-7 ", "TNT_GLOO_SHM_COPY": " Cache"})
    assert (s.shm_chunk_bytes, s.shm_spin_us, s.shm_host_id, s.shm_copy) == (65536, 0, "box-7",
                                                                             "cache")
    assert GlooSettings.from_env({}).shm_copy == "auto"


@pytest.mark.parametrize(("env", "fragment"), [
    ({"TNT_GLOO_ALGORITHM": "tree"}, "TNT_GLOO_ALGORITHM"),
    ({"TNT_GLOO_BCUBE_MAX_BYTES": "lots"}, "not an integer"),
    ({"TNT_GLOO_BCUBE_MAX_BYTES": "-1"}, ">= 0"),
    ({"TNT_GLOO_DOUBLING_MAX_BYTES": "1e3"}, "TNT_GLOO_DOUBLING_MAX_BYTES"),
    ({"TNT_GLOO_SHM": "yes"}, r"TNT_GLOO_SHM='yes' is not one of auto .*, 0 .* or 1"),
    ({"TNT_GLOO_SHM": "2"}, "TNT_GLOO_SHM"),
    ({"TNT_GLOO_HIERARCHY": "on"}, r"TNT_GLOO_HIERARCHY='on' is not one of auto .*, 0 .* or 1"),
    ({"TNT_GLOO_SHM_CHUNK_BYTES": "1000"}, "multiple of 64 between 4096 and"),
    ({"TNT_GLOO_SHM_CHUNK_BYTES": str(1 << 30)}, "TNT_GLOO_SHM_CHUNK_BYTES"),
    ({"TNT_GLOO_SHM_SPIN_US": "fast"}, "TNT_GLOO_SHM_SPIN_US"),
    ({"TNT_GLOO_SHM_SPIN_US": "-5"}, "between 0 and"),
    ({"TNT_GLOO_SHM_COPY": "nt"}, r"TNT_GLOO_SHM_COPY='nt' is not one of auto .*, stream .* or cache"),
])
def test_bad_settings_name_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        GlooSettings.from_env(env)


def test_algorithm_choice() -> None:
    auto = GlooSettings.from_env({"TNT_GLOO_BCUBE_MAX_BYTES": "4096",
                                  "TNT_GLOO_DOUBLING_MAX_BYTES": "1024"})
    # 2 ranks: doubling for every small buffer, the ring above
    assert auto.algorithm_for(4096, 2) == "doubling"
    assert auto.algorithm_for(4097, 2) == "ring"
    # more ranks, power of two: doubling only for the smallest, then bcube
    assert auto.algorithm_for(1024, 8) == "doubling"
    assert auto.algorithm_for(1025, 8) == "bcube"
    assert auto.algorithm_for(4097, 8) == "ring"
    # not a power of two: never doubling
    assert auto.algorithm_for(16, 3) == "bcube"
    assert auto.algorithm_for(4097, 3) == "ring"
    assert GlooSettings.from_env({"TNT_GLOO_ALGORITHM": "RING"}).algorithm_for(4, 2) == "ring"
    forced = GlooSettings.from_env({"TNT_GLOO_ALGORITHM": "bcube"})
    assert forced.algorithm_for(1 << 30, 2) == "bcube"


def test_single_node_listens_on_loopback() -> None:
    cfg = Config(rank=0, size=4, local_rank=0, local_size=4)
    assert GlooSettings().listen_address(cfg) == ("127.0.0.1", "")


def test_explicit_interface_and_hostname_win() -> None:
    cfg = Config(rank=0, size=4, local_rank=0, local_size=2)
    loopback = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    assert GlooSettings(iface=loopback).listen_address(cfg) == ("", loopback)
    assert GlooSettings(hostname="127.0.0.2").listen_address(cfg) == ("127.0.0.2", "")


def test_unknown_interface_lists_the_real_ones() -> None:
    cfg = Config(rank=0, size=2, local_rank=0, local_size=2)
    with pytest.raises(ConfigError, match="not a network interface") as info:
        GlooSettings(iface="nosuchif0").listen_address(cfg)
    assert "lo" in str(info.value)


@pytest.mark.parametrize(("hostname", "fragment"), [
    ("no-such-host.invalid", "does not resolve on"),
    ("192.0.2.1", r"resolves to 192\.0\.2\.1, not an address of"),  # TEST-NET-1: no host's
])
def test_a_hostname_that_is_not_this_host_is_named_before_gloo_connects(
        hostname: str, fragment: str) -> None:
    cfg = Config(rank=0, size=2, local_rank=0, local_size=2)
    with pytest.raises(ConfigError, match=rf"^TNT_GLOO_HOSTNAME='{hostname}' {fragment}"):
        GlooSettings(hostname=hostname).listen_address(cfg)


def _fake_network(monkeypatch: pytest.MonkeyPatch, name: str | None, route: str | None) -> list[str]:
    """This host as name resolution and the kernel's routing table describe it: its name
    resolves to ``name`` (None: it does not resolve), and a route to any host leaves
    through ``route`` (None: there is none), as a connected UDP socket reports it. Returns
    the hosts a route was asked for."""
    asked: list[str] = []
    real_socket = socket.socket

    def getaddrinfo(host, port, *args, **kwargs):
        if kwargs.get("type") == socket.SOCK_DGRAM:  # a route probe's target
            asked.append(host)
            return [(socket.AF_INET, socket.SOCK_DGRAM, 17, "", (host, port))]
        if name is None:
            raise socket.gaierror("Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (name, 0))]

    class RouteProbe:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def connect(self, address):
            if route is None:
                raise OSError("Network is unreachable")

        def getsockname(self):
            return (route, 0)

    def make_socket(family=socket.AF_INET, type=socket.SOCK_STREAM, *args, **kwargs):
        if type == socket.SOCK_DGRAM:
            return RouteProbe()
        return real_socket(family, type, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "socket", make_socket)
    return asked


def test_multi_node_takes_the_route_to_the_rendezvous_host_when_the_name_is_loopback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config(rank=0, size=4, local_rank=0, local_size=2, rendezvous="10.9.8.7:29500")
    asked = _fake_network(monkeypatch, "127.0.1.1", "10.9.8.20")
    assert GlooSettings().listen_address(cfg) == ("10.9.8.20", "")
    assert asked == ["10.9.8.7"]
    # a name that does not resolve: the same
    _fake_network(monkeypatch, None, "10.9.8.20")
    assert GlooSettings().listen_address(cfg) == ("10.9.8.20", "")
    # a name that resolves to a real address wins
    _fake_network(monkeypatch, "10.1.2.3", "10.9.8.20")
    assert GlooSettings().listen_address(cfg) == (socket.gethostname(), "")


def test_multi_node_refuses_when_neither_name_nor_route_reaches_other_nodes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_network(monkeypatch, "127.0.1.1", "127.0.0.1")
    cfg = Config(rank=0, size=4, local_rank=0, local_size=2, rendezvous="10.9.8.7:29500")
    with pytest.raises(ConfigError, match=r"loopback address.*10\.9\.8\.7.*TNT_GLOO_IFACE"):
        GlooSettings().listen_address(cfg)
    _fake_network(monkeypatch, "127.0.1.1", None)
    with pytest.raises(ConfigError, match="TNT_GLOO_HOSTNAME"):
        GlooSettings().listen_address(cfg)
    # a file store names no host to route to
    cfg = Config(rank=0, size=4, local_rank=0, local_size=2, rendezvous="file:///tmp/tnt-store")
    with pytest.raises(ConfigError, match=r"rendezvous host \(none\)"):
        GlooSettings().listen_address(cfg)


def test_file_store_urls() -> None:
    assert _file_store_dir("127.0.0.1:29500") is None
    assert _file_store_dir("file:///shared/job7") == "/shared/job7"
    with pytest.raises(ConfigError, match="absolute"):
        _file_store_dir("file://relative/dir")


@pytest.mark.parametrize(("cfg", "settings", "fragment"), [
    (Config(rank=0, size=1), None, "TNT_SIZE >= 2"),
    (Config(rank=0, size=2, local_size=2), None, "TNT_RENDEZVOUS"),
    (Config(rank=0, size=3, local_size=3, rendezvous="127.0.0.1:1"),
     GlooSettings(algorithm="doubling"), "power-of-two"),
])
def test_backend_refuses_jobs_it_cannot_serve(cfg: Config, settings, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        GlooBackend(cfg, settings)
