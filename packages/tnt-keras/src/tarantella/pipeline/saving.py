"""Saving and loading a pipelined model in Keras' own formats, with no rank holding it whole.

Why this design: each rank holds only its own partition (:mod:`tarantella.pipeline.variables`),
yet a saved file must be the one serial Keras writes, which plain ``keras.saving.load_model``
and ``load_weights`` read. So the writing rank runs Keras' own saver (``.keras``,
``.weights.h5``, sharded ``.weights.json``), and when Keras asks a layer of another partition
for its variables (``save_own_variables``, one layer at a time), the writer fetches that
layer's values point-to-point from the stage that holds them and lets the layer's own method
write them (they stand in for the variables through ``keras.StatelessScope``'s state
mapping, so layers with their own saving, e.g. quantized ones, save as in Keras). At most one
layer of another partition is in flight. The optimizer is saved the same way: Keras keys its
variables by their position in an optimizer built over every trainable weight; the writer
learns those positions from a copy built over value-less stand-ins (no memory) and writes each
stage's variables, received one at a time, under the position of its path.

Keras' zipped ``.keras`` writer keeps the whole weights file in a ``BytesIO`` before zipping
it (``saving_lib._save_model_to_fileobj``, when memory looks sufficient): the writer would
then hold the whole model after all. A ``.keras`` file is therefore written as Keras writes a
model to a directory (``zipped=False``: the weights file streamed to disk), next to the
target, then zipped into the ``.keras`` file entry by entry (stored, as Keras stores them).

Loading runs Keras' own ``load_weights`` with the other partitions' layers skipped (their
datasets are not read) and the optimizer reading only the positions of this stage's own
variables.

The protocol (tags of their own, apart from the pipeline's): the writer sends a stage a
request (``LAYER j``: the variables the ``j``-th layer saves; ``OPTIMIZER``: the path, dtype
and shape of each of its optimizer variables; ``OPTIMIZER_VARIABLE k``: the value of the
``k``-th) or ``END`` (with a flag: the writer failed). Every value is sent on request: a
message that arrives before its receive is posted is held by the backend in memory of its
own, so a stage that sent its whole optimizer state at once made the writer hold as much of
it as had arrived before it was written (docs/pipelining_results.md). A stage serves
requests until ``END``: during a collective save, and during each hook of a master-only
callback that may save (``PipelinedState.master_writes``), so ``ModelCheckpoint`` and
``BackupAndRestore`` save at any ``save_freq`` and only the master writes files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tnt_core

from .. import files
from .._keras_compat import all_layers, own_variables
from ..comm import Channel
from ..comm.wire import from_wire, to_wire, wire_buffer
from ..errors import NotSupportedError
from ..reporting.user_frames import user_stacklevel
from ..seams.overrides import instance_attributes
from .heap_release import HeapRelease
from .variables import Ownership

__all__ = ["StageSaving", "gather_weights", "whole_optimizer_paths", "zip_directory"]

#: tags of the saving messages (the pipeline's are 0, 1, ...)
_REQUEST, _VALUE = 30011, 30012
LAYER, OPTIMIZER, END, OPTIMIZER_VARIABLE = 1, 2, 3, 4


def _numpy_dtype(variable: Any) -> np.dtype:
    return np.dtype(tf.as_dtype(variable.dtype).as_numpy_dtype)


def _value(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable))


def _nbytes(variables: list[Any]) -> int:
    """The bytes of ``variables``' values (what a copy of them takes)."""
    return sum(int(np.prod(v.shape, dtype=np.int64)) * _numpy_dtype(v).itemsize for v in variables)


# -- the whole optimizer's layout ---------------------------------------------------------------

def _stand_in(variable: Any) -> keras.Variable:
    """A variable of ``variable``'s shape, dtype, name and path (made in a graph: no value)."""
    *scopes, name = variable.path.split("/")
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(keras.name_scope(scope))
        return keras.Variable(initializer="zeros", shape=tuple(variable.shape), dtype=variable.dtype,
                              trainable=True, name=name)


