"""Helpers for tests that run the real ``tnt`` console script.

Every launch has a deadline; every process a test starts is killed in teardown.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tnt_core.testing import enable_store_backend

# the test-only store backend, for `tnt run --backend store` and `tnt --list-backends`
enable_store_backend()

RANKS = Path(__file__).parent / "ranks"


def tnt_executable(name: str = "tnt") -> list[str]:
    """The installed console script, next to this Python (falls back to ``-m tnt_cli``)."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    found = shutil.which(name)
    if found:
        return [found]
    if name == "tnt":
        return [sys.executable, "-m", "tnt_cli"]
    pytest.skip(f"console script {name!r} is not installed (pip install -e packages/tnt-cli)")


def rank_script(name: str) -> str:
    return str(RANKS / name)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def kill_tree(proc: subprocess.Popen | psutil.Process) -> None:
    """Kill a process and every descendant it has (test teardown)."""
    try:
        p = psutil.Process(proc.pid)
        procs = p.children(recursive=True) + [p]
    except psutil.NoSuchProcess:
        return
    for child in procs:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


@pytest.fixture
def run_tnt(tmp_path: Path):
    """``run_tnt(*args, timeout=..., env=...)`` -> CompletedProcess of ``tnt run ...``."""

    def run(*args: str, timeout: float = 60, env: dict[str, str] | None = None,
            program: str = "tnt", subcommand: Sequence[str] = ("run",)) -> subprocess.CompletedProcess:
        full_env = dict(os.environ, TNT_TEST_DIR=str(tmp_path), **(env or {}))
        cmd = tnt_executable(program) + list(subcommand) + list(args)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                              cwd=tmp_path, stdin=subprocess.DEVNULL)

    return run


@pytest.fixture
def start_tnt(tmp_path: Path):
    """``start_tnt(*args, env=...)`` -> Popen of ``tnt run ...``; killed (tree) at teardown."""
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        full_env = dict(os.environ, TNT_TEST_DIR=str(tmp_path), **(env or {}))
        proc = subprocess.Popen(tnt_executable() + ["run", *args], env=full_env, cwd=tmp_path,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        kill_tree(proc)
        try:
            proc.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError):
            pass


def read_pids(directory: Path, n: int, timeout: float = 60) -> list[int]:
    """Wait until ranks 0..n-1 of ``ranks/sleeper.py`` wrote their pid files."""
    wait_for(lambda: all((directory / f"pid.{r}").exists() for r in range(n)), timeout,
             f"{n} ranks to start")
    return [int((directory / f"pid.{r}").read_text()) for r in range(n)]


def still_alive(pids: Sequence[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(scope="session")
def h():
    """The helper functions above (the suite runs with --import-mode=importlib, where
    test modules cannot import conftest)."""
    return SimpleNamespace(rank_script=rank_script, wait_for=wait_for, kill_tree=kill_tree,
                           read_pids=read_pids, still_alive=still_alive,
                           tnt_executable=tnt_executable, RANKS=RANKS)
