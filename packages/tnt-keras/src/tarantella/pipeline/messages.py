"""A pipeline stage's messages to its neighbours, as ops of the stage's compiled step.

Why graph ops: a stage's whole step (every micro-batch's forward and backward pass, the
gradient sum, the optimizer) is one ``tf.function`` (:class:`tarantella.pipeline.stage.StageStep`),
so activations and gradients must leave and arrive inside the graph. The messages are
chained with control dependencies, each after the one before it in the step as written,
so they run in the schedule's order: two neighbours, following the same schedule, post
matching sends and receives, and a receive never holds a thread while a send its peer
waits for is still to be posted. The compute between them runs as the dataflow allows.
The chain is the channel's (:mod:`tarantella.comm`), the one every collective of the graph
is on.

Two paths, one interface:

- native (the channel's communicator offers point-to-point in its hand-off table,
  :meth:`tarantella.comm.Channel.point_to_point`): the op library's send and receive
  kernels, no Python and no GIL;
- Python (any other backend with point-to-point): each op is a ``tf.numpy_function`` that
  posts the backend's ``send_async`` (keeping the buffer alive until :meth:`complete`) or
  waits on its ``recv_async``; the GIL is held only while a message is posted or handed
  over. TensorFlow keeps every ``numpy_function`` traced inside a ``tf.function`` for the
  rest of the process (on its global graph), so these functions capture what they use (the
  channel's link to its communicator) and never this object, which holds the traced graph's
  tensors (and through the graph, every weight of the stage).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import tnt_core

from ..comm import Channel, count, previous, record

__all__ = ["StageMessages"]


class _Waits:
    """Seconds the Python path's receives and send completions spent blocked: the one
    thing its ops update, shared with them without sharing the :class:`StageMessages`."""

    def __init__(self) -> None:
        self.seconds = 0.0


class StageMessages:
    """Sends and receives between the stages of one pipeline, as graph ops.

    :param channel: the pipeline's channel (point-to-point); its native sends and receives
        are used where it offers them.
    :param ranks: the communicator rank of each stage.
    """

    def __init__(self, channel: Channel, ranks: Sequence[int], *,
                 timeline: tnt_core.Timeline | None = None, lane: str = "") -> None:
        self.channel = channel
        self.ranks = list(ranks)
        self.native = channel.point_to_point()
        self._tokens: list[tf.Tensor] = []
        self.timeline, self.lane = timeline, lane
        self._waits = _Waits()
        self._starts: dict[str, float] = {}
        #: sends posted in the current step, with their buffers, until :meth:`complete`
        self._pending: list[tuple[tnt_core.Handle, np.ndarray]] = []

    @property
    def waited(self) -> float:
        """Seconds receives and the wait for the step's sends have spent blocked since
        made (what the pipeline benchmark reads; on the native path the op library counts
        them)."""
        return self._waits.seconds + (self.native.waited if self.native is not None else 0.0)

    def begin(self) -> None:
        """A new graph is being traced (its chain starts with it): no send pending yet."""
        self._tokens = []

    @staticmethod
    def _in_order(make: Any, *, message: bool = True) -> tf.Tensor:
        """The op ``make()`` builds, after the graph's previous collective or message (see the
        module doc); counted on the channel when it is a ``message`` (not a timeline mark)."""
        with tf.control_dependencies(previous()):
            out = make()
        if message:
            count(out)
        record([out])
        return out

    def send(self, tensor: tf.Tensor, stage: int, tag: int) -> tf.Tensor:
        """Graph op: post ``tensor`` to ``stage`` (returns at once; a token)."""
        if self.native is not None:
            token = self._in_order(lambda: self.native.send(tensor, self.ranks[stage], tag))
            self._tokens.append(token)
            return token
        return self._in_order(lambda: self._post(tensor, stage, tag))

    def _post(self, tensor: tf.Tensor, stage: int, tag: int) -> tf.Tensor:
        link, peer, pending = self.channel.link, self.ranks[stage], self._pending

        def post(array: np.ndarray) -> np.int64:
            buf = np.ascontiguousarray(array)
            pending.append((link.backend.send_async(buf, peer, tag), buf))
            return np.int64(0)

        return tf.numpy_function(post, [tensor], tf.int64, stateful=True,
                                 name=f"tnt_send_{stage}_{tag}")

    def receive(self, shape: Sequence[int], dtype: tf.DType, stage: int, tag: int) -> tf.Tensor:
        """Graph op: the tensor of ``shape`` and ``dtype`` that ``stage`` sends with ``tag``."""
        shape = tuple(int(d) for d in shape)
        if self.native is None:
            return self._in_order(lambda: self._wait(shape, dtype, stage, tag))
        what = "receive activations" if tag % 2 == 0 else "receive gradients"
        if self.timeline is not None:
            self._in_order(lambda: self.mark([], what, begin=True, lane=f"{self.lane}: waits"),
                           message=False)
        out = self._in_order(lambda: self.native.recv(shape, dtype, self.ranks[stage], tag))
        if self.timeline is not None:
            self._in_order(lambda: self.mark([out], what, begin=False, lane=f"{self.lane}: waits"),
                           message=False)
        return out

    def _wait(self, shape: tuple[int, ...], dtype: tf.DType, stage: int, tag: int) -> tf.Tensor:
        link, peer, waits = self.channel.link, self.ranks[stage], self._waits
        timeline, lane = self.timeline, f"{self.lane}: waits"
        np_dtype = tf.as_dtype(dtype).as_numpy_dtype
        what = "receive activations" if tag % 2 == 0 else "receive gradients"

        def wait() -> np.ndarray:
            start = time.perf_counter()
            out = np.asarray(link.backend.recv_async(np.empty(shape, np_dtype), peer, tag).wait())
            end = time.perf_counter()
            waits.seconds += end - start
            if timeline is not None:
                timeline.complete(what, lane, start, end)
            return out

        out = tf.numpy_function(wait, [], tf.as_dtype(dtype), stateful=True,
                                name=f"tnt_receive_{stage}_{tag}")
        out.set_shape(shape)
        return out

    def mark(self, after: Sequence[tf.Tensor], name: str, begin: bool,
             lane: str | None = None) -> tf.Tensor:
        """Graph op, after ``after``: the beginning (``begin``) or the end of span ``name``
        on this stage's timeline lane (traced only with a timeline)."""
        assert self.timeline is not None
        timeline, starts = self.timeline, self._starts
        lane = self.lane if lane is None else lane

        def run(*_after: Any) -> np.int64:
            now = time.perf_counter()
            if begin:
                starts[name] = now
            else:
                timeline.complete(name, lane, starts.pop(name, now), now)
            return np.int64(0)

        with tf.control_dependencies(list(after)):
            return tf.numpy_function(run, [], tf.int64, stateful=True, name="tnt_timeline_mark")

    def allreduce_sum(self, value: tf.Tensor) -> tf.Tensor:
        """Graph op: the sum over the pipeline's stages of the float64 scalar ``value``
        (in the messages' program order, so no stage waits for it out of turn)."""
        link = self.channel.link

        def run(v: np.ndarray) -> np.ndarray:
            return np.asarray(link.backend.allreduce(np.array([v], np.float64))[0], np.float64)

        def make() -> tf.Tensor:
            out = tf.numpy_function(run, [value], tf.float64, stateful=True,
                                    name="tnt_stages_sum")
            out.set_shape(())
            return out

        return self._in_order(make)

    def complete(self, after: Sequence[tf.Tensor]) -> tf.Tensor:
        """Graph op, after ``after``: every send of the step has left (its buffer is free)."""
        if self.native is not None:
            with tf.control_dependencies(list(after)):
                return self._in_order(lambda: self.native.wait(self._tokens))
        pending, waits = self._pending, self._waits

        def wait(*_after: Any) -> np.int64:
            handles = [h for h, _ in pending]
            pending.clear()
            start = time.perf_counter()
            tnt_core.wait_all(handles)
            waits.seconds += time.perf_counter() - start
            return np.int64(0)

        return self._in_order(lambda: tf.numpy_function(wait, list(after), tf.int64,
                                                        stateful=True, name="tnt_sends_complete"))
