"""``tnt.keras.layers.SplitLayer``: where a model is cut into pipeline partitions.

Why a layer: the cut is a property of the model the user writes, so it travels with the
model code and, being an identity, leaves the model's result unchanged wherever it runs
(plain Keras, ``ParallelStrategy.DATA``); only pipelining reads it
(:mod:`tarantella.pipeline.partition`).
"""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["SplitLayer"]


@keras.saving.register_keras_serializable(package="tarantella")
class SplitLayer(keras.layers.Layer):
    """A cut between two pipeline partitions: the identity on its input (a tensor, or a
    list/tuple/dict of tensors that all cross the cut together).

    Every tensor that crosses from one partition to the next goes through a SplitLayer;
    several SplitLayers on parallel branches form one cut.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs: Any) -> Any:
        return keras.tree.map_structure(lambda x: x, inputs)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return input_shape

    def compute_output_spec(self, inputs: Any) -> Any:
        return keras.tree.map_structure(
            lambda x: keras.KerasTensor(x.shape, dtype=x.dtype, sparse=getattr(x, "sparse", False)),
            inputs)
