"""The repository-level tests' helpers (``examples_site``) import by name: pytest's
importlib mode puts no test folder on ``sys.path``. And test_docs_run's blocks start when the
session's tests are collected, in the background (niced: ``tnt_core.testing.background``):
their minutes of launches fill the cores the tests before that module leave idle."""

import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

_DOCS_RUNS = pytest.StashKey["Future | None"]()


@pytest.hookimpl(trylast=True)  # after -k/-m deselected what will not run
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Start test_docs_run's ``Runs`` of every block when that module is to run (None
    without tnt-keras)."""
    if config.option.collectonly or not any(item.path.name == "test_docs_run.py" for item in items):
        return
    from test_docs_run import start_runs

    # pytest's own factory behind the tmp_path_factory fixture (no fixture exists yet here)
    config.stash[_DOCS_RUNS] = start_runs(config._tmp_path_factory.mktemp("docs-run"))  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """No launch outlives the session."""
    future = session.config.stash.get(_DOCS_RUNS, None)
    if future is not None:
        future.exception()


@pytest.fixture(scope="session")
def docs_runs(request) -> Future | None:
    """test_docs_run's ``Runs`` of every block, running in the background since collection
    (None without tnt-keras)."""
    if _DOCS_RUNS not in request.config.stash:  # collected without this conftest's hook
        from test_docs_run import start_runs

        request.config.stash[_DOCS_RUNS] = start_runs(
            request.getfixturevalue("tmp_path_factory").mktemp("docs-run"))
    return request.config.stash[_DOCS_RUNS]
