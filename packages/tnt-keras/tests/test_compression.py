"""Gradient compression (``TNT_GRADIENT_COMPRESSION``, Horovod's compressors) in one process.

The reduction runs over a two-rank communicator whose peer mirrors this rank (its
allreduce doubles the bucket and records what it was handed), so what travels can be
read: compressed, each gradient is weighted in its own dtype before the cast to float16
(a gradient of 1e5, past float16's 65504, travels as its weighted 3e4), and the sum comes
back in the gradient's dtype within float16's round-off; uncompressed, the bucket is the
gradient's dtype and the result exact. Which path (native or Python) the reducer takes
depends only on the dtypes it is handed, so both get the float16 tensors;
``test_native_path`` trains through both with compression on, and ``test_custom_loops``
checks ``hvd.allreduce``'s on 3 ranks.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tarantella.horovod as hvd
import tnt_core
from tarantella.comm import Channel
from tarantella.comm import compression as wire
from tarantella.comm.gradients import GradientReducer, reduce_weighted
from tarantella.data_parallel.steps import step_compression

#: 1e5 is past float16's largest value (65504); weighted by 0.3, and summed over 2 ranks, not
KERNEL = np.array([[1.0e5, -3.0], [0.1, 7.0]], np.float32)
BIAS = np.array([2.5, -1.0e-3], np.float32)
WEIGHT = 0.3  # not a power of 2: weighting after the cast would round differently


class _Mirror:
    """Rank 0 of two whose peer pushes what this rank pushes: an allreduce doubles the
    buffer; every buffer handed over is recorded."""

    name = "mirror"
    rank, size, local_rank, local_size = 0, 2, 0, 2

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []

    def allreduce_async(self, buf: np.ndarray, op: str = "sum") -> tnt_core.Handle:
        self.seen.append(buf.copy())
        buf *= 2
        return tnt_core.CompletedHandle(buf)


def _reduce(compression, kernel: np.ndarray = KERNEL, weight: float = WEIGHT
            ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    backend = _Mirror()
    channel = Channel(tnt_core.init(), backend)  # type: ignore[arg-type]
    reducer = GradientReducer(channel, "compression_test")
    out = reduce_weighted([tf.constant(kernel), tf.constant(BIAS)], None, tf.constant(weight, tf.float64),
                          lambda: reducer, channel, keep=tf.constant(True), compression=compression)
    return [o.numpy() for o in out], backend.seen


@pytest.mark.parametrize("compression", [wire.FP16Compression(), hvd.Compression.fp16],
                         ids=["setting", "horovod"])
def test_compressed_gradients_are_weighted_then_travel_as_float16(compression):
    (kernel, bias), seen = _reduce(compression)
    assert [b.dtype for b in seen] == [np.float16]
    sent = np.concatenate([(KERNEL * np.float32(WEIGHT)).astype(np.float16).ravel(),
                           (BIAS * np.float32(WEIGHT)).astype(np.float16).ravel()])
    bucket = seen[0][seen[0] != 0]  # without the zeros that align each tensor's view
    np.testing.assert_array_equal(np.sort(bucket), np.sort(sent))
    assert kernel.dtype == bias.dtype == np.float32
    np.testing.assert_allclose(kernel, 2 * WEIGHT * KERNEL, rtol=1e-3)
    np.testing.assert_allclose(bias, 2 * WEIGHT * BIAS, rtol=1e-3)


def test_a_rank_without_samples_sends_zeros_compressed_too():
    """Weight 0 (no sample on this rank, whose gradient is a stand-in, here NaN): zeros
    travel, as uncompressed, never 0 * NaN."""
    (kernel, bias), seen = _reduce(wire.FP16Compression(), kernel=np.full_like(KERNEL, np.nan),
                                   weight=0.0)
    assert [b.dtype for b in seen] == [np.float16]
    assert not np.isnan(seen[0]).any() and not seen[0].any(), seen[0]
    assert not kernel.any() and not bias.any()


@pytest.mark.parametrize("compression", [wire.NO_COMPRESSION, hvd.Compression.none],
                         ids=["setting", "horovod"])
def test_uncompressed_gradients_travel_in_their_dtype_and_sum_exactly(compression):
    (kernel, bias), seen = _reduce(compression)
    assert [b.dtype for b in seen] == [np.float32]
    np.testing.assert_array_equal(kernel, KERNEL * np.float32(WEIGHT) * 2)
    np.testing.assert_array_equal(bias, BIAS * np.float32(WEIGHT) * 2)


class _Runtime:
    size, is_master = 2, True


class _OtherRank:
    size, is_master = 2, False


def test_the_setting_is_off_by_default_and_said_once_on_the_master(monkeypatch):
    monkeypatch.delenv(wire.SETTING, raising=False)
    assert wire.for_fit(_Runtime()) is wire.NO_COMPRESSION  # type: ignore[arg-type]
    monkeypatch.setenv(wire.SETTING, "FP16")
    monkeypatch.setattr(wire, "_announced", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tnt.keras")  # tnt's loggers do not propagate to pytest's
    logger.addHandler(handler)
    try:
        assert isinstance(wire.for_fit(_Runtime()), wire.FP16Compression)  # type: ignore[arg-type]
        wire.for_fit(_Runtime())  # type: ignore[arg-type]
        monkeypatch.setattr(wire, "_announced", set())
        wire.for_fit(_OtherRank())  # type: ignore[arg-type]
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records if "travel" in r.getMessage()]
    assert lines == ["gradients travel as float16 (TNT_GRADIENT_COMPRESSION=fp16): training's "
                     "results differ from serial training by float16 round-off of the summed "
                     "gradients"]
    monkeypatch.setenv(wire.SETTING, "int8")
    with pytest.raises(tnt_core.ConfigError, match="TNT_GRADIENT_COMPRESSION='int8' is not one of"):
        wire.for_fit(_Runtime())  # type: ignore[arg-type]


def test_a_horovod_optimizers_compressor_is_honoured_in_fit(monkeypatch):
    """``hvd.DistributedOptimizer(..., compression=fp16)`` compiled into a ``tnt.Model``: the
    model's step reduces, with the optimizer's compressor; a plain optimizer takes the setting."""
    monkeypatch.delenv(wire.SETTING, raising=False)
    runtime = tnt_core.init()
    fp16 = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16)
    assert step_compression(fp16, runtime) is hvd.Compression.fp16
    plain = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert step_compression(plain, runtime) is wire.NO_COMPRESSION
    assert step_compression(keras.optimizers.SGD(0.1), runtime) is wire.NO_COMPRESSION
