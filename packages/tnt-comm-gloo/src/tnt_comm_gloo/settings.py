"""The ``TNT_GLOO_*`` settings of the ``gloo`` backend: declared here, once.

:mod:`tnt_comm_gloo.backend` reads them through these declarations
(:class:`~tnt_comm_gloo.backend.GlooSettings`), and the plugin hands the group to tnt-core
(``tnt_register_settings`` in :mod:`tnt_comm_gloo.plugin`), so that ``tnt run`` checks a
value before any rank starts and ``tnt settings`` and the docs list them. Imports nothing
but tnt-core: loading the plugin stays cheap.
"""

from __future__ import annotations

from tnt_core import SettingGroup, interface_problem, local_address_problem

__all__ = [
    "GLOO",
    "TNT_GLOO_ALGORITHM",
    "TNT_GLOO_BCUBE_MAX_BYTES",
    "TNT_GLOO_CUDART",
    "TNT_GLOO_DOUBLING_MAX_BYTES",
    "TNT_GLOO_HIERARCHY",
    "TNT_GLOO_HOSTNAME",
    "TNT_GLOO_IFACE",
    "TNT_GLOO_SHM",
    "TNT_GLOO_SHM_CHUNK_BYTES",
    "TNT_GLOO_SHM_COPY",
    "TNT_GLOO_SHM_HOST_ID",
    "TNT_GLOO_SHM_SPIN_US",
]

GLOO = SettingGroup("gloo", "the `gloo` backend (tnt-comm-gloo)", prefix="TNT_GLOO_")

TNT_GLOO_IFACE = GLOO.declare(
    "TNT_GLOO_IFACE", "str", None,
    "network interface to listen on (e.g. `eth0`); wins over the host name",
    host_check=interface_problem)
TNT_GLOO_HOSTNAME = GLOO.declare(
    "TNT_GLOO_HOSTNAME", "str", None, "address or host name to listen on",
    default_doc="loopback on one node, else the host name (or the route to the rendezvous host)",
    host_check=local_address_problem)
TNT_GLOO_ALGORITHM = GLOO.declare(
    "TNT_GLOO_ALGORITHM", "choice", "auto",
    "the allreduce algorithm: `auto`, `ring`, `bcube` or `doubling` (power-of-two ranks)",
    case="lower", choices=tuple((c, "") for c in ("auto", "ring", "bcube", "doubling")))
#: measured on 2 ranks over loopback (tnt-comm-gloo's README)
TNT_GLOO_BCUBE_MAX_BYTES = GLOO.declare(
    "TNT_GLOO_BCUBE_MAX_BYTES", "int", 1 << 20,
    "with `auto`, buffers up to this size are small (bcube or doubling); larger take the ring",
    minimum=0, unit="bytes")
#: recursive doubling sends log2(p) whole buffers, against bcube's two
TNT_GLOO_DOUBLING_MAX_BYTES = GLOO.declare(
    "TNT_GLOO_DOUBLING_MAX_BYTES", "int", 64 << 10,
    "with `auto` on more than 2 ranks (a power of two), doubling up to this size, then bcube",
    minimum=0, unit="bytes")
TNT_GLOO_SHM = GLOO.declare(
    "TNT_GLOO_SHM", "choice", "auto",
    "allreduce and point-to-point messages through shared memory when every rank is on one "
    "host", case="lower",
    choices=(("auto", "shared memory when every rank is on this host"), ("0", "always TCP"),
             ("1", "shared memory, else fail")))
TNT_GLOO_HIERARCHY = GLOO.declare(
    "TNT_GLOO_HIERARCHY", "choice", "auto",
    "hierarchical allreduce when the ranks are on several hosts, several on some (shared "
    "memory within a host, TCP between hosts)", case="lower",
    choices=(("auto", "hierarchical when every host holds as many ranks, >= 2"),
             ("0", "the flat TCP algorithms across hosts"),
             ("1", "hierarchical, else fail")))
#: two slots per rank, so 4 ranks keep 2 MiB in /dev/shm (Docker's default is 64 MiB); 256
#: KiB measured faster than 1 MiB (README, "Why 256 KiB chunks, and the streamed result")
TNT_GLOO_SHM_CHUNK_BYTES = GLOO.declare(
    "TNT_GLOO_SHM_CHUNK_BYTES", "int", 256 << 10,
    "bytes per shared-memory slot (two per rank), a multiple of 64 in [4096, 64 MiB]; the "
    "same on every rank", minimum=4096, maximum=64 << 20, multiple_of=64, unit="bytes")
TNT_GLOO_SHM_SPIN_US = GLOO.declare(
    "TNT_GLOO_SHM_SPIN_US", "int", None,
    "µs a waiting rank spins (yielding every few µs) before sleeping on a futex",
    default_doc="`50` (the native default)", minimum=0, maximum=1_000_000, unit="µs")
TNT_GLOO_SHM_COPY = GLOO.declare(
    "TNT_GLOO_SHM_COPY", "choice", "auto",
    "how a rank copies its data into its shared-memory slots (which way is faster depends "
    "on the host)", case="lower",
    choices=(("auto", "both timed on the rank's first large copies, the faster kept"),
             ("stream", "non-temporal stores, past the caches"),
             ("cache", "memcpy, through the caches")))
TNT_GLOO_SHM_HOST_ID = GLOO.declare(
    "TNT_GLOO_SHM_HOST_ID", "str", None,
    "this rank's host identity, e.g. for containers on one host sharing `/dev/shm`",
    default_doc="host name + boot id")
TNT_GLOO_CUDART = GLOO.declare(
    "TNT_GLOO_CUDART", "str", None,
    "path of libcudart for staging GPU buffers (read by the native module)",
    default_doc="`libcudart.so` and its versioned names")
