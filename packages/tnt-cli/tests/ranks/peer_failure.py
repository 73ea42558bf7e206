"""Allreduces in a loop; after three, rank $TNT_TEST_FAIL_RANK raises ValueError("boom")
and rank $TNT_TEST_HANG_RANK sleeps: the other ranks then fail because of it."""
import os
import time

import numpy as np

import tnt_core

rt = tnt_core.init()
buf = np.ones(256, dtype=np.float32)
for step in range(100_000):
    if step == 3 and str(rt.rank) == os.environ.get("TNT_TEST_FAIL_RANK"):
        raise ValueError("boom")
    if step == 3 and str(rt.rank) == os.environ.get("TNT_TEST_HANG_RANK"):
        time.sleep(120)
    rt.backend.allreduce(buf)
