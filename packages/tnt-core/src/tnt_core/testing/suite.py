"""pytest base class that runs the conformance suite against a backend with real ranks.

A backend package tests itself with::

    from tnt_core.testing.suite import BackendConformance

    class TestGlooConformance(BackendConformance):
        backend = "gloo"
        nprocs = (2, 3, 4)

Each ``nprocs`` value starts one job that runs every case (one pytest test per case reads
its result); one more job, of ``dead_peer_nprocs`` ranks, runs the dead-peer scenario. Set
``launcher`` to start the ranks through e.g. ``mpiexec``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest

from .conformance import CASE_NAMES
from .launch import LaunchResult, launch_ranks

__all__ = ["BackendConformance"]


def _read_reports(directory: Path) -> dict[int, dict[str, Any]]:
    reports = {}
    for path in sorted(directory.glob("rank*.json")):
        data = json.loads(path.read_text())
        reports[data["rank"]] = data
    return reports


class BackendConformance:
    """Mix-in test class; subclasses set ``backend`` (and optionally the rest)."""

    backend: str = ""
    nprocs: Sequence[int] = (2, 3, 4)
    #: ``launcher(n) -> argv prefix`` (e.g. ``["mpiexec", "-n", str(n)]``) or None for one
    #: process per rank started directly.
    launcher: Callable[[int], list[str]] | None = None
    #: deadline of one whole suite run, seconds
    timeout: float = 600.0
    #: TNT_TIMEOUT_S of the dead-peer job: the survivors must fail within this (+ slack)
    dead_peer_timeout_s: float = 15.0
    #: ranks of the one dead-peer job; None for none, in a further class of a backend whose
    #: dead peer another class checks (a variant of its settings or of its launcher)
    dead_peer_nprocs: int | None = 2
    extra_env: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # pytest collects functions only: None hides the inherited test in such a class, and
        # a subclass of it that names a size gets the test back
        test = BackendConformance.test_dead_peer_raises_comm_error
        if cls.dead_peer_nprocs is None:
            cls.test_dead_peer_raises_comm_error = None  # type: ignore[assignment]
        elif cast(object, cls.test_dead_peer_raises_comm_error) is None:
            cls.test_dead_peer_raises_comm_error = test  # type: ignore[method-assign]

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "nprocs" in metafunc.fixturenames:
            metafunc.parametrize("nprocs", list(self.nprocs), scope="class", ids=lambda n: f"np{n}")
        if "dead_peer_nprocs" in metafunc.fixturenames:
            metafunc.parametrize("dead_peer_nprocs", [self.dead_peer_nprocs], ids=lambda n: f"np{n}")

    @classmethod
    def _launch(cls, nprocs: int, args: list[str], timeout: float, tnt_timeout_s: float) -> LaunchResult:
        if not cls.backend:
            raise RuntimeError(f"{cls.__name__} must set `backend`")
        launcher = cls.launcher
        return launch_ranks(
            ["-m", "tnt_core.testing.conformance", *args], nprocs, backend=cls.backend,
            timeout=timeout, tnt_timeout_s=tnt_timeout_s, env=cls.extra_env,
            launcher=launcher(nprocs) if launcher else None, python=sys.executable,
        )

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_run(cls, nprocs: int, tmp_path_factory: pytest.TempPathFactory
                        ) -> tuple[LaunchResult, dict[int, dict[str, Any]]]:
        report_dir = tmp_path_factory.mktemp(f"conformance-{cls.backend}-np{nprocs}")
        result = cls._launch(nprocs, ["--report", str(report_dir)], cls.timeout, 120.0)
        return result, _read_reports(report_dir)

    @pytest.mark.parametrize("case", CASE_NAMES)
    def test_conformance(self, conformance_run: tuple[LaunchResult, dict[int, dict[str, Any]]],
                         nprocs: int, case: str) -> None:
        result, reports = conformance_run
        missing = sorted(set(range(nprocs)) - set(reports))
        assert not missing, f"ranks {missing} wrote no report\n{result.describe()}"
        failures = []
        for rank, report in sorted(reports.items()):
            entry = report["cases"].get(case)
            if entry is None:
                failures.append(f"rank {rank}: case never ran (hang or crash before it)")
            elif entry["status"] == "skip":
                pytest.skip(f"rank {rank}: {entry['detail']}")
            elif entry["status"] != "ok":
                failures.append(f"rank {rank}:\n{entry['detail']}")
        assert not failures, "\n".join(failures) + "\n" + result.describe()

    def test_all_ranks_exit_cleanly(self, conformance_run: tuple[LaunchResult, dict[int, dict[str, Any]]]
                                    ) -> None:
        result, _ = conformance_run
        assert result.ok, result.describe()

    def test_dead_peer_raises_comm_error(self, dead_peer_nprocs: int, tmp_path: Path) -> None:
        nprocs, limit = dead_peer_nprocs, self.dead_peer_timeout_s
        result = self._launch(nprocs, ["--report", str(tmp_path), "--dead-peer"],
                              timeout=limit + 90.0, tnt_timeout_s=limit)
        reports = _read_reports(tmp_path)
        assert not result.timed_out, f"dead peer made the job hang\n{result.describe()}"
        survivors = range(nprocs - 1)
        for rank in survivors:
            assert rank in reports, f"rank {rank} wrote no report\n{result.describe()}"
            entry = reports[rank]["cases"].get("dead-peer")
            assert entry is not None, f"rank {rank} never finished the allreduce\n{result.describe()}"
            assert entry["status"] == "ok", f"rank {rank}: {entry['detail']}\n{result.describe()}"
            assert entry["seconds"] <= limit + 10.0, f"rank {rank} took {entry['seconds']}s > {limit}+10s"
            assert "rank" in entry["detail"], f"CommError does not name the rank: {entry['detail']}"
            closing = reports[rank]["cases"].get("close-after-failure")
            assert closing and closing["status"] == "ok", f"rank {rank} close after failure: {closing}"
