"""A small Keras MLP trained for 2 epochs in float64, its weights saved to
``OUT/rank<r>.npz`` (under ``tnt run``, through ``tnt.Model``) or ``OUT/serial.npz``
(``keras_mlp.py OUT --serial``: plain Keras in one process, the reference). A rank prints
its rank, backend, allreduce transport (the Gloo backend's ``allreduce_transport``),
network namespace and host name."""
import os
import socket
import sys

import numpy as np

out, serial = sys.argv[1], "--serial" in sys.argv[2:]
if not serial:
    import tarantella as tnt
import keras  # noqa: E402 - after tarantella, as a user's script imports it

keras.config.set_floatx("float64")
keras.utils.set_random_seed(7)
model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(3)])
if not serial:
    model = tnt.Model(model)
rng = np.random.default_rng(1)
x, y = rng.normal(size=(40, 12)), rng.normal(size=(40, 3))
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
# a global batch of 8: two samples per rank on four ranks
model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
who = "serial" if serial else f"rank{tnt.get_rank()}"
np.savez(os.path.join(out, f"{who}.npz"), *model.get_weights())
if not serial:
    import tnt_core

    rt = tnt_core.init()  # the runtime tnt.Model started
    print(f"rank {rt.rank}/{rt.size} backend {rt.backend_spec.name} allreduce "
          f"{getattr(rt.backend, 'allreduce_transport', '-')} netns "
          f"{os.stat('/proc/self/ns/net').st_ino} host {socket.gethostname()}", flush=True)