def whole_optimizer_paths(optimizer: keras.optimizers.Optimizer, trainable: list[Any]) -> list[str]:
    """The paths of the variables of an optimizer configured as ``optimizer`` and built
    over ``trainable`` (every trainable weight of the model, in order), in the order Keras
    saves them: what serial Keras' optimizer holds. Built in a graph, over stand-ins of the
    same shapes, dtypes, names and paths, so that no value is made or read. An optimizer
    whose variables share a path (Adafactor names its slots after the weight's name alone)
    is refused: a stage's variable could not be told apart from another stage's."""
    config = optimizer.get_config()  # eagerly: it reads the learning rate's value
    with tf.Graph().as_default():
        whole = type(optimizer).from_config(config)
        whole.build([_stand_in(v) for v in trainable])
        paths = [v.path for v in whole.variables]
    if len(set(paths)) != len(paths):
        shared = sorted({p for p in paths if paths.count(p) > 1})
        raise NotSupportedError(
            f"{type(optimizer).__name__} with a pipelined model: several of its variables share "
            f"a path ({shared[0]!r}), so a stage's state cannot be saved or loaded in its place; "
            "use an optimizer that names its slots after each weight's path (Adam, AdamW, SGD, "
            "RMSprop, ...)")
    return paths


# -- the explicit gather ---------------------------------------------------------------------------

def gather_weights(channel: Channel, weights: list[Any], owners: tuple[int, ...],
                   stage: int) -> list[np.ndarray]:
    """Every weight's value on every rank of ``channel`` (a pipeline: rank ``p`` is stage
    ``p``), each from its owner (the channel's broadcast: one per owner and wire dtype)."""
    sent = [to_wire(_value(w)) if owner == stage else wire_buffer(tuple(w.shape), _numpy_dtype(w))
            for w, owner in zip(weights, owners)]
    received = channel.broadcast_arrays(sent, list(owners))
    return [from_wire(buf, tuple(w.shape), _numpy_dtype(w)) for buf, w in zip(received, weights)]


# -- .keras: a directory zipped entry by entry --------------------------------------------------

