"""Fixtures of tnt-comm-gloo's tests (the root pytest config imports test modules with
``--import-mode=importlib``: helpers reach tests as fixtures, never by import)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tnt_core.testing import LaunchResult, launch_ranks

SCENARIOS = Path(__file__).with_name("_scenarios.py")


@dataclass
class ScenarioRun:
    result: LaunchResult
    reports: dict[int, dict]

    @property
    def failures(self) -> list[str]:
        """Every check that did not pass, as "rank R check:\ntraceback"."""
        return [f"rank {rank} {name}:\n{status}" for rank, data in sorted(self.reports.items())
                for name, status in data["checks"].items() if status != "ok"]

    def assert_ok(self, nprocs: int) -> None:
        assert self.result.ok, self.result.describe()
        assert sorted(self.reports) == list(range(nprocs)), self.result.describe()
        assert not self.failures, "\n".join(self.failures)


@pytest.fixture
def scenario(tmp_path: Path) -> Callable[..., ScenarioRun]:
    """``scenario(name, nprocs, args=[...], env={...}, tnt_timeout_s=...)`` runs
    ``_scenarios.py NAME`` as ``nprocs`` gloo ranks and collects their reports."""
    report_dir = tmp_path / "reports"
    report_dir.mkdir()

    def run(name: str, nprocs: int = 2, *, args: list[str] = (), env: dict[str, str] | None = None,
            tnt_timeout_s: float = 60.0, timeout: float = 120.0) -> ScenarioRun:
        result = launch_ranks([str(SCENARIOS), name, "--report", str(report_dir), *args], nprocs,
                              backend="gloo", timeout=timeout, tnt_timeout_s=tnt_timeout_s,
                              env=env or {}, python=sys.executable)
        reports = {}
        for path in sorted(report_dir.glob("rank*.json")):
            data = json.loads(path.read_text())
            reports[data["rank"]] = data
        return ScenarioRun(result, reports)

    return run
