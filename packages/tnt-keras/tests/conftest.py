"""pytest set-up of the tnt-keras tests.

Makes ``tnt_keras_helpers`` and the worker scripts importable under
``--import-mode=importlib`` (the repository's default), and provides the expensive session
fixtures: TensorFlow costs seconds per process, so all multi-rank checks of one (backend,
number of ranks) come from a single launch of ``workers/suite_worker.py``, and all serial
references from one plain process; the test modules compare their files. The launches are
``tnt_keras_helpers.SUITE_LAUNCHES``: 1 rank; 3 on gloo; 2 on store.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
for path in (HERE, HERE / "workers"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pytest  # noqa: E402

from tnt_keras_helpers import (  # noqa: E402
    SUITE_LAUNCHES,
    SuiteLaunch,
    launch_params,
    run_serial,
    run_workers,
)


@pytest.fixture(scope="session")
def serial_suite(tmp_path_factory) -> Path:
    """Every worker's reference results from one plain process (plain Keras, no tarantella)."""
    out = tmp_path_factory.mktemp("serial")
    run_serial("suite_worker.py", ["--mode", "serial", "--out", str(out)])
    return out


class SuiteRuns:
    """Each launch's results, launched when first asked for and kept for the session (its
    failure too): tests of several modules, parametrized in several ways, share one launch."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._runs: dict[SuiteLaunch, tuple[Path, int, object] | AssertionError] = {}

    def get(self, launch: SuiteLaunch) -> tuple[Path, int, object]:
        """``(out, nprocs, launch result)``: the workers' files are under ``out/data``,
        ``out/train``, ``out/fidelity``, ``out/features`` and ``out/<name>`` for each name
        of ``launch.also``."""
        if launch not in self._runs:
            out = self._tmp.mktemp(launch.id)
            args = ["--mode", "tnt", "--out", str(out)]
            if launch.also:
                args += ["--also", ",".join(launch.also)]
            try:
                result = run_workers("suite_worker.py", args, launch.nprocs, launch.backend, timeout=1200)
                self._runs[launch] = (out, launch.nprocs, result)
            except AssertionError as exc:  # every rank's output: reported by every test using it
                self._runs[launch] = exc
        run = self._runs[launch]
        if isinstance(run, AssertionError):
            raise run
        return run


@pytest.fixture(scope="session")
def suite_runs(tmp_path_factory) -> SuiteRuns:
    return SuiteRuns(tmp_path_factory)


@pytest.fixture(scope="session", params=launch_params(SUITE_LAUNCHES))
def rank_suite(request, suite_runs):
    """``(out, nprocs, launch)`` of each launch of ``SUITE_LAUNCHES`` (see ``SuiteRuns.get``)."""
    return suite_runs.get(request.param)
