import json
import threading
from pathlib import Path

import numpy as np
import pytest

from tnt_core import CompletedHandle, FusedAllreducer, LocalBackend, TensorSpec, plan_buckets
from tnt_core.testing import fused_allreduce, launch_ranks

HERE = Path(__file__).parent


def _load_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fusion_worker", HERE / "fusion_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec(n, dtype="float32"):
    return ((n,), dtype)


def covered(plan):
    return sorted(t for b in plan.buckets for t in b.tensor_ids)


def test_small_tensors_are_fused_until_the_threshold():
    plan = plan_buckets([spec(4)] * 10, threshold_bytes=40)  # 16 bytes each
    assert [b.tensor_ids for b in plan.buckets] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,)]
    assert [b.nbytes for b in plan.buckets] == [48, 48, 48, 16]
    assert covered(plan) == list(range(10))


def test_zero_threshold_gives_one_bucket_per_tensor():
    plan = plan_buckets([spec(3), spec(5, "float64"), spec(1)], 0)
    assert [b.tensor_ids for b in plan.buckets] == [(0,), (1,), (2,)]


def test_tensor_larger_than_threshold_is_its_own_bucket():
    plan = plan_buckets([spec(1), spec(10_000), spec(1)], threshold_bytes=1024)
    assert [b.tensor_ids for b in plan.buckets] == [(0, 1), (2,)]
    plan = plan_buckets([spec(10_000), spec(1)], threshold_bytes=1024)
    assert plan.buckets[0].tensor_ids == (0,)


def test_a_bucket_never_mixes_dtypes():
    dtypes = ["float32", "float64", "float16", "float32", "int64", "float64", "float32"]
    plan = plan_buckets([spec(8, d) for d in dtypes], threshold_bytes=64)
    for bucket in plan.buckets:
        assert {dtypes[t] for t in bucket.tensor_ids} == {str(bucket.dtype)}
    assert covered(plan) == list(range(len(dtypes)))
    # within a bucket, tensors keep backward order
    for bucket in plan.buckets:
        assert list(bucket.tensor_ids) == sorted(bucket.tensor_ids)


def test_offsets_pack_back_to_back():
    plan = plan_buckets([((2, 3), "float32"), ((4,), "float32")], 10**6)
    (bucket,) = plan.buckets
    assert bucket.offsets == (0, 6) and bucket.size == 10


def test_plan_accepts_arrays_and_specs():
    a = np.zeros((2, 2), np.float32)
    plan = plan_buckets([a, TensorSpec((3,), np.dtype("float32"))], 0)
    assert plan.buckets[0].specs[0] == TensorSpec((2, 2), np.dtype("float32"))


def test_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="fusion threshold"):
        plan_buckets([spec(1)], -1)


class RecordingBackend(LocalBackend):
    """Size-1 backend that records the order buffers are handed to allreduce."""

    def __init__(self):
        super().__init__()
        self.issued = []

    def allreduce_async(self, buf, op="sum"):
        self.issued.append(buf.size)
        return CompletedHandle(buf)


def test_values_survive_local_fused_allreduce_with_scale():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float64), np.full(3, 2, np.float32)]
    plan = plan_buckets(arrays, 8)
    fused = FusedAllreducer(LocalBackend(), plan)
    out = fused_allreduce(fused, arrays, scale=0.25)
    for got, want in zip(out, arrays):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want * 0.25)


def test_bucket_starts_as_soon_as_complete_and_in_plan_order():
    backend = RecordingBackend()
    plan = plan_buckets([spec(4)] * 4, threshold_bytes=32)  # buckets (0,1) (2,3)
    fused = FusedAllreducer(backend, plan)
    fused.push(0, np.zeros(4, np.float32))
    assert backend.issued == []
    fused.push(1, np.zeros(4, np.float32))
    assert backend.issued == [8], "bucket 0 must start before finish() is called"
    fused.push(3, np.zeros(4, np.float32))
    fused.push(2, np.zeros(4, np.float32))
    assert backend.issued == [8, 8]
    fused.finish()


