"""Test support for backends and frameworks: real multi-process launches, the backend
conformance suite (``tnt_core.testing.suite.BackendConformance``, which needs pytest), the
reference ``store`` backend, which production processes never load, and an emulated
cluster of network namespaces (``tnt_core.testing.cluster``) for tests and benchmarks
across hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._fusion import FusedAllreducer
from .cluster import ClusterUnavailable, EmulatedCluster, cluster_unavailable
from .conformance import CASE_NAMES
from .launch import LaunchResult, RankResult, launch_ranks, rank_env
from .store_backend import STORE_PLUGIN, enable_store_backend

__all__ = [
    "CASE_NAMES",
    "STORE_PLUGIN",
    "ClusterUnavailable",
    "EmulatedCluster",
    "LaunchResult",
    "RankResult",
    "cluster_unavailable",
    "enable_store_backend",
    "fused_allreduce",
    "launch_ranks",
    "rank_env",
]


def fused_allreduce(fused: FusedAllreducer, arrays: Sequence[Any], scale: float | None = None,
                    timeout: float | None = None) -> list[np.ndarray]:
    """One whole step of ``fused`` in one call: push ``arrays`` (indexed like the plan's
    tensors) in order, then finish. For tests; a framework pushes as gradients appear."""
    if len(arrays) != fused.plan.num_tensors:
        raise ValueError(f"expected {fused.plan.num_tensors} tensors, got {len(arrays)}")
    for tid, arr in enumerate(arrays):
        fused.push(tid, arr, scale)
    return fused.finish(timeout)
