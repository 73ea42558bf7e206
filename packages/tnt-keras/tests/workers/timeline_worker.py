"""Train a small model with ``TNT_TIMELINE`` set (the launcher sets it); the trace is checked
by ``test_timeline.py``.

The model makes overlap a matter of dataflow rather than luck: its first layer is wide
(4096 -> 1024 on 256-sample micro-batches), so the last gradient of backprop, that layer's
kernel, is a ~2 GFLOP matmul (~10-30 ms on one core) that can start only after the small
last layer's gradients exist and could be pushed (``TNT_FUSION_THRESHOLD_KB=0``: one bucket
per tensor, so the last layer's bucket starts at once). The test still asks it of most
steps, not all: the push is a Python call that TensorFlow's executor may schedule after the
big matmul when both inter-op threads are busy (measured, 2 ranks on 2 cores: 8 of 8 steps
overlapped, by 7-33 ms; with a 2048-wide first layer the smallest margin was 0.4 ms).
"""

from __future__ import annotations

import sys

import numpy as np


def main() -> None:
    import keras

    import tarantella as tnt

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input(shape=(4096,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model = tnt.Model(model)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    micro = 256
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((micro * tnt.get_size() * steps, 4096), dtype=np.float32)
    y = rng.integers(0, 10, size=len(x))
    model.fit(x, y, batch_size=micro * tnt.get_size(), epochs=1, shuffle=False, verbose=0)


if __name__ == "__main__":
    main()
