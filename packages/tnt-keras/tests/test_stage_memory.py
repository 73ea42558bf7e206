"""The pieces of "models larger than one rank" that one process shows, against plain Keras:
a model built without values (``keras.StatelessScope(initialize_variables=False)``) under
DATA, the layout of the whole model's optimizer learnt without values, the ``.keras`` file
zipped from Keras' own directory format, values of any dtype on the wire, and a stage that
trained being freed with its model. The pipelined runs themselves are in
test_pipeline_model.py (one launch per layout).
"""

from __future__ import annotations

import gc
import weakref

import keras
import numpy as np
import pytest
from ml_dtypes import bfloat16

import tarantella as tnt
import tnt_core
from tarantella import _keras_compat
from tarantella.comm.wire import from_wire, to_wire, wire_buffer
from tarantella.pipeline import heap_release
from tarantella.pipeline import saving as stage_saving
from tarantella.pipeline.partition import partition
from tarantella.pipeline.stage import StageStep


def _net(seed: int = 4) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((5,))
    h = keras.layers.Dense(7, activation="tanh", name="hidden")(inp)
    h = keras.layers.Dropout(0.1, name="drop")(h)
    return keras.Model(inp, keras.layers.Dense(3, bias_initializer="random_normal", name="out")(h))


def test_under_data_a_model_built_without_values_gets_the_values_of_a_normal_build():
    expected = _net().get_weights()
    with tnt.deferred_build():
        model = _net()
    assert not any(_keras_compat.has_value(v) for v in model.variables)
    model = tnt.Model(model)
    for a, b in zip(model.get_weights(), expected):
        np.testing.assert_array_equal(a, b)
    with keras.StatelessScope():  # its exit initialises what waits: none of the model's
        pass
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 5), "float32"), np.ones((8, 3), "float32"), verbose=0)


def test_tnt_model_inside_the_scope_says_to_call_it_after():
    with keras.StatelessScope(initialize_variables=False):
        model = _net()
        with pytest.raises(tnt.NotSupportedError, match=r"inside keras\.StatelessScope: .* after "
                           r"the `with` block"):
            tnt.Model(model)


@pytest.mark.parametrize("optimizer", [
    keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1, momentum=0.9),
    keras.optimizers.AdamW(use_ema=True), keras.optimizers.RMSprop(gradient_accumulation_steps=2)],
    ids=lambda o: type(o).__name__)
def test_the_whole_optimizers_layout_is_learnt_without_values(optimizer):
    with tnt.deferred_build():
        model = _net()
    paths = stage_saving.whole_optimizer_paths(optimizer, list(model.trainable_variables))
    assert not any(_keras_compat.has_value(v) for v in model.variables), "a value was made"
    _keras_compat.forget_uninitialized(list(model.variables))
    serial = _net()
    serial.compile(optimizer=type(optimizer).from_config(optimizer.get_config()), loss="mse")
    serial.optimizer.build(serial.trainable_variables)
    assert paths == [v.path for v in serial.optimizer.variables]


def test_an_optimizer_whose_variables_share_paths_is_refused():
    with tnt.deferred_build():
        model = _net()
    with pytest.raises(tnt.NotSupportedError, match=r"Adafactor with a pipelined model: several "
                       r"of its variables share a path \('adafactor/kernel'\)"):
        stage_saving.whole_optimizer_paths(keras.optimizers.Adafactor(), list(model.trainable_variables))
    _keras_compat.forget_uninitialized(list(model.variables))


def test_a_keras_file_zipped_from_the_directory_format_loads_in_plain_keras(tmp_path):
    model = _net()
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 5), "float32"), np.ones((8, 3), "float32"), verbose=0)
    path = str(tmp_path / "m.keras")
    stage_saving.zip_directory(lambda folder: model.save(folder, zipped=False), path)
    assert [p.name for p in tmp_path.iterdir()] == ["m.keras"]  # the directory is gone
    loaded = keras.saving.load_model(path)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", ["float32", "int64", bfloat16, "int8", "bool"], ids=str)