def test_complete_bucket_waits_for_earlier_buckets():
    backend = RecordingBackend()
    plan = plan_buckets([spec(1), spec(2), spec(3)], threshold_bytes=0)
    fused = FusedAllreducer(backend, plan)
    fused.push(2, np.zeros(3, np.float32))
    fused.push(1, np.zeros(2, np.float32))
    assert backend.issued == [], "bucket 2 and 1 may not overtake bucket 0"
    fused.push(0, np.zeros(1, np.float32))
    assert backend.issued == [1, 2, 3]
    fused.finish()


def test_pushes_from_many_threads():
    n = 64
    arrays = [np.full(10, i, np.float32) for i in range(n)]
    plan = plan_buckets(arrays, 100)
    fused = FusedAllreducer(LocalBackend(), plan)
    threads = [threading.Thread(target=fused.push, args=(i, arrays[i])) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    out = fused.finish()
    assert [int(o[0]) for o in out] == list(range(n))


def test_misuse_is_reported():
    plan = plan_buckets([spec(2), spec(2)], 0)
    fused = FusedAllreducer(LocalBackend(), plan)
    fused.push(0, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="pushed twice"):
        fused.push(0, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"missing tensor ids \[1\]"):
        fused.finish()
    with pytest.raises(ValueError, match="plan expects"):
        fused.push(0, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="would truncate"):
        reducer = FusedAllreducer(LocalBackend(), plan_buckets([spec(2, "int64")], 0))
        reducer.push(0, np.ones(2, np.int64), 0.5)
    with pytest.raises(ValueError, match="expected 2 tensors"):
        fused_allreduce(fused, [np.zeros(2, np.float32)])


@pytest.mark.parametrize("threshold", [0, 256, 10**9])
def test_fused_allreduce_across_three_processes(tmp_path, threshold):
    inputs = _load_worker().inputs

    result = launch_ranks([str(HERE / "fusion_worker.py"), str(threshold), str(tmp_path)], 3,
                          backend="store", timeout=120, tnt_timeout_s=60)
    result.check()
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for step in ("0", "1"):
        want = [sum(inputs(r)[t] for r in range(3)) * (int(step) + 1) for t in range(7)]
        want = [w * 0.5 if w.dtype.kind == "f" else w for w in want]
        for data in per_rank:
            for got, expected in zip(data["results"][step], want):
                actual = np.asarray(got, dtype=expected.dtype).reshape(expected.shape)
                np.testing.assert_array_equal(actual, expected)
    buckets = per_rank[0]["buckets"]
    assert buckets == {0: 7, 256: 5, 10**9: 4}[threshold]


def test_a_bucket_closes_with_the_last_tensor_of_its_dtype():
    # the small float64 tensor first (metric states) is not held back to the end
    plan = plan_buckets([spec(2, "float64"), spec(4), spec(4), spec(4)], threshold_bytes=32)
    assert [b.tensor_ids for b in plan.buckets] == [(0,), (1, 2), (3,)]


def test_aligned_plan_gives_64_byte_aligned_views():
    specs = [spec(10), spec(3, "float64"), spec(7), spec(16), spec(1, "float64")]
    plan = plan_buckets(specs, threshold_bytes=10**6, align_bytes=64)
    f32 = next(b for b in plan.buckets if b.dtype == np.float32)
    assert f32.offsets == (0, 16, 32) and f32.size == 48
    reducer = FusedAllreducer(LocalBackend(), plan)
    arrays = [np.full(s[0], i + 1, dtype=s[1]) for i, s in enumerate(specs)]
    out = fused_allreduce(reducer, arrays)
    for a, o in zip(arrays, out):
        assert o.ctypes.data % 64 == 0
        np.testing.assert_array_equal(a, o)
    with pytest.raises(ValueError, match="alignment"):
        plan_buckets(specs, 0, align_bytes=-1)
