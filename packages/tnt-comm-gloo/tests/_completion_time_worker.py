"""Rank body for test_completion_time.py: the handle reports when the allreduce finished."""
import time

import numpy as np

import tnt_core

rt = tnt_core.init()
buf = np.ones(1 << 20, np.float32)
t0 = time.perf_counter()
h = rt.backend.allreduce_async(buf)
h.wait()
t1 = time.perf_counter()
ct = h.completion_time()
assert ct is not None and t0 <= ct <= t1, (t0, ct, t1)
print("ok", rt.rank, round((ct - t0) * 1e3, 3), "ms")
