"""A pipelined fit whose last stage is killed (SIGKILL) in the middle of epoch 2, while
stage 0 waits for its gradients: the job must end, naming that rank, well within the
collective timeout. Prints the moment of the kill for the test."""

from __future__ import annotations

import os
import signal
import sys
import time

import keras
from pipeline_worker import build, data


class KillLastStage(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        import tarantella as tnt

        if tnt.get_rank() == 1 and self.epoch == 1 and batch == 1:
            print(f"killing rank 1 at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


def main() -> int:
    import tarantella as tnt

    x, y = data()
    model = tnt.Model(build(2), parallel_strategy=tnt.ParallelStrategy.PIPELINING,
                      num_micro_batches=2)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=3, verbose=0,
              callbacks=[tnt.keras.callbacks.Callback(KillLastStage())])
    return 0


if __name__ == "__main__":
    sys.exit(main())
