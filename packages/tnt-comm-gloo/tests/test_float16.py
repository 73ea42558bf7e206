"""float16 reductions (F16C-vectorised where the CPU has it) against numpy, bit for bit,
on values that exercise rounding ties, subnormals and overflow."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("algorithm", ["doubling", "bcube", "ring"])
def test_float16_reductions_match_numpy_bitwise(scenario, algorithm: str) -> None:
    scenario("float16", 2, env={"TNT_GLOO_ALGORITHM": algorithm}).assert_ok(2)
