"""float16 reductions (F16C-vectorised where the CPU has it) against numpy, bit for bit,
on values that exercise rounding ties, subnormals and overflow: over shared memory and
with each TCP algorithm."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("algorithm", ["shm", "doubling", "bcube", "ring"])
def test_float16_reductions_match_numpy_bitwise(scenario, algorithm: str) -> None:
    env = ({"TNT_GLOO_SHM": "1"} if algorithm == "shm"
           else {"TNT_GLOO_SHM": "0", "TNT_GLOO_ALGORITHM": algorithm})
    scenario("float16", 2, env=env).assert_ok(2)
