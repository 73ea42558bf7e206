"""What this machine has: GPUs, usable CPU cores, NUMA nodes — found without TensorFlow."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

__all__ = ["visible_gpus", "cpu_count", "numa_nodes", "threads_per_rank"]


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
