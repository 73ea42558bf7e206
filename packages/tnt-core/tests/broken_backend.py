"""A store backend with a wrong float32 sum: the conformance suite must catch it."""

import numpy as np

from tnt_core import BackendSpec, hookimpl
from tnt_core.testing.store_backend import StoreBackend


class OffByOneBackend(StoreBackend):
    name = "offbyone"

    def allreduce_async(self, buf, op="sum"):
        handle = super().allreduce_async(buf, op)
        if op == "sum" and buf.dtype == np.float32 and buf.size > 1:
            handle.wait()
            buf[-1] += 1
        return handle


@hookimpl
def tnt_comm_backends():
    return [BackendSpec(name="offbyone", factory=OffByOneBackend, priority=-100,
                        available=lambda cfg: cfg.backend == "offbyone")]
