"""Run every case of the user-level collectives (``tnt.TensorAllreducer`` & co., groups) on
this rank and write ``<out>/rank<R>.json``: case name -> ``{"ok": bool, "detail": str}``.

Rank ``r``'s values are a function of ``r``, so each rank computes with NumPy what every
rank passed and checks the result against it. Cases that must fail check that every rank
raises the expected error (a clear message, and the job still usable afterwards).
``test_user_collectives.py`` reads the files.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

CASES: dict[str, Callable[[], None]] = {}


def case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import tensorflow as tf

    import tarantella as tnt
    import tnt_core

    rank, size = tnt.get_rank(), tnt.get_size()

    def values(r: int, shape=(2, 3), dtype=np.float32) -> np.ndarray:
        return (np.arange(int(np.prod(shape))).reshape(shape) + 10 * r + 1).astype(dtype)

    def expect_raises(kind: type, fragment: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except kind as exc:
            assert fragment in str(exc), f"unexpected message: {exc}"
            return
        raise AssertionError(f"no {kind.__name__} raised")

    def equal(got, want, kind: type) -> None:
        assert type(got) is kind, f"{type(got).__name__} returned, {kind.__name__} expected"
        got_np = got.numpy() if isinstance(got, tf.Tensor) else np.asarray(got)
        assert got_np.shape == np.asarray(want).shape, (got_np.shape, np.asarray(want).shape)
        np.testing.assert_array_equal(got_np, want)

    # -- allreduce --------------------------------------------------------------------------

    @case
    def allreduce_numpy_sum_is_numpy_and_input_untouched():
        x = values(rank)
        before = x.copy()
        out = tnt.TensorAllreducer(x)(x)
        equal(out, sum(values(r) for r in range(size)), np.ndarray)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(x, before)

    @case
    def allreduce_reductions():
        x = values(rank, (5,), np.float64)
        every = np.stack([values(r, (5,), np.float64) for r in range(size)])
        ops = {"SUM": every.sum(0), "AVERAGE": every.mean(0), "PROD": every.prod(0),
               "MIN": every.min(0), "MAX": every.max(0)}
        for name, want in ops.items():
            out = tnt.TensorAllreducer(x, reduction_op=getattr(tnt.ReductionOp, name))(x)
            np.testing.assert_allclose(out, want, rtol=1e-12, err_msg=name)
        ints = np.array([rank + 2, -rank], dtype=np.int64)
        out = tnt.allreduce(ints, reduction_op="prod")
        equal(out, np.prod([[r + 2, -r] for r in range(size)], axis=0), np.ndarray)

    @case
    def allreduce_structure_keeps_structure_and_types():
        def inputs(r: int, order: int = 1):
            d = {"w": tf.constant(values(r, (3,), np.int16)), "loss": float(r) + 0.5,
                 "count": r + 1, "flag": r == 0, "np": np.float32(r),
                 "pair": (values(r, (2, 2), np.float64), tf.constant([r], tf.bfloat16)),
                 "var": tf.Variable([float(r), 1.0])}
            return dict(reversed(list(d.items()))) if order < 0 else d  # key order differs

        out = tnt.TensorAllreducer(inputs(0))(inputs(rank, order=-1 if rank % 2 else 1))
        assert list(out) == (list(inputs(0, -1)) if rank % 2 else list(inputs(0)))
        equal(out["w"], sum(values(r, (3,), np.int16) for r in range(size)), type(tf.constant(0)))
        assert out["w"].dtype == tf.int16
        assert type(out["loss"]) is float and out["loss"] == sum(r + 0.5 for r in range(size))
        assert type(out["count"]) is int and out["count"] == sum(range(1, size + 1))
        assert type(out["flag"]) is bool and out["flag"] is True  # any rank true
        assert type(out["np"]) is np.float32 and out["np"] == sum(range(size))
        assert type(out["pair"]) is tuple
        equal(out["pair"][0], sum(values(r, (2, 2), np.float64) for r in range(size)), np.ndarray)
        assert out["pair"][1].dtype == tf.bfloat16 and float(out["pair"][1][0]) == sum(range(size))
        assert isinstance(out["var"], tf.Tensor) and not isinstance(out["var"], tf.Variable)
        np.testing.assert_array_equal(out["var"].numpy(), [sum(range(size)), size])

    @case
    def allreduce_lists_reused_and_split_phase():
        arrays = [values(rank, (4, 1), np.float32), values(rank, (3,), np.float64),
                  values(rank, (2,), np.int32)]
        reducer = tnt.TensorAllreducer(arrays)
        for step in range(3):
            now = [a * (step + 1) for a in arrays]
            reducer.start(now)
            out = reducer.wait_for_completion(now)
            assert type(out) is list and len(out) == 3
            for k, a in enumerate(out):
                want = sum(values(r, arrays[k].shape, arrays[k].dtype) for r in range(size)) * (step + 1)
                equal(a, want, np.ndarray)
                assert a.dtype == arrays[k].dtype

    @case
    def allreduce_empty_structures_and_arrays():
        assert tnt.TensorAllreducer({})({}) == {}
        assert tnt.TensorAllreducer([])([]) == []
        out = tnt.allreduce([np.zeros((0, 3), np.float32), np.ones(2, np.float32)])
        equal(out[0], np.zeros((0, 3), np.float32), np.ndarray)
        equal(out[1], np.full(2, size, np.float32), np.ndarray)
        equal(tnt.allreduce(np.zeros(0, np.int64)), np.zeros(0, np.int64), np.ndarray)

    @case
    def allreduce_nan_and_inf_propagate():
        x = np.ones(6, np.float32)
        if rank == size - 1:
            x[1], x[4] = np.nan, np.inf
        out = tnt.allreduce(x)
        assert np.isnan(out[1]) and np.isinf(out[4]) and out[0] == size

    @case
    def allreduce_shape_mismatch_is_refused_on_every_rank():
        x = np.ones(3 + (rank == 1), np.float32)
        expect_raises(tnt_core.CollectiveMismatchError, "differs between ranks",
                      lambda: tnt.TensorAllreducer(x)(x))

    @case
    def allreduce_and_broadcast_empty_on_one_rank_are_refused_not_hung():
        x = np.ones(0 if rank == 1 else 3, np.float32)
        expect_raises(tnt_core.CollectiveMismatchError, "differs between ranks",
                      lambda: tnt.allreduce(x))
        expect_raises(tnt_core.CollectiveMismatchError, "differs between ranks",
                      lambda: tnt.broadcast(x))

    @case
    def allreduce_structure_mismatch_is_refused_on_every_rank():
        x = [np.ones(3, np.float32), np.ones(2 + (rank == 1), np.float32)]
        expect_raises(tnt_core.CollectiveMismatchError, "passed different inputs",
                      lambda: tnt.allreduce(x))

    # -- broadcast --------------------------------------------------------------------------

    @case
    def broadcast_from_each_root_numpy_tensor_and_nested():
        for root in range(size):
            proto = [[values(root, (1, 1, 3, 4))] * 3, tf.constant(values(root, (5,), np.int32)),
                     35 + root]
            mine = [[values(rank, (1, 1, 3, 4))] * 3, tf.constant(values(rank, (5,), np.int32)),
                    35 + rank]
            caster = tnt.TensorBroadcaster(mine, root_rank=root)
            out = caster.broadcast(mine) if rank == root else caster.broadcast()
            assert type(out) is list and len(out[0]) == 3
            for a in out[0]:
                equal(a, values(root, (1, 1, 3, 4)), np.ndarray)
            equal(out[1], values(root, (5,), np.int32), type(tf.constant(0)))
            assert out[2] == 35 + root and type(out[2]) is int
            del proto

    @case
    def broadcast_one_call_and_root_without_values():
        out = tnt.broadcast(values(rank, (2, 2), np.float16), root_rank=size - 1)
        equal(out, values(size - 1, (2, 2), np.float16), np.ndarray)
        caster = tnt.TensorBroadcaster(values(rank, (3,), np.float32), root_rank=0)
        equal(caster(), values(0, (3,), np.float32), np.ndarray)  # the root sends what it was built with

    # -- allgather ----------------------------------------------------------------------------

    @case
    def allgather_equal_and_differing_first_dims():
        x = values(rank, (2, 1), np.float32)
        equal(tnt.TensorAllgatherer(x)(x), np.concatenate([values(r, (2, 1)) for r in range(size)]),
              np.ndarray)
        rows = lambda r: values(r, (r + 1, 3), np.float64)  # noqa: E731
        equal(tnt.allgather(rows(rank)), np.concatenate([rows(r) for r in range(size)]), np.ndarray)
        none_here = lambda r: values(r, (0 if r == 0 else 2, 2), np.int32)  # noqa: E731
        equal(tnt.allgather(none_here(rank)), np.concatenate([none_here(r) for r in range(size)]),
              np.ndarray)

    @case
    def allgather_scalars_tensors_and_structures():
        equal(tnt.allgather(50 + rank), np.array([50 + r for r in range(size)]), np.ndarray)
        t = tf.constant(values(rank, (rank + 1, 2), np.int64))
        out = tnt.TensorAllgatherer(t)(t)
        equal(out, np.concatenate([values(r, (r + 1, 2), np.int64) for r in range(size)]),
              type(tf.constant(0)))
        s = {"ids": np.arange(rank + 1, dtype=np.int64), "loss": float(rank),
             "mask": tf.constant([rank % 2 == 0] * 2)}
        out = tnt.allgather(s)
        equal(out["ids"], np.concatenate([np.arange(r + 1) for r in range(size)]), np.ndarray)
        equal(out["loss"], np.arange(size, dtype=np.float64), np.ndarray)
        equal(out["mask"], np.repeat([r % 2 == 0 for r in range(size)], 2), type(tf.constant(0)))

    @case
    def allgather_trailing_mismatch_is_refused_on_every_rank():
        x = np.ones((2, 3 + (rank == 1)), np.float32)
        expect_raises(tnt_core.CollectiveMismatchError, "passed different inputs",
                      lambda: tnt.allgather(x))

    # -- groups and barriers --------------------------------------------------------------------

    @case
    def world_group_and_barrier():
        g = tnt.Group()
        assert g.ranks == list(range(size)) and g.size == size and g.rank == rank
        assert tnt.is_group_master_rank(g) == tnt.is_master_rank()
        tnt.Barrier()()
        tnt.Barrier(g).execute()
        same = tnt.Group(list(range(size)))  # all ranks in order: the job's communicator
        equal(tnt.allreduce(np.ones(2), group=same), np.full(2, float(size)), np.ndarray)

    @case
    def group_of_first_two_and_a_rank_outside():
        g = tnt.Group([1, 0])  # every rank asks for it; rank 1 is its group rank 0
        assert g.size == 2 and g.ranks == [1, 0] and g.to_global_rank(0) == 1
        assert g.contains(0) and g.contains(1) and g.contains(2) is False
        assert tnt.get_group_master_rank(g) == 1 and tnt.is_group_master_rank(g) == (rank == 1)
        if g.contains(rank):
            assert g.rank == {1: 0, 0: 1}[rank]
            out = tnt.TensorAllreducer(values(rank), group=g)(values(rank))
            equal(out, values(0) + values(1), np.ndarray)
            got = tnt.TensorBroadcaster(values(rank), root_rank=0, group=g)()
            equal(got, values(1), np.ndarray)  # group rank 0 is rank 1
            gathered = tnt.allgather(values(rank, (rank + 1, 2)), group=g)
            equal(gathered, np.concatenate([values(1, (2, 2)), values(0, (1, 2))]), np.ndarray)
            tnt.Barrier(g)()
        else:
            assert g.rank is None
            for make in (lambda: tnt.TensorAllreducer(1.0, group=g), lambda: tnt.Barrier(g),
                         lambda: tnt.TensorBroadcaster(1.0, group=g)):
                expect_raises(ValueError, "is not a member of the group", make)
        tnt.Barrier()()  # the job's communicator still works for everyone

    @case
    def each_rank_builds_its_own_group_as_in_the_original():
        mine = [0, 1] if rank < 2 else list(range(2, size))
        g = tnt.Group(mine)
        assert g.ranks == mine and g.rank == mine.index(rank)
        out = tnt.allreduce(np.array([rank], np.int64), group=g)
        equal(out, np.array([sum(mine)]), np.ndarray)
        first = tnt.broadcast(np.array([rank], np.int32), root_rank=0, group=g)
        equal(first, np.array([mine[0]], np.int32), np.ndarray)

    @case
    def members_asking_for_different_groups_is_refused_on_every_rank():
        asks = {0: [0, 1], 1: [1, 0]}.get(rank, [0, 1])
        expect_raises(ValueError, "every member of a group must ask for that group",
                      lambda: tnt.Group(asks))
        equal(tnt.allreduce(np.ones(1)), np.full(1, float(size)), np.ndarray)  # still usable

    @case
    def bad_arguments_fail_locally_with_one_line():
        expect_raises(TypeError, "inputs is a str", lambda: tnt.TensorAllreducer("text"))
        expect_raises(TypeError, "uint64", lambda: tnt.TensorAllreducer(np.zeros(2, np.uint64)))
        expect_raises(ValueError, "root_rank=7", lambda: tnt.TensorBroadcaster(1.0, root_rank=7))
        expect_raises(ValueError, "rank 9 is not a rank of this job", lambda: tnt.Group([0, 9]))
        expect_raises(TypeError, "pass a tnt.Group", lambda: tnt.allreduce(1.0, group=[0, 1]))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for name, fn in CASES.items():
        try:
            fn()
            report[name] = {"ok": True, "detail": ""}
        except Exception as exc:  # noqa: BLE001 (every failure goes into the report)
            report[name] = {"ok": False, "detail": "".join(traceback.format_exception(exc))[-3000:]}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
