"""A job that calls collectives the ranks disagree on, and checks that every rank refuses
each one alike and the communicator still works afterwards.

Run as every rank of a job (``launch_ranks([path, out_dir], 2, backend=...)``); rank 1 is
the one that deviates. Each rank writes ``rank<R>.json``: for each case, the error class
and message it saw (or "returned"), then whether consistent collectives still give the
right sums; :func:`check_reports` judges them. Run it with 2 ranks. A backend plugin can run
it to check that tnt-core's agreement works over its transport (it needs a working
``allgather`` of 10 int64 words, nothing more).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import tnt_core
from tnt_core import CollectiveMismatchError, FusedAllreducer, TensorSpec, plan_buckets
from tnt_core._stall_ledger import ledger


def _cases(backend: Any, rank: int) -> dict[str, Callable[[], Any]]:
    odd = rank == 1
    f32 = np.float32

    def fused(sizes: list[int]) -> None:
        specs = [TensorSpec((n,), np.dtype(f32)) for n in sizes]
        reducer = FusedAllreducer(backend, plan_buckets(specs, threshold_bytes=1 << 20))
        for tid, n in enumerate(sizes):
            reducer.push(tid, np.ones(n, f32))
        reducer.finish()

    return {
        "allreduce shape": lambda: backend.allreduce(np.ones(3 if odd else 4, f32)),
        "allreduce 2-d shape": lambda: backend.allreduce(np.ones((2, 3) if odd else (3, 2), f32)),
        "allreduce dtype": lambda: backend.allreduce(np.ones(4, np.float64 if odd else f32)),
        "allreduce op": lambda: backend.allreduce(np.ones(4, f32), "max" if odd else "sum"),
        "allreduce_async shape": lambda: backend.allreduce_async(np.ones(5 if odd else 4, f32)).wait(),
        "broadcast root": lambda: backend.broadcast(np.ones(4, f32), root=1 if odd else 0),
        "broadcast shape": lambda: backend.broadcast(np.ones(2 if odd else 4, f32), root=0),
        "allgather shape": lambda: backend.allgather(np.ones(2 if odd else 4, f32)),
        "allgather vs allreduce": (lambda: backend.allgather(np.ones(4, f32))) if odd
        else (lambda: backend.allreduce(np.ones(4, f32))),
        "barrier vs allreduce": (lambda: backend.barrier()) if odd
        else (lambda: backend.allreduce(np.ones(4, f32))),
        "fused plan": lambda: fused([10, 20] if odd else [10, 21]),
    }


def check_reports(reports: list[dict[str, Any]]) -> None:
    """Assert what the ranks' reports must show: every case refused on every rank with the
    same message (but the rank's number), and consistent collectives right afterwards."""
    cases = reports[0]["cases"]
    assert len(cases) == len(_cases(None, 0)), cases
    for rank, report in enumerate(reports):
        after = report["after"]
        assert after["allreduce"] == [3.0] * 4, after
        assert after["allgather"] == list(range(len(reports))), after
        assert after["fused"] == [[30.0, 60.0]] * 3, after
        for name, seen in cases.items():
            assert seen.startswith("CollectiveMismatchError: [rank 0] collective #"), (name, seen)
            assert report["cases"][name] == seen.replace("[rank 0]", f"[rank {rank}]"), name


def main(out_dir: str) -> int:
    runtime = tnt_core.init()
    backend, rank, size = runtime.backend, runtime.rank, runtime.size
    seen: dict[str, str] = {}
    for name, call in _cases(backend, rank).items():
        try:
            call()
            seen[name] = "returned"
        except CollectiveMismatchError as exc:
            seen[name] = f"CollectiveMismatchError: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported for the test to judge
            seen[name] = f"{type(exc).__name__}: {exc}"
    # the communicator is intact: consistent collectives after every refusal
    total = backend.allreduce(np.full(4, rank + 1, np.float32))
    gathered = backend.allgather(np.array([rank], np.int64))
    specs = [TensorSpec((n,), np.dtype(np.float32)) for n in (10, 20)]
    reducer = FusedAllreducer(backend, plan_buckets(specs, threshold_bytes=1 << 20))
    steps = []
    for _ in range(3):  # the plan agrees once; the later steps go without a header
        for tid, n in enumerate((10, 20)):
            reducer.push(tid, np.full(n, rank + 1, np.float32))
        steps.append([float(a.sum()) for a in reducer.finish()])
    entered = ledger().entered
    backend.barrier()
    report = {"cases": seen, "after": {"allreduce": total.tolist(), "allgather": gathered.ravel().tolist(),
                                       "fused": steps, "entered": entered}, "size": size}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    tnt_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
