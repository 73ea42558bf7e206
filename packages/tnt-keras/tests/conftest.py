"""pytest set-up of the tnt-keras tests.

Makes ``tnt_keras_helpers`` and the worker scripts importable under
``--import-mode=importlib`` (the repository's default), and provides the two expensive
session fixtures: TensorFlow costs seconds per process, so all multi-rank checks of one
(backend, number of ranks) come from a single launch of ``workers/suite_worker.py``, and
all serial references from one plain process; the test modules compare their files.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
for path in (HERE, HERE / "workers"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pytest  # noqa: E402

from tnt_keras_helpers import backend_params, run_serial, run_workers  # noqa: E402


@pytest.fixture(scope="session")
def serial_suite(tmp_path_factory) -> Path:
    """Every worker's reference results from one plain process (plain Keras, no tarantella)."""
    out = tmp_path_factory.mktemp("serial")
    run_serial("suite_worker.py", ["--mode", "serial", "--out", str(out)])
    return out


@pytest.fixture(scope="session", params=backend_params((1, 2, 3)))
def rank_suite(request, tmp_path_factory):
    """``(out, nprocs, launch)``: every worker's results of one launch of ``nprocs`` ranks on
    one backend (``out/data``, ``out/train``, ``out/features``)."""
    backend, nprocs = request.param
    out = tmp_path_factory.mktemp(f"tnt-{backend}-{nprocs}")
    launch = run_workers("suite_worker.py", ["--mode", "tnt", "--out", str(out)], nprocs, backend,
                         timeout=1200)
    return out, nprocs, launch
