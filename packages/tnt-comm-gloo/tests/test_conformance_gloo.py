"""tnt-core's backend conformance suite against the gloo backend, with real processes.

By default (``TNT_GLOO_SHM=auto``, every rank on this host) allreduce runs over shared
memory: 2 ranks reduce every chunk whole, 3 and 4 ranks reduce-scatter the large ones;
broadcast, allgather and barrier run over TCP in the same queue. With ``TNT_GLOO_SHM=0``
the TCP algorithms take the allreduce: 2 ranks use recursive doubling and the ring; 3
ranks, with bcube's limit lowered to 8 KiB, halving-doubling (a pair folded into one) for
the small buffers and the ring for the 64 MiB one.

One dead-peer job (3 ranks, over shared memory); a peer dying in a TCP allreduce is
covered by ``test_native_comm.py`` (kill-tcp) and the repository's
``tests/test_docs_messages.py`` (the quoted error, ``TNT_GLOO_SHM=0``).
"""

from typing import ClassVar

from tnt_core.testing.suite import BackendConformance


class TestGlooConformance(BackendConformance):
    backend = "gloo"
    nprocs = (2, 3, 4)
    dead_peer_nprocs = 3


class TestGlooConformanceTcp(BackendConformance):
    backend = "gloo"
    nprocs = (2,)
    dead_peer_nprocs = None
    extra_env: ClassVar[dict[str, str]] = {"TNT_GLOO_SHM": "0"}


class TestGlooConformanceTcpThreeRanks(BackendConformance):
    backend = "gloo"
    nprocs = (3,)
    dead_peer_nprocs = None
    extra_env: ClassVar[dict[str, str]] = {"TNT_GLOO_SHM": "0", "TNT_GLOO_BCUBE_MAX_BYTES": "8192"}
