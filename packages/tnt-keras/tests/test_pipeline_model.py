"""``tnt.Model(model, parallel_strategy=PIPELINING or ALL, num_micro_batches=3)`` against plain
Keras running the same script (workers/pipeline_model_worker.py, on the gloo backend): fit
with shuffling and validation data, evaluate, predict and get_weights give the serial
History, results and weights on every rank, for 3 stages (a first, a middle and a last
stage) and for 2 pipelines of 2 stages (ALL: each pipeline trains on its half of every
batch); a lone pipeline of 2 stages would show nothing these do not. Both launches train
models whose gradients are sparse (workers/pipeline_sparse_worker.py), in float64 and
float32; the 3-stage launch with every schedule and with recomputation. It also resumes an
interrupted fit from BackupAndRestore (under ALL: test_elastic_fit's restarted pipelined
job) and trains what a pipeline routes between its stages, code
that runs alike in every pipeline of ALL: the graphs of workers/pipeline_graph_worker.py
(a residual connection across every cut, an input that enters the last partition, three
outputs in three partitions with their losses, loss_weights and metrics, and a Sequential
model cut automatically), a model of named inputs fed a dict, and batches of different
sequence lengths (workers/pipeline_bucket_worker.py). What is not supported is refused
with one line.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path

import keras
import numpy as np
import pytest
from pipeline_model_worker import EPOCHS
from pipeline_worker import build

import tarantella as tnt
from tnt_keras_helpers import PIPELINE_LAYOUTS as LAYOUTS
from tnt_keras_helpers import PIPELINE_ROUTING as ROUTING
from tnt_keras_helpers import PIPELINE_SPARSE_REFERENCE as SPARSE_REFERENCE

pytestmark = pytest.mark.timeout(600)

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def started(pipelined_model_runs) -> dict[str, tuple[int, int, Path, list[Future]]]:
    """Every layout's serial run and launch (conftest's ``pipelined_model_runs``: under way
    queued when the session's tests were collected)."""
    return pipelined_model_runs


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, started) -> tuple[int, int, Path]:
    ranks, stages, out, futures = started[request.param]
    for future in futures:
        future.result()
    return ranks, stages, out


