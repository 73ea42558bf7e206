"""Where the examples' data set comes from in this environment.

The examples and the quick start train on scikit-learn's digits. ``make setup`` installs
scikit-learn into ``.venv/examples-site`` rather than into the venv
(``ci/requirements-examples.txt`` says why: Keras imports it in every process that can),
so a test that runs an example puts that folder on the ranks' ``PYTHONPATH``, as
``make run`` does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SITE = Path(sys.prefix) / "examples-site"


def with_examples_site(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the examples' site folder first on PYTHONPATH."""
    if not (SITE / "sklearn").is_dir():
        pytest.fail(f"{SITE} holds no scikit-learn: `make setup` installs it there "
                    "(ci/requirements-examples.txt)")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH")) if p)
    return env
