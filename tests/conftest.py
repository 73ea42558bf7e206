"""The repository-level tests' helpers (``examples_site``) import by name: pytest's
importlib mode puts no test folder on ``sys.path``. And test_docs_run's blocks start with
the first repository-level test (they run minutes of launches beside the one-process tests
before that module)."""

import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def docs_runs(tmp_path_factory) -> Iterator[Future | None]:
    """test_docs_run's ``Runs`` of every block, running in the background (None without
    tnt-keras); the session waits for it before it ends, so no launch outlives it."""
    from test_docs_run import start_runs

    future = start_runs(tmp_path_factory.mktemp("docs-run"))
    yield future
    if future is not None:
        future.exception()


@pytest.fixture(scope="session", autouse=True)
def _docs_runs_early(request) -> None:
    if any(item.path.name == "test_docs_run.py" for item in request.session.items):
        request.getfixturevalue("docs_runs")