def test_every_rank_gets_the_serial_history_results_and_weights(runs):
    ranks, partitions, out = runs
    assert len(list(out.glob("pipeline.rank*.json"))) == ranks
    ref = json.loads((out / "serial.rank0.json").read_text())
    ref_arrays = dict(np.load(out / "serial.rank0.npz"))
    local = []
    for rank in range(ranks):
        got = json.loads((out / f"pipeline.rank{rank}.json").read_text())
        arrays = dict(np.load(out / f"pipeline.rank{rank}.npz"))
        assert set(got["history"]) == {"loss", "mae", "val_loss", "val_mae"}
        for key, values in ref["history"].items():
            np.testing.assert_allclose(got["history"][key], values, rtol=TOLERANCE,
                                       err_msg=f"rank {rank}: History[{key!r}]")
        np.testing.assert_allclose(got["evaluate"], ref["evaluate"], rtol=TOLERANCE)
        assert set(arrays) == set(ref_arrays)
        for name, value in ref_arrays.items():
            rel = np.linalg.norm(arrays[name] - value) / np.linalg.norm(value)
            assert rel <= TOLERANCE, f"rank {rank}: {name} differs from serial by {rel:.2e}"
        assert got["count"] == ref["count"]
        # interrupted after 2 of 3 epochs, resumed by a new model from BackupAndRestore:
        # the weights of 3 uninterrupted serial epochs (Adam's state restored per stage)
        workflow = [n for n in ref_arrays if n.startswith("workflow_")]
        assert len(workflow) > 15, workflow
        for name in workflow:  # the other Keras calls (see keras_workflow in the worker)
            np.testing.assert_allclose(arrays[name], ref_arrays[name], rtol=1e-4, atol=1e-6,
                                       err_msg=f"rank {rank}: {name}")
        named = [n for n in ref_arrays if n.startswith("named")]
        assert bool(named) == (partitions == LAYOUTS[ROUTING][0]), "dict inputs: " + repr(named)
        for name in named:  # a model of two named inputs, fed a dict; use_ema's averages
            rel = np.linalg.norm(arrays[name] - ref_arrays[name]) / np.linalg.norm(ref_arrays[name])
            assert rel <= TOLERANCE, f"rank {rank}: dict inputs: {name} differs by {rel:.2e}"
        resumed = [n for n in ref_arrays if n.startswith("resumed")]  # on the routing layout
        assert len(resumed) == (len([n for n in ref_arrays if re.fullmatch(r"w\d+", n)])
                                if partitions == LAYOUTS[ROUTING][0] else 0), resumed
        for name in resumed:
            rel = np.linalg.norm(arrays[name] - ref_arrays[name]) / np.linalg.norm(ref_arrays[name])
            assert rel <= TOLERANCE, f"rank {rank}: resumed {name} differs from serial by {rel:.2e}"
        local.append(got["local_params"])
        refused = got["refused"]
        assert refused["export"].startswith("NotSupportedError: export(...) of a pipelined model")
        assert refused["legacy_h5"].startswith("NotSupportedError: save(") and \
            "legacy HDF5 format" in refused["legacy_h5"], refused["legacy_h5"]
        assert refused["micro_batch_size"].startswith("TypeError: fit(tnt_micro_batch_size=...)")
        assert refused["summed_loss"].startswith("NotSupportedError: compile(loss=...) with a "
                                                 "loss of reduction='sum' on a pipelined model")
        for name, message in {  # the checks of DATA's loops (test_arguments), as one line
                "batch_size": "ValueError: fit(batch_size=0): batch_size must be a positive integer",
                "cardinality": "DatasetError: fit(x=..., y=...): x and y have different numbers "
                               "of samples (x: 40, y: 5)",
                "callbacks": "TypeError: evaluate(callbacks=...): callbacks[0] is int 42",
                "strings": "TypeError: predict(x=...): x holds a NumPy array of strings",
                "unbatched": "DatasetError: fit(x=...): the tf.data.Dataset yields single samples",
                "different_batches": "CommError: the ranks of a pipelined model read different "
                                     "batches",
                "different_batch_sizes": "CommError: the ranks of a pipelined model read "
                                         "different batches",
                "different_batches_evaluate": "CommError: the ranks of a pipelined model read "
                                              "different batches",
                "batch_norm": "NotSupportedError: BatchNormalization layer 'bn' "
                              "(partition 0) would compute its statistics on each micro-batch",
        }.items():
            assert refused[name].startswith(message), refused[name]
        assert got["weights_kept_by_refusals"], f"rank {rank}: a refused fit changed the weights"
    pipelines = 2 if "pipeline 0 of 2" in json.loads((out / "pipeline.rank0.json").read_text())["repr"] else 1
    assert sum(local) == pipelines * ref["count"] and all(n < ref["count"] for n in local)
    assert (out / "w.weights.h5").exists()
    # the master-only CSVLogger wrote once, the epoch checkpoint the serial weights
    assert (out / "log.csv").read_text().count("\n") == 1 + EPOCHS
    restored = build(partitions)
    restored.load_weights(out / "epoch.weights.h5")
    for i, w in enumerate(restored.get_weights()):
        np.testing.assert_allclose(w, ref_arrays[f"w{i}"], rtol=1e-4, atol=1e-6)
    # model.save and the epoch checkpoint: one ordinary Keras file of the whole model, whose
    # optimizer holds every stage's state, as the serial file does
    serial = keras.models.load_model(out / "serial.keras")
    for saved in ("pipeline.keras", f"epoch{EPOCHS}.keras"):
        loaded = keras.models.load_model(out / saved)
        assert type(loaded) is type(serial) and loaded.count_params() == ref["count"]
        ours = {v.path: np.asarray(v) for v in loaded.optimizer.variables}
        theirs = {v.path: np.asarray(v) for v in serial.optimizer.variables}
        assert set(ours) == set(theirs) and len(ours) == 2 + len(serial.trainable_weights)
        for path, value in theirs.items():
            np.testing.assert_allclose(ours[path], value, rtol=1e-4, atol=1e-6, err_msg=f"{saved}: {path}")
        for a, b in zip(loaded.get_weights(), serial.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert ref["history"]["loss"][-1] < ref["history"]["loss"][0], "the model did not train"


def test_skips_late_inputs_several_outputs_and_automatic_cuts_train_as_serial(started):
    ranks, partitions, out, futures = started[ROUTING]
    for future in futures:
        future.result()
    ref = json.loads((out / "graph.serial.rank0.json").read_text())
    ref_arrays = dict(np.load(out / "graph.serial.rank0.npz"))
    assert set(ref) == {"skip", "late", "outputs", "sequential"}
    assert set(ref["outputs"]["history"]) == {
        "loss", "main_loss", "early_loss", "middle_loss", "main_mae", "middle_mse",
        *(f"val_{k}" for k in ("loss", "main_loss", "early_loss", "middle_loss", "main_mae",
                               "middle_mse"))}
    for rank in range(ranks):
        got = json.loads((out / f"graph.pipeline.rank{rank}.json").read_text())
        arrays = dict(np.load(out / f"graph.pipeline.rank{rank}.npz"))
        assert set(arrays) == set(ref_arrays)
        for case, expected in ref.items():
            assert set(got[case]["history"]) == set(expected["history"]), case
            for key, values in expected["history"].items():
                np.testing.assert_allclose(got[case]["history"][key], values, rtol=TOLERANCE,
                                           err_msg=f"rank {rank}: {case}: History[{key!r}]")
            assert set(got[case]["evaluate"]) == set(expected["evaluate"])
            for key, value in expected["evaluate"].items():
                np.testing.assert_allclose(got[case]["evaluate"][key], value, rtol=TOLERANCE,
                                           err_msg=f"rank {rank}: {case}: evaluate {key!r}")
        for name, value in ref_arrays.items():
            rel = np.linalg.norm(arrays[name] - value) / np.linalg.norm(value)
            assert rel <= TOLERANCE, f"rank {rank}: {name} differs from serial by {rel:.2e}"
    # the automatic cut: every stage holds a part of the Sequential model's parameters
    stages = [json.loads((out / f"graph.pipeline.rank{r}.json").read_text())["sequential"]
              ["local_params"] for r in range(partitions)]
    total = sum(int(np.prod(ref_arrays[n].shape)) for n in ref_arrays if n.startswith("sequential_w"))
    assert sum(stages) == total and all(0 < n < total for n in stages), stages
    for case in ref:
        assert ref[case]["history"]["loss"][-1] < ref[case]["history"]["loss"][0], case


def test_sparse_gradients_train_as_serial_with_adam_rmsprop_and_momentum(runs, started):
    """Embeddings and a custom tf.gather layer (gradients as tf.IndexedSlices) in the first,
    a middle and the last stage, cut automatically, 4 micro-batches: Adam and RMSprop treat
    a sparse gradient row by row, so the stages hand them the rows of every micro-batch (and
    of every pipeline, under ALL: there the second has no sample of the last batch), as
    serial Keras hands the batch's. Round-off only: float64 within 1e-12, float32 1e-5.
    Activation recomputation (on stages 0 and 2, under ZB-fused) changes no bit of the
    weights (of the same schedule's without it: the same ops on the same values). The
    schedules and recomputation run on 3 stages (``pipeline_sparse_worker.cases``)."""
    from pipeline_sparse_worker import CASES, cases

    ranks, stages, out = runs
    _, _, reference, futures = started[SPARSE_REFERENCE]
    futures[1].result()  # its serial run
    ref = dict(np.load(reference / "sparse.serial.rank0.npz"))
    assert len(ref) == len(CASES) * (1 + 11), sorted(ref)  # the losses, 11 weights
    strategy = next(s for st, s, r in LAYOUTS.values() if (st, r) == (stages, ranks))
    expected = {f"{n}_{d}_{s}" + ("_recompute" if r else "") for n, d, s, r in cases(strategy)}
    assert strategy == "pipelining" or len(expected) < len(CASES)
    for rank in range(ranks):
        got = dict(np.load(out / f"sparse.pipeline.rank{rank}.npz"))
        assert set(got) == {k for k in ref if k.rsplit("_", 1)[0] in expected}, sorted(got)
        if strategy == "pipelining":
            for i in range(11):
                assert np.array_equal(got[f"adam_float64_zb-fused_recompute_w{i}"],
                                      got[f"adam_float64_zb-fused_w{i}"]), f"rank {rank}: w{i}"
        for name in got:
            value = ref[name]
            tolerance = 1e-12 if "float64" in name else 1e-5
            assert got[name].dtype == value.dtype, name
            rel = np.linalg.norm(got[name] - value) / np.linalg.norm(value)
            assert rel <= tolerance, f"rank {rank}: {name} differs from serial by {rel:.2e}"
    for case in {n.rsplit("_", 1)[0] for n in ref}:
        losses = ref[f"{case}_loss"]
        assert losses[-1] < losses[0], f"{case} did not train: {losses}"


def test_batches_of_different_lengths_train_as_serial(started):
    """Sequence bucketing: a PyDataset of padded batches, each of its own length, through
    an Embedding (mask_zero), a cut and a GlobalAveragePooling1D that reads the mask: fit,
    evaluate and predict equal serial Keras in float64 (a step traced per length, the
    activations and the mask received at the batch's length)."""
    ranks, _, out, futures = started[ROUTING]
    for future in futures:
        future.result()
    ref = dict(np.load(out / "bucket.serial.rank0.npz"))
    assert {"loss", "evaluate", "predict", "w0"} <= set(ref) and ref["predict"].shape == (8, 1)
    for rank in range(ranks):
        got = dict(np.load(out / f"bucket.pipeline.rank{rank}.npz"))
        assert set(got) == set(ref)
        for name, value in ref.items():
            rel = np.linalg.norm(got[name] - value) / np.linalg.norm(value)
            assert rel <= 1e-12, f"rank {rank}: {name} differs from serial by {rel:.2e}"
    assert ref["loss"][-1] < ref["loss"][0], ref["loss"]


def test_a_model_built_without_values_trains_checkpoints_saves_and_loads_as_serial(runs):
    """stage_memory in the worker: built inside keras.StatelessScope(initialize_variables=
    False) on the pipelined ranks, as usual in the serial run (same seed); Adam; a
    ModelCheckpoint every 2 batches and one with save_best_only; then save and save_weights.
    Each rank initialised its own partition to serial's values, trained to serial's weights,
    and every file is the serial file; plain Keras loads the saved model with the weights
    get_weights() returned; each rank read only what it holds (a copy of the weights whose
    other values are NaN loads to the same weights and optimizer state)."""
    ranks, partitions, out = runs
    ref = dict(np.load(out / "serial.rank0.memory.npz"))
    names = [n for n in ref if n.startswith(("memory_initial", "memory_w", "memory_history_"))]
    assert any(n.startswith("memory_history_") for n in names) and len(names) > 10
    for rank in range(ranks):
        got = dict(np.load(out / f"pipeline.rank{rank}.memory.npz"))
        for name in names:
            rel = np.linalg.norm(got[name] - ref[name]) / max(np.linalg.norm(ref[name]), 1e-12)
            assert rel <= TOLERANCE, f"rank {rank}: {name} differs from serial by {rel:.2e}"
        assert got["memory_poisoned_loaded"].all(), f"rank {rank} read values it does not hold"
        # a rank holds its own partition's weights and optimizer slots, not all serial holds
        assert 0 < int(got["memory_held"][0]) < int(ref["memory_held"][0])
    mine = [np.load(out / "pipeline.rank0.memory.npz")[f"memory_w{i}"]
            for i in range(len([n for n in names if n.startswith("memory_w")]))]
    serial_files, files = out / "memory-serial", out / "memory-pipeline"
    for name in ("final.keras", "batch.keras"):
        loaded = keras.models.load_model(files / name)  # plain Keras reads what the master wrote
        theirs = keras.models.load_model(serial_files / name)
        if name == "final.keras":
            for a, b in zip(loaded.get_weights(), mine):
                np.testing.assert_array_equal(a, b)
        for a, b in zip(loaded.get_weights(), theirs.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name)
        # by position: each loaded optimizer gets a new name (adam_1, adam_2...) in this process
        assert len(loaded.optimizer.variables) == len(theirs.optimizer.variables) > 2, name
        for a, b in zip(loaded.optimizer.variables, theirs.optimizer.variables):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name}: {b.path}")
    every = sorted(p.name for p in files.glob("all.rank*.weights.h5"))  # tnt_save_all_devices
    assert every == [f"all.rank{r}.weights.h5" for r in range(ranks)], every
    for name in ("final.weights.h5", "best.weights.h5", *every):
        model, reference = build(partitions), build(partitions)
        model.load_weights(files / name)
        reference.load_weights(serial_files / ("final.weights.h5" if name.startswith("all.") else name))
        for a, b in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name)


