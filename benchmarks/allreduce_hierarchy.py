"""The gloo backend's hierarchical allreduce against the flat ring, across emulated hosts.

``sudo python benchmarks/allreduce_hierarchy.py --hosts 2 --per-host 2 --rate-mbit 400``

Each host is a network namespace with its own ``TNT_GLOO_SHM_HOST_ID`` (namespaces share
one kernel, so its boot id, and would otherwise count as one host), joined to the others
by a bridge in a namespace of its own; each host's link is limited to ``--rate-mbit``
each way with ``tc tbf``. Addresses are in 198.18.0.0/15 (reserved for benchmarking).
Everything made is removed on the way out, whatever happens. Needs root and ``ip``.

For each of ``TNT_GLOO_HIERARCHY=0`` (the flat TCP algorithms) and ``1`` (with more
than one rank per host): one warm-up
allreduce (checked), then ``--iters`` timed ones of a ``--mib`` MiB float32 buffer, each
after a barrier; rank 0 prints the median and its ratio to the link bound
2(H-1)/H * n / R, the least time any allreduce of n bytes needs when every host's link
runs at R.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


class Cluster:
    """``hosts`` namespaces on a bridge, each link rate-limited both ways."""

    def __init__(self, hosts: int, rate_mbit: int) -> None:
        tag = f"tnthb{os.getpid() % 100000}"
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-h{i}" for i in range(hosts)]
        self.addresses = [f"198.18.0.{i + 1}" for i in range(hosts)]
        self.rate = rate_mbit

    def __enter__(self) -> Cluster:
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self) -> None:
        tbf = ("tc", "qdisc", "add", "dev")
        limit = ("root", "tbf", "rate", f"{self.rate}mbit", "burst", "256kb", "latency", "100ms")
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.hosts, self.addresses)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", f"h{i}", "netns", ns, "type", "veth", "peer", "name", f"s{i}",
                "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", f"h{i}")
            _ip("-n", ns, "link", "set", f"h{i}", "up")
            _ip("-n", self.switch, "link", "set", f"s{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"s{i}", "up")
            _ip("netns", "exec", ns, *tbf, f"h{i}", *limit)  # the host's uplink
            _ip("netns", "exec", self.switch, *tbf, f"s{i}", *limit)  # its downlink

    def __exit__(self, *exc: object) -> None:
        for ns in (*self.hosts, self.switch):
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL, check=False)


def drive(args: argparse.Namespace) -> None:
    """One job, from the first host's namespace: the store there, each rank in its host's."""
    from tnt_core import StoreServer
    from tnt_core.testing import rank_env

    namespaces = args.drive.split(",")
    addresses = [f"198.18.0.{i + 1}" for i in range(len(namespaces))]
    size = len(namespaces) * args.per_host
    with StoreServer(addresses[0], 0) as store:
        procs = []
        for r in range(size):
            host = r // args.per_host
            env = rank_env(r, size, store, backend="gloo", timeout_s=120.0, extra={
                "TNT_LOCAL_RANK": str(r % args.per_host),
                "TNT_LOCAL_SIZE": str(args.per_host), "TNT_GLOO_HOSTNAME": addresses[host],
                "TNT_GLOO_SHM_HOST_ID": f"emulated-{host}",
                "TNT_GLOO_HIERARCHY": args.hierarchy})
            command = ["ip", "netns", "exec", namespaces[host], sys.executable, HERE, "--rank",
                       "--hosts", str(len(namespaces)), "--rate-mbit", str(args.rate_mbit),
                       "--mib", str(args.mib), "--iters", str(args.iters)]
            procs.append(subprocess.Popen(command, env=env))
        codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


def rank(args: argparse.Namespace) -> None:
    import numpy as np

    import tnt_core

    runtime = tnt_core.init()
    backend = runtime.backend
    nbytes = args.mib << 20
    buf = np.ones(nbytes // 4, np.float32)
    backend.allreduce(buf)
    assert np.all(buf == backend.size), buf[:4]
    times = []
    for _ in range(args.iters):
        buf[:] = 1
        backend.barrier()
        t0 = time.perf_counter()
        backend.allreduce(buf)
        times.append(time.perf_counter() - t0)
    if backend.rank == 0:
        hosts = args.hosts
        bound = 2 * (hosts - 1) / hosts * nbytes / (args.rate_mbit * 1e6 / 8)
        median = statistics.median(times)
        print(f"{hosts} hosts x {backend.size // hosts} ranks, {backend.allreduce_transport:>12}:"
              f" median {median:.3f} s of {[round(t, 3) for t in times]}, link bound"
              f" {bound:.3f} s, ratio {bound / median:.3f}", flush=True)
    tnt_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--rate-mbit", type=int, default=400)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--drive", default="", help=argparse.SUPPRESS)
    parser.add_argument("--hierarchy", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank(args)
    if args.drive:
        return drive(args)
    with Cluster(args.hosts, args.rate_mbit) as cluster:
        # one rank per host has no hierarchy (TNT_GLOO_HIERARCHY=1 refuses it)
        for hierarchy in ("0",) if args.per_host == 1 else ("0", "1"):
            subprocess.run(["ip", "netns", "exec", cluster.hosts[0], sys.executable, HERE,
                            "--drive", ",".join(cluster.hosts), "--hierarchy", hierarchy,
                            "--per-host", str(args.per_host), "--rate-mbit",
                            str(args.rate_mbit), "--mib", str(args.mib),
                            "--iters", str(args.iters)], check=True)
    return None


if __name__ == "__main__":
    main()
