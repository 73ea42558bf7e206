"""How dense gradients travel: in their own dtype, or compressed (Horovod's compressors, and
``TNT_GRADIENT_COMPRESSION`` for ``fit``).

Compression halves the bytes a link carries, which is what bounds an allreduce across hosts;
it also rounds every rank's gradient, and the sum, to the narrower type, so training no
longer gives the serial result. That breaks the rule tarantella keeps everywhere else
(serial result or a clear refusal), which is why it is opt-in, and why ``fit`` says so
once, on the master rank, when it traces the first step that uses it.

The reduction (:func:`tarantella.comm.gradients.reduce_weighted`) weights each rank's
gradient (by ``n_r / B``, or Horovod's ``1 / R``) in the gradient's own dtype *before*
compressing it: the sum of the weighted gradients is a gradient's size, so it cannot
overflow float16 where the gradients themselves do not. Sparse gradients
(``tf.IndexedSlices``) are gathered row by row, never summed, and travel uncompressed.
"""

from __future__ import annotations

from typing import Any, Protocol

import tensorflow as tf

import tnt_core

from ..reporting.log import logger

__all__ = ["NO_COMPRESSION", "Compression", "FP16Compression", "NoCompression", "for_fit",
           "travels_as_is"]

#: the variable that turns compression on for ``fit``'s (and a stage's) gradient allreduce
SETTING = "TNT_GRADIENT_COMPRESSION"


class Compression(Protocol):
    """How gradients travel (Horovod's compressors): ``compress`` before, ``decompress`` after."""

    def compress(self, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]: ...

    def decompress(self, tensor: tf.Tensor, context: Any) -> tf.Tensor: ...


class NoCompression:
    """Gradients travel as they are."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, context: Any) -> tf.Tensor:
        return tensor


class FP16Compression:
    """Floating-point tensors travel as float16 (half the bytes of float32; float16's
    precision and range; bfloat16, which no backend sums, too), others as they are."""

    #: what the line on the master rank calls it
    name = "float16"

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, context: Any) -> tf.Tensor:
        return tensor if context is None else tf.cast(tensor, context)


NO_COMPRESSION: Compression = NoCompression()

#: TNT_GRADIENT_COMPRESSION's values
_BY_SETTING: dict[str, Compression] = {"none": NO_COMPRESSION, "fp16": FP16Compression()}


def travels_as_is(compression: Any) -> bool:
    """True for no compression (the instance, or Horovod's ``Compression.none``, the class)."""
    return compression is NoCompression or isinstance(compression, NoCompression)


_announced: set[str] = set()


def for_fit(runtime: tnt_core.Runtime) -> Compression:
    """The compression ``TNT_GRADIENT_COMPRESSION`` asks for ``fit``'s gradients, read when
    a step is traced; the first time it is not ``none`` in a job of several ranks, one line
    on the master rank says that results differ from serial training."""
    value = tnt_core.read_setting(SETTING)
    compression = _BY_SETTING[value]
    if value not in _announced and not travels_as_is(compression) and runtime.size > 1:
        _announced.add(value)
        if runtime.is_master:
            name = getattr(compression, "name", value)
            logger.warning(f"gradients travel as {name} ({SETTING}={value}): training's results "
                           f"differ from serial training by {name} round-off of the summed "
                           "gradients")
    return compression