def _cut_model() -> keras.Model:
    inp = keras.Input((4,))
    x = tnt.keras.layers.SplitLayer()(keras.layers.Dense(4)(inp))
    return keras.Model(inp, keras.layers.Dense(2)(x))


def test_the_rank_count_must_match_the_partitions():
    with pytest.raises(tnt.NotSupportedError, match=r"has 2 partitions \(1 cuts\), which need "
                       r"exactly 2 ranks; this job has 1"):
        tnt.Model(_cut_model(), parallel_strategy=tnt.ParallelStrategy.PIPELINING)


@pytest.mark.parametrize(("strategy", "size", "advice"), [
    # ALL cannot run 2 partitions on 3 ranks: it was suggested
    ("pipelining", 3, "has 3: run it with tnt run -n 2 (ParallelStrategy.PIPELINING: one pipeline), "
                      "or with -n 4, 6, ... and ParallelStrategy.ALL (several pipelines)"),
    ("pipelining", 4, "has 4: run it with tnt run -n 2, or keep 4 ranks with ParallelStrategy.ALL "
                      "(2 pipelines of 2)"),
    ("all", 3, "it has 3: run it with tnt run -n 2 (ParallelStrategy.PIPELINING: one pipeline), "
               "or with -n 4, 6, ... and ParallelStrategy.ALL (several pipelines)"),
], ids=["pipelining-3-ranks", "pipelining-4-ranks", "all-3-ranks"])
def test_a_wrong_rank_count_suggests_only_counts_that_work(monkeypatch, strategy, size, advice):
    """A model of 2 partitions in a job of ``size`` ranks (the runtime's size stands in)."""
    import tnt_core

    real = tnt_core.init()

    class Job:
        rank, backend = 0, real.backend

    Job.size = size
    monkeypatch.setattr(tnt_core, "init", lambda *a, **k: Job())
    with pytest.raises(tnt.NotSupportedError) as err:
        tnt.Model(_cut_model(), parallel_strategy=strategy)
    assert str(err.value).endswith(advice), str(err.value)


