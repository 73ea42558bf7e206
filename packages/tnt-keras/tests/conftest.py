"""pytest set-up of the tnt-keras tests.

Makes ``tnt_keras_helpers`` and the worker scripts importable under
``--import-mode=importlib`` (the repository's default), and provides the expensive session
fixtures: TensorFlow costs seconds per process, so all multi-rank checks of one (backend,
number of ranks) come from a single launch of ``workers/suite_worker.py``, and all serial
references from one plain process; the test modules compare their files. The launches are
``tnt_keras_helpers.SUITE_LAUNCHES``: 1 rank; 3 on gloo; 2 on store.

A session starts every run its tests need once they are collected, up to three side by side
(``SuiteRuns.start_needed``): they work while the other packages' tests run, the tests of
one launch find the others under way or done, and the two cores work while a launch waits
on its peers. test_pipeline_model's four runs follow in the same queue as the first runs
end: then the tnt-cli tests, mostly waiting on timeouts, leave a core idle.
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
    NATIVE_PATH,
    ONE_RANK,
    PIPELINE_BACKEND,
    PIPELINE_LAYOUTS,
    PIPELINE_ROUTING,
    PIPELINE_SPARSE_REFERENCE,
    PYTHON_PATH,
    SUITE_LAUNCHES,
    SuiteLaunch,
    launch_params,
    run_serial,
    run_workers,
)

#: the order the runs start in, three side by side: the longest first (the 3-rank launch; the
#: Python path's, whose ranks mostly wait on the store's round trips and so cost the others
#: little), the one-process runs as cores free up. All at once would hold seven TensorFlow
#: processes in memory.
START_ORDER: tuple[SuiteLaunch | str, ...] = (NATIVE_PATH, PYTHON_PATH, "serial", ONE_RANK)
SIDE_BY_SIDE = 3


class SuiteRuns:
    """Each launch's results and the serial run's, each run once per session in a thread of
    its own and kept, a failure too: tests of several modules, parametrized in several ways,
    share one launch."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._pool = ThreadPoolExecutor(max_workers=SIDE_BY_SIDE, thread_name_prefix="suite-launch")
        self._runs: dict[SuiteLaunch | str, Future] = {}
        self._pipelined: dict[str, tuple[int, int, Path, list[Future]]] = {}

    def start(self, run: SuiteLaunch | str) -> None:
        """Start ``run`` (a launch, or ``"serial"``) unless it was started before."""
        if run not in self._runs:
            if run == "serial":
                self._runs[run] = self._pool.submit(self._serial, self._tmp.mktemp("serial"))
            else:
                assert isinstance(run, SuiteLaunch)
                self._runs[run] = self._pool.submit(self._launch, run, self._tmp.mktemp(run.id))

    def start_needed(self, items: list[pytest.Item]) -> None:
        """Start, in ``START_ORDER``, every run that one of ``items`` (the session's tests)
        asks for: a launch as a parameter, the serial run through ``serial_suite``; then
        test_pipeline_model's runs when that module is among them (they start as the first
        runs end, while the tnt-cli tests leave cores idle)."""
        needed: set[SuiteLaunch | str] = set()
        for item in items:
            callspec = getattr(item, "callspec", None)
            if callspec is not None:
                needed |= {v for v in callspec.params.values()
                           if isinstance(v, SuiteLaunch) and v.backend is not None}
            if "serial_suite" in getattr(item, "fixturenames", ()):
                needed.add("serial")
        for run in START_ORDER:
            if run in needed:
                self.start(run)
        if any(item.path.name == "test_pipeline_model.py" for item in items):
            self.pipelined()

    def pipelined(self) -> dict[str, tuple[int, int, Path, list[Future]]]:
        """test_pipeline_model's runs, queued on the first call (every launch, then every
        serial run): layout -> ``(ranks, stages, out, [launch, serial])``."""
        if not self._pipelined:
            plans = []
            for layout, (stages, strategy, ranks) in PIPELINE_LAYOUTS.items():
                out = self._tmp.mktemp(f"pipelined-model-{stages}-{strategy}")
                args = ["--partitions", str(stages), "--out", str(out),
                        *(["--routing"] if layout == PIPELINE_ROUTING else [])]
                plans.append((layout, args))
                self._pipelined[layout] = (ranks, stages, out, [self._pool.submit(
                    run_workers, "pipeline_model_worker.py",
                    ["--mode", "pipeline", "--strategy", strategy, *args], ranks, PIPELINE_BACKEND,
                    timeout=400)])
            for layout, args in plans:
                sparse = ["--sparse"] if layout == PIPELINE_SPARSE_REFERENCE else []
                self._pipelined[layout][3].append(self._pool.submit(
                    run_serial, "pipeline_model_worker.py", ["--mode", "serial", *args, *sparse]))
        return self._pipelined

    def get(self, launch: SuiteLaunch) -> tuple[Path, int, LaunchResult]:
        """``(out, nprocs, launch result)``, waiting for the launch: the workers' files are
        under ``out/data``, ``out/train``, ``out/fidelity``, ``out/features`` and
        ``out/<name>`` for each name of ``launch.also``. A failed launch raises, with every
        rank's output, in every test that asks for it."""
        self.start(launch)
        return self._runs[launch].result()

    def serial(self) -> Path:
        """The folder of the serial run's files (``suite_worker.py --mode serial``)."""
        self.start("serial")
        return self._runs["serial"].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @staticmethod
    def _launch(launch: SuiteLaunch, out: Path) -> tuple[Path, int, LaunchResult]:
        args = ["--mode", "tnt", "--out", str(out)]
        if launch.also:
            args += ["--also", ",".join(launch.also)]
        if launch.parts:
            args += ["--parts", ",".join(launch.parts)]
        if launch.fidelity_cases:
            args += ["--fidelity-cases", ",".join(launch.fidelity_cases)]
        return out, launch.nprocs, run_workers("suite_worker.py", args, launch.nprocs, launch.backend,
                                               timeout=1200)

    @staticmethod
    def _serial(out: Path) -> Path:
        run_serial("suite_worker.py", ["--mode", "serial", "--out", str(out)], timeout=1200)
        return out


