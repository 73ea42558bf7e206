"""Whether the kernel's out-of-memory killer ended a rank.

Why: a rank the OOM killer ends dies of SIGKILL with no word of its own, and ``exited with
code 137 (signal SIGKILL?)`` does not tell the operator that the host (or the job's memory
limit: a Slurm step's cgroup, a container's) ran out of memory, nor what to change. The
kernel counts its kills (``oom_kill``, Linux 4.13 and later): per cgroup, in cgroup v2's
``memory.events`` or v1's ``memory.oom_control`` (the kills in the cgroup and below it,
where the limit of a Slurm step or a container applies), and for the whole machine in
``/proc/vmstat``. The agent reads the count before its rank starts and after it died of
SIGKILL: a count that grew means the OOM killer ran meanwhile, in the rank's cgroup (or,
where only the machine's count is readable, on its host).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["OOM_ADVICE", "OomCount"]

#: what the launcher says of a rank the OOM killer ended, as the rank's last exception
OOM_ADVICE = ("MemoryError: the kernel's out-of-memory killer ended this rank: its host, or "
              "the job's memory limit, ran out of memory; run fewer ranks per host "
              "(-n, --n-per-node), a smaller batch or model per rank, or ask for more memory")


def _count(path: Path) -> int | None:
    """The ``oom_kill`` count of a ``memory.events`` or ``vmstat`` file, None if unreadable."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit():
                return int(value)
    except OSError:
        return None
    return None


def _cgroup_counts(proc_cgroup: Path, root: Path) -> list[Path]:
    """The files that count OOM kills in this process's cgroup, from ``/proc/self/cgroup``:
    cgroup v2's ``memory.events`` (``0::PATH``; mounted at ``root`` or, on a host with both
    versions, at ``root/unified``) and cgroup v1's ``memory.oom_control`` (``N:memory:PATH``)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.strip().lstrip("/")
        if controllers == "":
            files += [root / path / "memory.events", root / "unified" / path / "memory.events"]
        elif "memory" in controllers.split(","):
            files.append(root / "memory" / path / "memory.oom_control")
    return files


class OomCount:
    """The OOM killer's count where this process runs, read now; :meth:`grew` reads it again."""

    def __init__(self, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> None:
        candidates = _cgroup_counts(proc / "self" / "cgroup", cgroup_root) + [proc / "vmstat"]
        self._path: Path | None = None
        self._before: int | None = None
        for path in candidates:
            count = _count(path)
            if count is not None:
                self._path, self._before = path, count
                break

    def grew(self) -> bool:
        """Whether the OOM killer ran since this count was made (False where it is not known)."""
        if self._path is None or self._before is None:
            return False
        after = _count(self._path)
        return after is not None and after > self._before
