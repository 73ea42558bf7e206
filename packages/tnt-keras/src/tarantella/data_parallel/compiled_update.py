"""The optimizer's update compiled with XLA, inside a step that XLA does not compile.

Why: Keras' optimizers update each weight with a handful of elementwise TensorFlow ops
(Adam: a subtraction, a square, a few multiplications and three assignments), each
streaming a weight-sized tensor through memory. XLA fuses them into one pass over each
weight: on the development machine, Adam over 3.1 M float32 weights took 14.9 ms per step
as TensorFlow ops and 5.2 ms compiled (a plain copy of one weight-sized buffer: 2.1 ms).
Three steps are not compiled as a whole: a pipeline stage's (its messages are ops XLA
cannot compile), a data-parallel step when Keras resolves ``jit_compile="auto"`` to False
(a machine without a GPU), and a data-parallel step with ``jit_compile=True``, which XLA
compiles in clusters between its collectives (:mod:`tarantella.data_parallel.xla`). The
update is Keras' own ``optimizer.apply``, traced into a ``tf.function(jit_compile=True)``
called from the step: the same arithmetic, in XLA's order of evaluation
(differences of round-off). Marking the update's ops for XLA's
clustering instead (``tf.xla.experimental.jit_scope``) was measured slower than leaving
them as ops (``mlp``, one CPU: 3.87-4.21 against 3.51-3.62 CPU ms per step).

It follows ``compile(jit_compile=...)`` as the user gave it (:func:`wants_compiled_update`):
``False`` keeps the update as TensorFlow ops; ``"auto"`` and ``True`` compile it, but not
when TensorFlow's op determinism is enabled (Keras' own rule: XLA does not promise
determinism) nor when XLA cannot compile the optimizer (a custom optimizer's op XLA lacks):
the update then stays as TensorFlow ops, with a warning under ``True``. A data-parallel
fit whose epochs end by running out of data keeps the ops too, to count the optimizer's
iterations as plain Keras does (``DataParallelModel._tnt_update_for``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from .. import _keras_compat

__all__ = ["CompiledUpdate", "compiled_apply", "wants_compiled_update"]


def wants_compiled_update(jit_compile: Any) -> bool:
    """Whether ``compile(jit_compile=...)``, as the user gave it (``"auto"`` unresolved), has
    the optimizer's update compiled with XLA: ``"auto"`` and ``True``, unless TensorFlow's
    op determinism is on."""
    if jit_compile is False or jit_compile is None:
        return False
    return not _keras_compat.is_op_determinism_enabled()


def compiled_apply(apply: Callable[..., Any], variables: list[Any] | None) -> Any:
    """``apply(grads, variables)`` (an optimizer's own ``apply``) as an XLA function of the
    gradients, one argument each (so that ``experimental_get_compiler_ir`` takes one spec
    each)."""

    def tnt_xla_apply(*grads: Any) -> Any:
        return apply(list(grads), variables)

    return tf.function(tnt_xla_apply, jit_compile=True, autograph=False)


def _spec(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlicesSpec(value.values.shape, value.values.dtype, value.indices.dtype,
                                    dense_shape_dtype=value.dense_shape.dtype)
    return tf.TensorSpec(value.shape, value.dtype)


class CompiledUpdate:
    """``optimizer.apply(grads, weights)`` as one XLA-compiled function, traced where the
    step is; :meth:`__call__` falls back to the plain update when XLA cannot compile it.

    :param explicit: the user asked for XLA (``jit_compile=True``): a fallback warns.
    :param apply: the optimizer's own ``apply``, when the step overrides the attribute.
    """

    def __init__(self, optimizer: Any, weights: Sequence[Any] | None, explicit: bool = False,
                 apply: Callable[..., Any] | None = None) -> None:
        self.optimizer, self.explicit = optimizer, explicit
        self.weights = None if weights is None else list(weights)
        self._apply = optimizer.apply if apply is None else apply
        self._fn = compiled_apply(self._apply, self.weights)
        self.compiled: bool | None = None  # unknown until the first trace

    def _compilable(self, grads: Sequence[Any]) -> bool:
        try:
            # Outside the step's graph: asked without a device, TensorFlow finds its preferred
            # one by making a random number, which would stay in the step and run every step.
            with tf.init_scope():
                self._fn.experimental_get_compiler_ir(*[_spec(g) for g in grads])(stage="hlo")
        except Exception as exc:  # noqa: BLE001 - any reason XLA gives is a reason to fall back
            if self.explicit:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                warnings.warn(
                    f"jit_compile=True: XLA cannot compile this optimizer's update "
                    f"({type(self.optimizer).__name__}: {first[:200]}); it runs as "
                    "TensorFlow ops (the same result, slower)", stacklevel=3)
            return False
        return True

    def __call__(self, grads: Sequence[Any]) -> Any:
        """Apply ``grads`` (traced into the caller's graph)."""
        if self.compiled is None:
            self.compiled = self._compilable(grads)
        if self.compiled:
            return self._fn(*grads)
        return self._apply(list(grads), self.weights)
