"""The checked-in ``_gloo.pyi`` is the stub the build generates from the binding.

CMakeLists.txt runs nanobind's stubgen on the built module and installs the result next
to it; the copy in src/ serves type checkers that read the source tree. When the binding
changes, rebuild (``pip install -e packages/tnt-comm-gloo``) and copy the generated stub
over the checked-in one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tnt_comm_gloo import _gloo

CHECKED_IN = Path(__file__).parents[1] / "src" / "tnt_comm_gloo" / "_gloo.pyi"


def test_checked_in_stub_equals_the_generated_one() -> None:
    generated = Path(_gloo.__file__).with_name("_gloo.pyi")
    if generated == CHECKED_IN or not generated.exists():
        pytest.skip(f"no generated stub next to {_gloo.__file__} (built without stubgen?)")
    assert generated.read_text() == CHECKED_IN.read_text(), (
        f"{CHECKED_IN} differs from the stub generated from the binding ({generated}); "
        f"copy it: cp {generated} {CHECKED_IN}")
