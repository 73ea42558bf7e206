"""Start N real ranks on this machine for a test, with a hard deadline.

Hosts a rendezvous store, gives every rank the launcher environment (docs/architecture.md,
"The launcher contract"), and kills every process group when the deadline passes, so a
broken collective fails the test instead of hanging CI. Output goes to files (no pipe can
fill up and block a rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._config import Config
from .._priority import carry_priority
from .._rendezvous import StoreServer
from .store_backend import enable_store_backend

__all__ = ["RankResult", "LaunchResult", "launch_ranks", "rank_env"]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str


@dataclass
class LaunchResult:
    ranks: list[RankResult]
    elapsed: float
    timed_out: bool
    command: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    def describe(self) -> str:
        head = f"command: {' '.join(self.command)}\nelapsed {self.elapsed:.1f}s" + (
            " (TIMED OUT, killed)" if self.timed_out else ""
        )
        parts = [head]
        for r in self.ranks:
            parts.append(
                f"--- rank {r.rank}: exit {r.returncode}\n[stdout]\n{r.stdout[-4000:]}\n"
                f"[stderr]\n{r.stderr[-6000:]}"
            )
        return "\n".join(parts)

    def check(self) -> LaunchResult:
        """Raise AssertionError with every rank's output unless all ranks exited 0."""
        if not self.ok:
            raise AssertionError("ranks failed:\n" + self.describe())
        return self


def rank_env(rank: int, size: int, store: StoreServer, *, backend: str | None = None,
             timeout_s: float | None = None, extra: Mapping[str, str] | None = None,
             base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment ``tnt run`` gives a rank on a single node."""
    env = dict(os.environ if base is None else base)
    config = Config(rank=rank, size=size, local_rank=rank, local_size=size, backend=backend or None,
                    rendezvous=store.url, rendezvous_key=store.key)
    names = ["TNT_RANK", "TNT_SIZE", "TNT_LOCAL_RANK", "TNT_LOCAL_SIZE", "TNT_BACKEND",
             "TNT_RENDEZVOUS", "TNT_RENDEZVOUS_KEY"]
    if timeout_s is not None:  # else the rank's default, or what the caller exported
        config, names = config.with_overrides(timeout_s=timeout_s), [*names, "TNT_TIMEOUT_S"]
    env.update(config.to_env(names), PYTHONUNBUFFERED="1")  # written as tnt run writes them
    env.update(extra or {})
    if backend == "store":  # test-only: the ranks register it only when asked
        enable_store_backend(env)
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def launch_ranks(argv: Sequence[str], nprocs: int, *, backend: str | None = None,
                 timeout: float = 120.0, tnt_timeout_s: float | None = None,
                 env: Mapping[str, str] | None = None, launcher: Sequence[str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, python: str | None = None) -> LaunchResult:
    """Run ``python *argv`` as ``nprocs`` ranks; return every rank's exit code and output.

    :param argv: arguments after the interpreter, e.g. ``["-m", "pkg.worker", "--flag"]``.
    :param timeout: wall-clock deadline for the whole job; past it all ranks are killed.
    :param tnt_timeout_s: ``TNT_TIMEOUT_S`` for the ranks (collective timeout).
    :param launcher: e.g. ``["mpiexec", "-n", "4"]``: start one launcher process that starts
        the ranks itself (MPI gives them rank and size); otherwise one process per rank.
    """
    python = python or sys.executable
    with StoreServer("127.0.0.1", 0) as store, tempfile.TemporaryDirectory(prefix="tnt-launch-") as tmp:
        procs: list[tuple[int, subprocess.Popen[bytes], Path, Path]] = []
        command = [python, *argv]
        starts = [(0, list(launcher) + command)] if launcher else [(r, command) for r in range(nprocs)]
        t0 = time.monotonic()
        try:
            for rank, cmd in starts:
                renv = rank_env(rank, nprocs, store, backend=backend, timeout_s=tnt_timeout_s, extra=env)
                if launcher:  # MPI tells the ranks who they are
                    for name in ("TNT_RANK", "TNT_LOCAL_RANK"):
                        renv.pop(name)
                out, err = Path(tmp, f"{rank}.out"), Path(tmp, f"{rank}.err")
                with open(out, "wb") as fo, open(err, "wb") as fe:
                    proc = subprocess.Popen(cmd, env=renv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                            cwd=cwd, start_new_session=True)
                carry_priority(proc.pid)  # a niced caller's ranks stay niced in their session
                procs.append((rank, proc, out, err))
            deadline = t0 + timeout
            timed_out = False
            for _, proc, _, _ in procs:
                remaining = deadline - time.monotonic()
                try:
                    proc.wait(timeout=max(remaining, 0.01))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            for _, proc, _, _ in procs:
                if proc.poll() is None:
                    _kill_group(proc)
            for _, proc, _, _ in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        elapsed = time.monotonic() - t0
        results = [
            RankResult(rank, None if timed_out and proc.returncode in (-9, None) else proc.returncode,
                       out.read_text(errors="replace"), err.read_text(errors="replace"))
            for rank, proc, out, err in procs
        ]
        return LaunchResult(results, elapsed, timed_out, command=list(starts[0][1]))
