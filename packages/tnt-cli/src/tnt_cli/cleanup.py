"""``--cleanup``: end leftover ranks of a script on every host of the job.

A leftover rank is a process of the current user that ``tnt run`` started (it has
``TNT_RENDEZVOUS_KEY`` in its environment) and whose command line names the script
(same path or same file name). Ranks lead their own process group, so the whole group
(helpers the rank started included) is signalled. ``python -m tnt_cli.cleanup`` does the
work on one host; ``tnt run --cleanup`` runs it here and over ssh on remote hosts
(:mod:`tnt_cli.run`). Standard library only: it runs on every host, and the agent uses
its sweep of leftover files.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import sys
import time
from collections.abc import Iterable

__all__ = ["find_ranks", "end_ranks", "cleanup_host", "main", "MARKER_VARIABLE", "WAIT_S",
           "shm_segments", "held_by_a_process", "remove_orphan_segments"]

MARKER_VARIABLE = b"TNT_RENDEZVOUS_KEY"
WAIT_S = 5.0


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _matches(argv: list[str], script: str) -> bool:
    base = os.path.basename(script.rstrip("/"))
    return any(arg == script or (base and os.path.basename(arg) == base) for arg in argv)


def find_ranks(script: str) -> list[int]:
    """PIDs of this user's tnt ranks running ``script``."""
    uid, skip, found = os.getuid(), _ancestors(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                names = {item.split(b"=", 1)[0] for item in fh.read().split(b"\0")}
            if MARKER_VARIABLE not in names:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            continue  # gone, or not ours to read
        if _matches(argv, script):
            found.append(pid)
    return found


def _alive(pids: Iterable[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
            if state != b"Z":
                alive.append(pid)
        except (OSError, IndexError):
            continue
    return alive


def end_ranks(script: str, force: bool, wait_s: float = WAIT_S) -> tuple[list[int], list[int]]:
    """Signal the ranks of ``script``; ``(ended, still_running)`` PIDs."""
    pids = find_ranks(script)
    sig = signal.SIGKILL if force else signal.SIGTERM
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    alive = _alive(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = _alive(alive)
    return [p for p in pids if p not in alive], alive


#: what an MPI job leaves when its processes are killed: MPICH's shared-memory segments
#: (removed in MPI_Finalize, which a killed rank never reaches) and the hwloc file of a
#: killed mpiexec (Hydra)
LEFTOVER_PATTERNS = ("/dev/shm/mpich_shm_*", "/tmp/hydra_hwloc_xmlfile_*")


def shm_segments(patterns: tuple[str, ...] = LEFTOVER_PATTERNS) -> set[str]:
    """This user's files matching ``patterns`` (paths)."""
    uid, found = os.getuid(), set()
    for pattern in patterns:
        for path in glob.glob(pattern):
            try:
                if os.stat(path).st_uid == uid:
                    found.add(path)
            except OSError:
                continue
    return found


def held_by_a_process(paths: set[str]) -> set[str]:
    """Which of ``paths`` a live process still maps or holds open."""
    held: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            held |= {p for p in paths if p in text}
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target in paths:
                    held.add(target)
        except OSError:
            continue  # gone, or not ours to read
        if held == paths:
            break
    return held


def remove_orphan_segments(before: set[str],
                           patterns: tuple[str, ...] = LEFTOVER_PATTERNS) -> list[str]:
    """Remove the files made since ``before`` was taken that no live process maps or
    holds: what killed ranks left. A job still running keeps its own (it maps them)."""
    orphans = shm_segments(patterns) - before
    if orphans:
        orphans -= held_by_a_process(orphans)
    removed = []
    for path in sorted(orphans):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def cleanup_host(script: str, force: bool, host: str | None = None) -> tuple[str, bool]:
    """End the ranks here; a one-line report and whether all are gone."""
    host = host or socket.gethostname()
    ended, alive = end_ranks(script, force)
    if not ended and not alive:
        return f"{host}: no ranks of {script} running", True
    msg = f"{host}: ended {len(ended)} rank(s) of {script}"
    if ended:
        msg += f" (pids {' '.join(map(str, ended))})"
    if alive:
        msg += f"; {len(alive)} still running (pids {' '.join(map(str, alive))}), retry with --force"
    return msg, not alive


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tnt_cli.cleanup",
                                description="End this user's tnt ranks of SCRIPT on this host.")
    p.add_argument("--force", action="store_true", help="SIGKILL instead of SIGTERM")
    p.add_argument("--host", help="the name this host has in the report")
    p.add_argument("script")
    ns = p.parse_args(argv)
    message, ok = cleanup_host(ns.script, ns.force, ns.host)
    print(message)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

