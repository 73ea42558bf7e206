"""pytest set-up of the tnt-keras tests.

Makes ``tnt_keras_helpers`` and the worker scripts importable under
``--import-mode=importlib`` (the repository's default), and provides the expensive session
fixtures: TensorFlow costs seconds per process, so all multi-rank checks of one (backend,
number of ranks) come from a single launch of ``workers/suite_worker.py``, and all serial
references from one plain process; the test modules compare their files. The launches are
``tnt_keras_helpers.SUITE_LAUNCHES``: 1 rank; 3 on gloo; 2 on store. The serial process and
the 1-rank launch, one process each, run side by side.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent
for path in (HERE, HERE / "workers"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pytest  # noqa: E402

from tnt_core.testing import LaunchResult  # noqa: E402
from tnt_keras_helpers import (  # noqa: E402
    ONE_RANK,
    SUITE_LAUNCHES,
    SuiteLaunch,
    launch_params,
    run_serial,
    run_workers,
)


class SuiteRuns:
    """Each launch's results, launched once per session (in a thread of its own, so that a
    launch can run beside another process) and kept, a failure too: tests of several
    modules, parametrized in several ways, share one launch."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._pool = ThreadPoolExecutor(max_workers=len(SUITE_LAUNCHES), thread_name_prefix="suite-launch")
        self._runs: dict[SuiteLaunch, Future[tuple[Path, int, LaunchResult]]] = {}

    def start(self, launch: SuiteLaunch) -> None:
        """Start ``launch`` now unless it was started before."""
        if launch not in self._runs:
            self._runs[launch] = self._pool.submit(self._launch, launch, self._tmp.mktemp(launch.id))

    def get(self, launch: SuiteLaunch) -> tuple[Path, int, LaunchResult]:
        """``(out, nprocs, launch result)``, waiting for the launch: the workers' files are
        under ``out/data``, ``out/train``, ``out/fidelity``, ``out/features`` and
        ``out/<name>`` for each name of ``launch.also``. A failed launch raises, with every
        rank's output, in every test that asks for it."""
        self.start(launch)
        return self._runs[launch].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @staticmethod
    def _launch(launch: SuiteLaunch, out: Path) -> tuple[Path, int, LaunchResult]:
        args = ["--mode", "tnt", "--out", str(out)]
        if launch.also:
            args += ["--also", ",".join(launch.also)]
        return out, launch.nprocs, run_workers("suite_worker.py", args, launch.nprocs, launch.backend,
                                               timeout=1200)


@pytest.fixture(scope="session")
def suite_runs(tmp_path_factory):
    runs = SuiteRuns(tmp_path_factory)
    yield runs
    runs.close()


@pytest.fixture(scope="session")
def serial_suite(tmp_path_factory, suite_runs) -> Path:
    """Every worker's reference results from one plain process (plain Keras, no tarantella).
    The 1-rank launch, one process too, runs beside it: both cores of a small machine busy."""
    suite_runs.start(ONE_RANK)
    out = tmp_path_factory.mktemp("serial")
    run_serial("suite_worker.py", ["--mode", "serial", "--out", str(out)])
    return out


@pytest.fixture(scope="session", params=launch_params(SUITE_LAUNCHES))
def rank_suite(request, suite_runs):
    """``(out, nprocs, launch)`` of each launch of ``SUITE_LAUNCHES`` (see ``SuiteRuns.get``)."""
    return suite_runs.get(request.param)
