"""The conformance suite against the reference store backend: proves the suite itself
(it runs, passes on a correct backend, and catches a dead peer within the timeout)."""

from tnt_core.testing.suite import BackendConformance


class TestStoreBackendConformance(BackendConformance):
    backend = "store"
    nprocs = (2, 3)
    dead_peer_timeout_s = 5.0
