"""tnt-core's backend conformance suite, run against this plugin with real processes."""

from tnt_core.testing.suite import BackendConformance


class TestLoopbackConformance(BackendConformance):
    backend = "loopback"
    nprocs = (2, 3)
    dead_peer_timeout_s = 10.0
