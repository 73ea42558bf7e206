"""Rank 1 touches 3 GiB of memory, which the kernel's out-of-memory killer ends it for inside
a cgroup limited to 512 MiB (no more: where the limit does not hold, the test fails, the
machine is not starved); rank 0 waits for the launcher to end it."""

import time

import numpy as np

import tnt_core

rt = tnt_core.init()
if rt.rank == 1:
    blocks = [np.ones(4 * 2**20) for _ in range(96)]  # 32 MiB each, written: resident
time.sleep(60)