_RUNS = pytest.StashKey[SuiteRuns]()


@pytest.hookimpl(trylast=True)  # after -k/-m deselected what will not run
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Start every run the session's tests need as soon as they are collected: the launches
    then work while the other packages' tests (mostly waiting on their peers and timeouts)
    run, rather than after them."""
    if config.option.collectonly:  # nothing will run: launch nothing (it took minutes)
        return
    # pytest's own factory behind the tmp_path_factory fixture (no fixture exists yet here)
    runs = SuiteRuns(config._tmp_path_factory)  # type: ignore[attr-defined]
    runs.start_needed(items)
    config.stash[_RUNS] = runs


def pytest_sessionfinish(session: pytest.Session) -> None:
    runs = session.config.stash.get(_RUNS, None)
    if runs is not None:
        runs.close()


@pytest.fixture(scope="session")
def suite_runs(request, tmp_path_factory):
    """The session's ``SuiteRuns``, started when the session's tests were collected."""
    runs = request.config.stash.get(_RUNS, None)
    if runs is None:  # collected without this conftest's hook (e.g. a plugin reordered)
        runs = request.config.stash[_RUNS] = SuiteRuns(tmp_path_factory)
        runs.start_needed(request.session.items)
    return runs


@pytest.fixture(scope="session")
def serial_suite(suite_runs) -> Path:
    """Every worker's reference results from one plain process (plain Keras, no tarantella)."""
    return suite_runs.serial()


@pytest.fixture(scope="session", params=launch_params(SUITE_LAUNCHES))
def rank_suite(request, suite_runs):
    """``(out, nprocs, launch result, SuiteLaunch)`` of each launch of ``SUITE_LAUNCHES``
    (see ``SuiteRuns.get``)."""
    return (*suite_runs.get(request.param), request.param)


@pytest.fixture(scope="session")
def pipelined_model_runs(suite_runs) -> dict[str, tuple[int, int, Path, list[Future]]]:
    """test_pipeline_model's runs (``SuiteRuns.pipelined``), queued when the session's tests
    were collected."""
    return suite_runs.pipelined()