def test_values_of_any_dtype_cross_the_wire(dtype):
    value = (np.arange(7 * 3) % 5 - 2).reshape(7, 3).astype(dtype)
    wire = to_wire(value)
    assert wire.dtype in (np.float32, np.int64, np.int32)
    buf = wire_buffer(value.shape, value.dtype)
    assert buf.shape == wire.shape and buf.dtype == wire.dtype
    buf[...] = wire
    back = from_wire(buf, value.shape, value.dtype)
    assert back.dtype == value.dtype
    np.testing.assert_array_equal(back, value)


def test_a_stage_that_trained_is_freed_with_its_model():
    """A deleted model's stage gives its memory back, so that a model made after it (one
    that resumes from a backup in the same process) can reuse it: no process-wide registry
    of TensorFlow keeps the traced step, and through its captures every weight and
    optimizer slot, alive (Keras' optimizer traced in a replica context registered one)."""
    model = _net()
    step = StageStep(partition(model), 0, tnt_core.LocalBackend(tnt_core.Config()),
                     loss=keras.losses.MeanSquaredError(), optimizer=keras.optimizers.Adam(),
                     num_micro_batches=2)
    step.train(np.ones((8, 5), "float32"), np.ones((8, 3), "float32"))
    assert step.optimizer.iterations.numpy() == 1
    held = {v.path: weakref.ref(v.value.handle) for v in [*step.weights, *step.optimizer.variables]}
    del model, step
    gc.collect()
    assert [path for path, handle in held.items() if handle() is not None] == []


class _ScriptedWriter:
    """The writer's side of a stage's saving messages: its requests, scripted; what the stage
    sends, recorded. A stage's receives are blocking, so every send it makes is one it made
    before its next request arrived."""

    def __init__(self, requests: list[tuple[int, int]]) -> None:
        self.requests = [np.array(r, np.int64) for r in requests]
        self.sent: list[tuple[int, np.ndarray]] = []

    class _Done:
        def __init__(self, buf: np.ndarray) -> None:
            self.buf = buf

        def wait(self) -> np.ndarray:
            return self.buf

    def send_async(self, buf, dest, tag=0):
        self.sent.append((tag, buf.copy()))
        return self._Done(buf)

    def recv_async(self, buf, src, tag=0):
        buf[...] = self.requests.pop(0)
        return self._Done(buf)


def test_a_stage_sends_an_optimizer_variable_only_when_the_writer_asks_for_it():
    """The backend holds a message that arrives before its receive is posted: a stage that
    sent its optimizer state ahead made the writer hold it (up to ~240 MB measured)."""
    model = _net()
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    k = 3
    writer = _ScriptedWriter([(stage_saving.OPTIMIZER, 0), (stage_saving.OPTIMIZER_VARIABLE, k),
                              (stage_saving.END, 0)])
    server = stage_saving.StageSaving(writer, rank=1, stages=2, ownership=None)
    assert server.serve(model, writer=0) is False
    layout = writer.sent[:2]  # the word count, then the paths, dtypes and shapes
    values = writer.sent[2:]
    assert len(layout) == 2 and [len(values)] == [1], "one value, the one asked for"
    tag, value = values[0]
    assert tag == stage_saving._VALUE
    np.testing.assert_array_equal(value, np.asarray(model.optimizer.variables[k]).reshape(-1))


def test_heap_release_trims_once_per_budget_and_not_when_nothing_streamed(monkeypatch):
    assert isinstance(heap_release.trim(), bool)  # glibc: a real trim; elsewhere: nothing
    trims = []
    monkeypatch.setattr(heap_release, "trim", lambda: trims.append(1))
    release = heap_release.HeapRelease(every=100)
    release.done()
    assert trims == [], "a hook with nothing streamed does not trim"
    for _ in range(7):
        release.streamed(40)
    assert len(trims) == 2 and release.pending == 40  # at 120 and at 240 bytes streamed
    release.done()
    assert len(trims) == 3 and release.pending == 0