def test_pipelining_arguments_are_checked():
    inp = keras.Input((3,))
    uncut = keras.Model(inp, keras.layers.Dense(1)(inp))
    with pytest.raises(tnt.NotSupportedError, match=r"has no tnt\.keras\.layers\.SplitLayer"):
        tnt.Model(uncut, parallel_strategy="pipelining")
    with pytest.raises(tnt.NotSupportedError, match=r"nothing to pipeline; pass "
                       r"num_pipeline_stages=S \(the stages of each pipeline\)"):
        tnt.Model(uncut, parallel_strategy="all")
    with pytest.raises(ValueError, match=r"num_micro_batches=0\): .* a positive integer"):
        tnt.Model(_cut_model(), parallel_strategy="pipeline", num_micro_batches=0)
    with pytest.raises(TypeError, match="splits the batch of a pipeline"):
        tnt.Model(_cut_model(), num_micro_batches=4)
    with pytest.raises(tnt.PartitionError, match=r"has SplitLayers for 2 partitions \(1 cuts: "
                       r".*\), but num_pipeline_stages=3: the SplitLayers decide"):
        tnt.Model(_cut_model(), parallel_strategy="pipelining", num_pipeline_stages=3)
    with pytest.raises(ValueError, match=r"num_pipeline_stages=0\): the number of partitions"):
        tnt.Model(_cut_model(), parallel_strategy="pipelining", num_pipeline_stages=0)
    with pytest.raises(TypeError, match="cuts the model into a pipeline"):
        tnt.Model(_cut_model(), num_pipeline_stages=2)
    with pytest.raises(ValueError, match=r"pipeline_schedule='zb'\): the order of each stage's "
                       r"passes, one of '1f1b' \(the default\), 'zb-h1', 'zb-fused', 'gpipe'$"):
        tnt.Model(_cut_model(), parallel_strategy="pipelining", pipeline_schedule="zb")
    with pytest.raises(TypeError, match="orders the passes of a pipeline"):
        tnt.Model(_cut_model(), pipeline_schedule="zb-h1")
    with pytest.raises(ValueError, match=r"recompute='yes'\): whether a stage computes its forward "
                       r"pass again .*: True, False, or a list of one bool per partition$"):
        tnt.Model(_cut_model(), parallel_strategy="pipelining", recompute="yes")
    with pytest.raises(ValueError, match=r"recompute=\[True\]\): one bool per partition, and the "
                       r"model has 2 partitions$"):
        tnt.Model(_cut_model(), parallel_strategy="pipelining", recompute=[True])
    with pytest.raises(TypeError, match="recomputes the activations of a pipeline"):
        tnt.Model(_cut_model(), recompute=True)
    assert tnt.ParallelStrategy.DATA | tnt.ParallelStrategy.PIPELINING is tnt.ParallelStrategy.ALL
    with pytest.raises(tnt.NotSupportedError, match=r"ALL\): model .* has 2 partitions, so the "
                       r"job needs a multiple of 2 ranks \(one pipeline per 2\); it has 1"):
        tnt.Model(_cut_model(), parallel_strategy="all")


def test_a_stage_killed_mid_pipeline_ends_the_job_naming_it(tmp_path):
    """Rank 1 (the last stage) is SIGKILLed in epoch 2 while stage 0 waits for its
    gradients: tnt run ends the job within seconds, not at the 60 s collective timeout."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    import time

    from tnt_keras_helpers import WORKERS

    tnt = shutil.which("tnt", path=str(Path(sys.executable).parent))
    assert tnt, "the tnt command (tnt-cli) is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    proc = subprocess.run([tnt, "run", "-n", "2", "--timeout", "60", "--output-on-all-devices",
                           "--", str(WORKERS / "pipeline_kill_worker.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    ended = time.time()
    output = proc.stdout + proc.stderr
    killed = re.search(r"killing rank 1 at (\d+\.\d+)", output)
    assert killed, output[-4000:]
    assert proc.returncode == 137, output[-4000:]
    assert "tnt run: rank 1 on localhost failed: exited with code 137 (signal SIGKILL?)" in output
    assert ended - float(killed.group(1)) < 15, f"the job took {ended - float(killed.group(1)):.1f} s to end"