def zip_directory(write_directory: Callable[[str], None], path: str) -> None:
    """Run ``write_directory(d)`` (Keras writing a model unzipped) for a new directory
    ``d`` next to ``path``, then store its files into the zip archive ``path``, streamed."""
    folder = tempfile.mkdtemp(prefix=".tnt-unzipped-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        target = os.path.join(folder, "model")
        write_directory(target)
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
            for root, _, names in sorted(os.walk(target)):
                for name in sorted(names):
                    full = os.path.join(root, name)
                    archive.write(full, os.path.relpath(full, target).replace(os.sep, "/"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- the writer and the stages that serve it ---------------------------------------------------

class StageSaving:
    """Save and load of one pipelined model on this rank (see the module doc).

    :param backend: the job's communicator (ranks are global: rank ``r`` is stage
        ``r % stages`` of pipeline ``r // stages``).
    :param ownership: which stage holds each weight and each layer's variables.
    """

    def __init__(self, backend: tnt_core.CommBackend, rank: int, stages: int,
                 ownership: Ownership) -> None:
        self.backend, self.rank, self.stages = backend, rank, stages
        self.ownership = ownership
        #: on the master: inside a master-only callback's hook whose stages serve its saves
        self.serving = False
        #: the transient copies of streamed values go back to the OS (:mod:`.heap_release`)
        self.release = HeapRelease()

    def peers(self, writer: int) -> list[int]:
        """The ranks that serve ``writer``: the other stages of its pipeline."""
        base = writer // self.stages * self.stages
        return [base + s for s in range(self.stages) if base + s != writer]

    # -- messages -------------------------------------------------------------------------------

    def _send(self, array: np.ndarray, dest: int, tag: int) -> None:
        self.backend.send_async(array, dest, tag).wait()

    def _receive(self, buf: np.ndarray, src: int, tag: int) -> np.ndarray:
        return self.backend.recv_async(buf, src, tag).wait()

    def _request(self, dest: int, kind: int, arg: int = 0) -> None:
        self._send(np.array([kind, arg], np.int64), dest, _REQUEST)

    def end(self, servers: list[int], failed: bool = False) -> None:
        """Tell ``servers`` that this writer is done (``failed``: its write raised)."""
        for dest in servers:
            self._request(dest, END, int(failed))

    def _send_words(self, obj: Any, dest: int) -> None:
        data = json.dumps(obj).encode()
        words = np.frombuffer(data + b" " * (-len(data) % 4), np.int32).copy()
        self._send(np.array([words.size], np.int64), dest, _VALUE)
        self._send(words, dest, _VALUE)

    def _receive_words(self, src: int) -> Any:
        count = self._receive(np.zeros(1, np.int64), src, _VALUE)
        words = self._receive(np.zeros(int(count[0]), np.int32), src, _VALUE)
        return json.loads(words.tobytes().decode().rstrip())

    # -- a stage that serves ------------------------------------------------------------------

    def serve(self, model: keras.Model, writer: int) -> bool:
        """Give ``writer`` what it asks for from this rank's partition until it sends
        ``END``; returns whether the writer failed."""
        layers: list[Any] | None = None
        variables: list[Any] = []
        while True:
            kind, arg = (int(a) for a in self._receive(np.zeros(2, np.int64), writer, _REQUEST))
            if kind == END:
                self.release.done()
                return bool(arg)
            if kind == LAYER:
                layers = layers if layers is not None else all_layers(model)
                for v in own_variables(layers[arg]):
                    self._send(to_wire(_value(v)), writer, _VALUE)
                self.release.streamed(_nbytes(own_variables(layers[arg])))
            elif kind == OPTIMIZER:
                optimizer = getattr(model, "optimizer", None)
                variables = list(optimizer.variables) if optimizer is not None and optimizer.built else []
                self._send_words([[v.path, _numpy_dtype(v).str, list(v.shape)] for v in variables],
                                 writer)
            elif kind == OPTIMIZER_VARIABLE:  # one at a time: one variable's copy in flight
                self._send(to_wire(_value(variables[arg])), writer, _VALUE)
                self.release.streamed(_nbytes([variables[arg]]))
            else:
                raise tnt_core.CommError(f"rank {self.rank}: saving request {kind} from rank "
                                         f"{writer} is not one of this protocol's")

    # -- the writer ------------------------------------------------------------------------------

    def _owner_rank(self, stage: int) -> int:
        return self.rank // self.stages * self.stages + stage

    def _save_layer(self, layer: Any, index: int, owner: int, store: Any) -> None:
        """``layer.save_own_variables(store)`` with the values of the stage that holds them."""
        variables = own_variables(layer)
        self._request(owner, LAYER, index)
        values = [from_wire(self._receive(wire_buffer(tuple(v.shape), _numpy_dtype(v)), owner, _VALUE),
                            tuple(v.shape), _numpy_dtype(v)) for v in variables]
        with keras.StatelessScope(state_mapping=list(zip(variables, values)),
                                  initialize_variables=False):
            type(layer).save_own_variables(layer, store)
        del values
        self.release.streamed(2 * _nbytes(variables))  # received, and Keras' copy to write

    def _save_own_layer(self, layer: Any, store: Any) -> None:
        """``layer.save_own_variables(store)`` of this partition's layer, counted."""
        type(layer).save_own_variables(layer, store)
        self.release.streamed(_nbytes(own_variables(layer)))

    def _save_optimizer(self, model: keras.Model, optimizer: Any, store: Any) -> None:
        """The optimizer state of every stage, at the positions serial Keras saves it."""
        paths = whole_optimizer_paths(optimizer, list(model.trainable_variables))
        position = {path: i for i, path in enumerate(paths)}
        written: set[int] = set()

        def put(path: str, value: Any) -> None:
            i = position.get(path)
            if i is None:
                raise tnt_core.CommError(f"optimizer variable {path!r} of a stage is not one of "
                                         "the whole model's optimizer variables")
            if i not in written:  # the iteration count and learning rate: every stage has them
                store[str(i)] = value
                written.add(i)
                self.release.streamed(value.nbytes if isinstance(value, np.ndarray) else _nbytes([value]))

        for v in optimizer.variables:
            put(v.path, v)
        for stage in range(self.stages):
            owner = self._owner_rank(stage)
            if owner == self.rank:
                continue
            self._request(owner, OPTIMIZER)
            for k, (path, dtype, shape) in enumerate(self._receive_words(owner)):
                self._request(owner, OPTIMIZER_VARIABLE, k)
                buf = self._receive(wire_buffer(tuple(shape), dtype), owner, _VALUE)
                put(path, from_wire(buf, tuple(shape), dtype))
        missing = [paths[i] for i in range(len(paths)) if i not in written]
        if missing:
            raise tnt_core.CommError(f"no stage holds optimizer variables {missing[:3]}")

    @contextlib.contextmanager
    def _serving(self, model: keras.Model, overrides: list[tuple[object, str, Any]], method: str,
                 optimizer_handler: Any) -> Iterator[None]:
        """``overrides`` in place, plus the model's built optimizer's ``method`` handled by
        ``optimizer_handler(model, optimizer, store)``, while Keras saves or loads; then what
        the stream left on the heap goes back to the OS."""
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            overrides = [*overrides, (optimizer, method,
                                      functools.partial(optimizer_handler, model, optimizer))]
        try:
            with instance_attributes(overrides):
                yield
        finally:
            self.release.done()

    @contextlib.contextmanager
    def writing(self, model: keras.Model) -> Iterator[None]:
        """While Keras saves ``model`` on this rank: the other partitions' layers and the
        optimizer save what the stages that hold them send."""
        overrides: list[tuple[object, str, Any]] = []
        own = self.ownership
        for j, layer in enumerate(all_layers(model)):
            owner = own.layers[j]
            if owner >= 0 and owner != own.stage:
                overrides.append((layer, "save_own_variables",
                                  functools.partial(self._save_layer, layer, j, self._owner_rank(owner))))
            elif owner == own.stage:
                overrides.append((layer, "save_own_variables",
                                  functools.partial(self._save_own_layer, layer)))
        with self._serving(model, overrides, "save_own_variables", self._save_optimizer):
            yield

    # -- loading ---------------------------------------------------------------------------------

    def _load_optimizer(self, model: keras.Model, optimizer: Any, store: Any) -> None:
        """This stage's optimizer variables from their positions in the whole optimizer's
        saved state; the other positions are not read."""
        paths = whole_optimizer_paths(optimizer, list(model.trainable_variables))
        if len(store.keys()) != len(paths):  # what Keras does with a mismatched optimizer
            warnings.warn(f"Skipping variable loading for optimizer '{optimizer.name}', because "
                          f"the model's optimizer has {len(paths)} variables whereas the saved "
                          f"optimizer has {len(store.keys())} variables.",
                          stacklevel=user_stacklevel())
            return
        position = {path: i for i, path in enumerate(paths)}
        for v in optimizer.variables:
            if v.path not in position:
                raise NotSupportedError(f"optimizer variable {v.path!r} is not one of the whole "
                                        "model's optimizer variables")
            v.assign(store[str(position[v.path])])
            self.release.streamed(_nbytes([v]))

    def _load_own_layer(self, layer: Any, store: Any) -> None:
        """``layer.load_own_variables(store)`` of this partition's layer, counted."""
        type(layer).load_own_variables(layer, store)
        self.release.streamed(_nbytes(own_variables(layer)))

    @contextlib.contextmanager
    def reading(self, model: keras.Model) -> Iterator[None]:
        """While Keras loads weights into ``model`` on this rank: only this partition's
        layers and this stage's optimizer variables read the file."""
        own = self.ownership
        overrides: list[tuple[object, str, Any]] = [
            (layer, "load_own_variables",
             functools.partial(self._load_own_layer, layer) if own.layers[j] == own.stage else _skip)
            for j, layer in enumerate(all_layers(model)) if own.layers[j] != -1]
        with self._serving(model, overrides, "load_own_variables", self._load_optimizer):
            yield

    # -- a collective write ------------------------------------------------------------------

    def write_collectively(self, model: keras.Model, write: Callable[[str], None], filepath: Any,
                           *, overwrite: bool, all_devices: bool, runtime: tnt_core.Runtime) -> None:
        """``write(path)`` (Keras saving ``model``), atomically, on the master (every rank
        with ``all_devices``, one after another) while the other stages of the writer's
        pipeline serve it; every rank returns when the file is complete. In a master-only
        callback's hook, the master writes alone, served by the stages that wait in that
        hook."""
        path = os.fspath(filepath)

        def attempt() -> BaseException | None:
            with self.writing(model):
                return files.attempt_write(write, path, overwrite=overwrite)

        if files.writes_locally():
            if not self.serving:
                raise NotSupportedError(
                    "saving a pipelined model on one rank alone: every stage holds a part of it. "
                    "Save on every rank (model.save(...) is a collective), or from a callback "
                    "wrapped with tnt.keras.callbacks.Callback(..., run_on_all_ranks=False)")
            alone = attempt()
            if alone is not None:
                raise alone
            return
        error: BaseException | None = None
        for writer in (range(runtime.size) if all_devices else [tnt_core.get_master_rank()]):
            if writer == self.rank:
                failed = True
                try:
                    error = attempt() or error
                    failed = error is not None
                finally:
                    self.end(self.peers(writer), failed)
            elif self.rank in self.peers(writer):
                self.serve(model, writer)
        files.agree(runtime, error, path)


def _skip(store: Any) -> None:
    """A layer of another partition: its datasets stay unread."""
