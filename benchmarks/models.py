"""The models the scaling benchmarks train, built against a given Keras module.

The same builders serve Keras 3 (ours) and legacy tf-keras (MultiWorkerMirroredStrategy,
which only works there), so both sides train exactly the same architecture.

* ``mlp``       784-512-512-10, the model of the issue's reference numbers (0.67 M params)
* ``resnet20``  a ResNet-20-style CNN on 32x32x3 inputs (0.27 M params, compute-bound)
* ``wide``      784-4096-4096-1024-10 MLP (24.2 M params, communication-bound)
* ``gelu``      784-2048-2048-1024-10 MLP, GELU and LayerNormalization after each hidden
  layer (7.9 M params): element-wise work that XLA fuses, so XLA is worth something here
"""

from __future__ import annotations

import numpy as np

#: what the benchmarks run by default; ``gelu`` on request (``--models gelu``)
MODELS = ("mlp", "resnet20", "wide")
ALL_MODELS = (*MODELS, "gelu")


def input_shape(name: str) -> tuple[int, ...]:
    return (32, 32, 3) if name == "resnet20" else (784,)


def synthetic_data(name: str, samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs and labels (throughput does not depend on the values)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, *input_shape(name)), dtype=np.float32)
    y = rng.integers(0, 10, size=samples).astype(np.int32)
    return x, y


def _resnet20(keras):
    layers = keras.layers

    def block(x, filters, stride):
        shortcut = x
        y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization()(y)
        y = layers.Activation("relu")(y)
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
            shortcut = layers.BatchNormalization()(shortcut)
        return layers.Activation("relu")(layers.Add()([y, shortcut]))

    inputs = keras.Input(shape=(32, 32, 3))
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    for filters, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(3):
            x = block(x, filters, stride if i == 0 else 1)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10)(x)
    return keras.Model(inputs, outputs, name="resnet20")


def build(name: str, keras):
    """An uncompiled model ``name`` made with the Keras module ``keras``."""
    layers = keras.layers
    if name == "mlp":
        return keras.Sequential([keras.Input(shape=(784,)), layers.Dense(512, activation="relu"),
                                 layers.Dense(512, activation="relu"), layers.Dense(10)], name="mlp")
    if name == "wide":
        return keras.Sequential([keras.Input(shape=(784,)), layers.Dense(4096, activation="relu"),
                                 layers.Dense(4096, activation="relu"),
                                 layers.Dense(1024, activation="relu"), layers.Dense(10)], name="wide")
    if name == "gelu":
        hidden = []
        for units in (2048, 2048, 1024):
            hidden += [layers.Dense(units, activation="gelu"), layers.LayerNormalization()]
        return keras.Sequential([keras.Input(shape=(784,)), *hidden, layers.Dense(10)], name="gelu")
    if name == "resnet20":
        return _resnet20(keras)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(ALL_MODELS)}")


def compile_for_benchmark(model, keras, jit_compile="auto"):
    """SGD with momentum and ``jit_compile`` as given (Keras' default ``"auto"``: no XLA on
    a machine without a GPU; a tnt.Model then compiles the optimizer's update alone)."""
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model
