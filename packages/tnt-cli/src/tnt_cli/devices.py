"""What this machine has: GPUs, usable CPU cores, NUMA nodes — found without TensorFlow."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

__all__ = ["visible_gpus", "cpu_count", "numa_nodes", "threads_per_rank", "physical_cores",
           "rank_cpus"]

SYSFS_CPU = "/sys/devices/system/cpu"


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """IDs of the GPUs this process may use, cheapest source first.

    ``CUDA_VISIBLE_DEVICES`` wins when set (``""`` or ``-1`` mean none); otherwise the
    NVIDIA driver's ``/proc`` entries, then ``nvidia-smi -L``.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        # CUDA stops at the first invalid entry; -1 is the usual way to hide all GPUs
        visible_ids: list[str] = []
        for d in ids:
            if d.startswith("-"):
                break
            visible_ids.append(d)
        return visible_ids
    proc = "/proc/driver/nvidia/gpus"
    try:
        entries = sorted(os.listdir(proc))
    except OSError:
        entries = []
    if entries:
        return [str(i) for i in range(len(entries))]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
        return [str(i) for i in range(len(gpus))]
    return []


def cpu_count() -> int:
    """CPU cores this process may run on (respects affinity masks and cgroup cpusets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def numa_nodes() -> int:
    """Number of NUMA nodes (sockets, usually) of this machine; 1 when unknown."""
    try:
        names = os.listdir("/sys/devices/system/node")
    except OSError:
        return 1
    return max(1, sum(1 for n in names if re.fullmatch(r"node\d+", n)))


def threads_per_rank(ranks_on_node: int, cores: int | None = None) -> int:
    """Intra-op threads of one rank: the node's cores shared evenly, at least one."""
    cores = cpu_count() if cores is None else cores
    return max(1, cores // max(1, ranks_on_node))


def physical_cores(cpus: list[int], sysfs: str = SYSFS_CPU) -> list[list[int]]:
    """``cpus`` grouped by physical core (the SMT siblings of a core together), the cores in
    the order of their socket, then of their first CPU. A CPU whose topology the kernel
    does not show counts as a core of its own."""
    cores: dict[tuple[int, int, int], list[int]] = {}
    for cpu in sorted(cpus):
        base = f"{sysfs}/cpu{cpu}/topology"
        try:
            package = int(_read(f"{base}/physical_package_id"))
            core = int(_read(f"{base}/core_id"))
            die = int(_read(f"{base}/die_id")) if os.path.exists(f"{base}/die_id") else 0
        except (OSError, ValueError):
            package, die, core = -1, -1, cpu
        cores.setdefault((package, die, core), []).append(cpu)
    by_socket = sorted(cores.items(), key=lambda item: (item[0][0], item[1][0]))
    return [group for _, group in by_socket]


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read().strip()


def rank_cpus(local_rank: int, local_size: int, cpus: list[int] | None = None,
              sysfs: str = SYSFS_CPU) -> list[int] | None:
    """The CPUs local rank ``local_rank`` of a host's ``local_size`` ranks is bound to: the
    ``local_rank``-th of ``local_size`` runs of whole physical cores of ``cpus`` (this
    process's CPUs by default), the first ``cores % local_size`` runs one core longer; None
    when the host has fewer cores than ranks (bound, ranks would share cores the scheduler
    can otherwise spread them over).

    Why bind: unbound, the threads of two ranks on one host move between the cores and
    meet on one of them while another idles; each rank's caches go cold with every move.
    Measured on a 2-vCPU machine (docs/performance.md, "Each rank on cores of its own"):
    2 data-parallel ranks 1.28-1.46x faster bound, a 2-stage pipeline 1.05-1.06x (GPipe, whose
    idle stage lent its core to the busy one unbound, 0.86x). Whole cores, so
    that no two ranks share the SMT siblings of one core; runs, so that a rank's cores sit
    in one socket where they can."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0))
    cores = physical_cores(cpus, sysfs)
    if local_size < 1 or not 0 <= local_rank < local_size or len(cores) < local_size:
        return None
    per, extra = divmod(len(cores), local_size)
    first = local_rank * per + min(local_rank, extra)
    run = cores[first:first + per + (1 if local_rank < extra else 0)]
    return sorted(cpu for core in run for cpu in core)
