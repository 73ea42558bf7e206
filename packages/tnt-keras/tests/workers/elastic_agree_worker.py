"""The agreement of an elastic job's ranks after a new communicator is bound
(``tarantella.data_parallel.elastic.ElasticLoop._agree``), on 2 ranks: ``<out>/rank<R>.json``.

A kill cannot place a rank one step ahead of another on purpose (its last collective must
complete on one rank and fail on the other), so the ranks are put there: rank 1 "finished"
one more operation (its weights, optimizer slots, metric states and logs are those after
it), rank 0 is in that operation. Rank 0 must take everything of rank 1's and count the
operation as done; rank 1 must redo its own. Then, both at the same number, nothing moves.
``test_elastic_fit.py`` reads the files.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import keras

    import tarantella as tnt
    from tarantella.data_parallel.elastic import ElasticLoop

    rank = tnt.get_rank()
    keras.utils.set_random_seed(5)
    model = tnt.Model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
                                        keras.layers.BatchNormalization()]))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x = np.arange(24, dtype="float32").reshape(8, 3) / 10
    model.fit(x, np.ones((8, 2), "float32"), batch_size=4, epochs=1, verbose=0)
    loop = ElasticLoop(model, model._tnt)

    def state() -> dict:
        return {"weights": [w.tolist() for w in model.get_weights()],
                "optimizer": [np.asarray(v).tolist() for v in model.optimizer.variables],
                "metrics": [np.asarray(v).tolist() for v in model.metrics_variables]}

    if rank == 1:  # one operation ahead: its own state after it, and its logs
        for v in [*model.weights, *model.optimizer.variables, *model.metrics_variables]:
            v.assign(np.asarray(v) + 7)
        loop.done, loop.last = 5, {"loss": np.float64(0.25), "mae": np.float64(0.5)}
    else:
        loop.done = 4
    ahead = state() if rank == 1 else None
    finished_for_me, _ = loop._agree("train")
    report = {"finished_for_me": finished_for_me, "done": loop.done, "state": state(),
              "ahead": ahead, "last": {k: float(v) for k, v in (loop.last or {}).items()}}
    report["again"], _ = loop._agree("train")  # the same number everywhere: a redo, nothing moves
    report["state_again"] = state()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
