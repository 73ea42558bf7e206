"""The backend conformance checks, run inside every rank of a real multi-process job.

Run as ``python -m tnt_core.testing.conformance --report DIR`` under any launcher; each
rank writes ``DIR/rank<R>.json`` after every case, so a hang still tells which case hung.
The pytest side is :class:`tnt_core.testing.suite.BackendConformance`.

Inputs are functions of (rank, index) so every rank can compute the expected result of
a collective locally, and all checks are exact (small integers are exact in float16).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..backend import REDUCE_OPS, CommBackend
from ..config import Config
from ..errors import CommError

__all__ = ["CASES", "CASE_NAMES", "DTYPES", "main"]

DTYPES = ("float32", "float64", "float16", "int32", "int64")
SIZES = (0, 1, 1001, (3, 5))
LARGE_BYTES = 64 * 1024 * 1024
_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


def _input(op: str, rank: int, shape: int | tuple[int, ...], dtype: str) -> np.ndarray:
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64)
    if op == "product":
        values = (i + rank) % 2 + 1  # 1 or 2: products stay exact for few ranks
    elif op in ("min", "max"):
        values = (i * 7 + rank * 3) % 11 - 5
    else:
        values = i % 5 + rank + 1
    return values.astype(dtype).reshape(shape)


def _expected(op: str, size: int, shape: int | tuple[int, ...], dtype: str) -> np.ndarray:
    acc = _input(op, 0, shape, dtype)
    for r in range(1, size):
        acc = _REDUCE[op](acc, _input(op, r, shape, dtype))
    return acc


class Context:
    def __init__(self, backend: CommBackend, config: Config) -> None:
        self.backend = backend
        self.config = config
        self.rank, self.size = backend.rank, backend.size


def _make_allreduce_case(op: str, dtype: str) -> Callable[[Context], None]:
    def case(ctx: Context) -> None:
        for shape in SIZES:
            buf = _input(op, ctx.rank, shape, dtype)
            out = ctx.backend.allreduce_async(buf, op).wait()
            want = _expected(op, ctx.size, shape, dtype)
            assert out.shape == want.shape, f"shape {out.shape} != {want.shape}"
            assert out.dtype == np.dtype(dtype), f"dtype changed to {out.dtype}"
            assert np.array_equal(buf, want), f"shape {shape}: got {buf.ravel()[:8]}, want {want.ravel()[:8]}"
    return case


def case_allreduce_64mib(ctx: Context) -> None:
    n = LARGE_BYTES // 4
    pattern = (np.arange(n, dtype=np.int64) % 1024).astype(np.float32)
    buf = pattern * np.float32(ctx.rank + 1)
    ctx.backend.allreduce(buf)
    factor = np.float32(ctx.size * (ctx.size + 1) // 2)
    assert np.array_equal(buf, pattern * factor), "64 MiB sum differs from the expected values"


def case_broadcast_every_root(ctx: Context) -> None:
    for root in range(ctx.size):
        for dtype, n in (("float32", 1), ("int64", 100_003), ("float16", 7)):
            buf = (np.arange(n) % 97 + 10 * ctx.rank).astype(dtype)
            out = ctx.backend.broadcast(buf, root=root)
            want = (np.arange(n) % 97 + 10 * root).astype(dtype)
            assert np.array_equal(buf, want), f"broadcast from {root} ({dtype}) differs"
            assert np.shares_memory(out, buf), "broadcast must return the buffer it filled"


def case_allgather(ctx: Context) -> None:
    for dtype, shape in (("int32", (5,)), ("float64", (2, 3)), ("float32", (0,))):
        buf = (np.arange(int(np.prod(shape))).reshape(shape) + 100 * ctx.rank).astype(dtype)
        out = ctx.backend.allgather(buf)
        assert out.shape == (ctx.size, *shape), f"allgather shape {out.shape}"
        for r in range(ctx.size):
            want = (np.arange(int(np.prod(shape))).reshape(shape) + 100 * r).astype(dtype)
            assert np.array_equal(out[r], want), f"allgather row {r} differs ({dtype})"


def case_barrier(ctx: Context) -> None:
    """Ranks arrive staggered; after the barrier each sees every rank's arrival mark,
    written to the rendezvous store, a channel independent of the backend."""
    if not ctx.config.rendezvous:
        raise _Skip("needs TNT_RENDEZVOUS to observe arrivals independently")
    from ..rendezvous import connect_store

    with connect_store(ctx.config) as store:
        for round_ in range(3):
            time.sleep(0.15 * ((ctx.rank + round_) % ctx.size))
            store.set(f"conformance/barrier/{round_}/{ctx.rank}", b"1")
            ctx.backend.barrier()
            keys = [f"conformance/barrier/{round_}/{r}" for r in range(ctx.size)]
            assert store.check(keys), f"round {round_}: barrier returned before every rank arrived"


def case_async_in_flight(ctx: Context) -> None:
    rng = np.random.default_rng(1234)  # same sizes on every rank
    specs = [(int(rng.integers(1, 100_000)), DTYPES[k % len(DTYPES)]) for k in range(64)]
    bufs = [_input("sum", ctx.rank, n, dt) for n, dt in specs]
    handles = [ctx.backend.allreduce_async(b) for b in bufs]
    handles[-1].wait()
    not_done = [k for k, h in enumerate(handles) if not h.done()]
    assert not not_done, f"handle 63 finished before earlier handles {not_done[:5]}: not in order"
    for k in reversed(range(len(handles))):
        out = handles[k].wait()
        n, dt = specs[k]
        assert np.shares_memory(out, bufs[k]), "wait() must return the reduced buffer"
        assert np.array_equal(bufs[k], _expected("sum", ctx.size, n, dt)), f"handle {k} wrong"


def case_bad_input(ctx: Context) -> None:
    """Bad arguments fail locally with a clear error and leave the backend usable."""
    strided = np.zeros(10, dtype=np.float32)[::2]
    bad_calls: tuple[tuple[Callable[[], object], type[Exception] | tuple[type[Exception], ...]], ...] = (
        (lambda: ctx.backend.allreduce_async(strided), (ValueError, TypeError)),
        (lambda: ctx.backend.allreduce_async(np.zeros(3, np.float32), op="mean"), ValueError),
        (lambda: ctx.backend.allreduce_async(np.zeros(3, np.uint8)), (TypeError, ValueError)),
        # a list, not an array: wrong on purpose, the backend must reject it
        (lambda: ctx.backend.allreduce_async([1.0, 2.0]), (TypeError, ValueError)),  # type: ignore[arg-type]
    )
    for bad, expected in bad_calls:
        try:
            bad()
        except expected as exc:
            assert str(exc), "error without a message"
        else:
            raise AssertionError(f"no error for bad input ({expected})")
    buf = np.ones(4, np.float32)
    ctx.backend.allreduce(buf)
    assert np.array_equal(buf, np.full(4, ctx.size, np.float32)), "backend broken after bad input"
    # a nonsense timeout is refused before the wait starts: it must not fail the communicator
    handle = ctx.backend.allreduce_async(np.ones(4, np.float32))
    for timeout in (-1, 0, float("nan")):
        try:
            handle.wait(timeout=timeout)
        except ValueError as exc:
            assert "timeout" in str(exc), f"the error for timeout={timeout} does not say timeout"
        else:
            raise AssertionError(f"Handle.wait(timeout={timeout}) was accepted")
    assert np.array_equal(handle.wait(), np.full(4, ctx.size, np.float32)), \
        "backend broken after a nonsense timeout"


class _Skip(Exception):
    pass


CASES: dict[str, Callable[[Context], None]] = {
    **{f"allreduce-{op}-{dt}": _make_allreduce_case(op, dt) for op in REDUCE_OPS for dt in DTYPES},
    "allreduce-64MiB": case_allreduce_64mib,
    "broadcast-every-root": case_broadcast_every_root,
    "allgather": case_allgather,
    "barrier": case_barrier,
    "async-in-flight": case_async_in_flight,
    "bad-input": case_bad_input,
}
CASE_NAMES = (*CASES, "close-idempotent")


class _Report:
    def __init__(self, directory: Path, rank: int, size: int, backend: str) -> None:
        self.path = directory / f"rank{rank}.json"
        self.data: dict[str, Any] = {"rank": rank, "size": size, "backend": backend, "cases": {}}
        self.write()

    def record(self, name: str, status: str, detail: str = "", seconds: float = 0.0) -> None:
        self.data["cases"][name] = {"status": status, "detail": detail, "seconds": round(seconds, 4)}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def _run_suite(report_dir: Path, only: list[str] | None) -> int:
    import tnt_core

    runtime = tnt_core.init()
    ctx = Context(runtime.backend, runtime.config)
    report = _Report(report_dir, ctx.rank, ctx.size, runtime.backend.name)
    failed = 0
    for name, case in CASES.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            case(ctx)
            report.record(name, "ok", seconds=time.perf_counter() - t0)
        except _Skip as skip:
            report.record(name, "skip", str(skip))
        except CommError:
            failed += 1
            report.record(name, "fail", traceback.format_exc(), time.perf_counter() - t0)
            break  # collectives can no longer be matched across ranks
        except Exception:  # noqa: BLE001 - every failing case is reported, by name
            failed += 1
            report.record(name, "fail", traceback.format_exc(), time.perf_counter() - t0)
    try:
        ctx.backend.close()
        ctx.backend.close()
        report.record("close-idempotent", "ok")
    except Exception:  # noqa: BLE001 - reported as the case's failure
        failed += 1
        report.record("close-idempotent", "fail", traceback.format_exc())
    tnt_core.shutdown()
    return 1 if failed else 0


def _run_dead_peer(report_dir: Path) -> int:
    """The last rank leaves right after start-up; the others must get CommError, not hang."""
    import tnt_core

    runtime = tnt_core.init()
    backend = runtime.backend
    report = _Report(report_dir, backend.rank, backend.size, backend.name)
    backend.barrier()
    if backend.rank == backend.size - 1:
        report.record("dead-peer", "ok", "exited early on purpose")
        os._exit(0)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        for _ in range(3):  # a transport may need a round trip to notice
            backend.allreduce(np.ones(1 << 18, dtype=np.float32))
    except CommError as exc:
        report.record("dead-peer", "ok", f"CommError: {exc}", time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - the wrong error is the failure reported
        report.record("dead-peer", "fail", f"{type(exc).__name__} instead of CommError: {exc}",
                      time.monotonic() - t0)
    else:
        report.record("dead-peer", "fail", "allreduce with a dead peer returned normally",
                      time.monotonic() - t0)
    try:
        tnt_core.shutdown()  # closing after a failure must not hang either
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        report.record("close-after-failure", "fail", repr(exc))
    else:
        report.record("close-after-failure", "ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, type=Path, help="directory for rank<R>.json")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--dead-peer", action="store_true", help="run the dead-peer scenario")
    args = parser.parse_args(argv)
    args.report.mkdir(parents=True, exist_ok=True)
    if args.dead_peer:
        return _run_dead_peer(args.report)
    return _run_suite(args.report, [c for c in args.only.split(",") if c] or None)


if __name__ == "__main__":
    raise SystemExit(main())
