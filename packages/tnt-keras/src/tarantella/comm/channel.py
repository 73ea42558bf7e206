"""The channel: the one way tarantella's graph ops and host code reach a communicator.

Why one: a collective traced into a step must go out in the same order on every rank, must
take the native or the Python path by one rule, and must reach the communicator that is
current when it runs. Kept in one object, a new communicator (another set of ranks after a
membership change, a fresh one after a failure) is bound to a built model in one place:
:meth:`Channel.bind`.

What goes through it:

* **order**: every collective traced into a graph waits for the one traced before it in
  that graph (:mod:`tarantella.comm.order`), whatever order TensorFlow's executor would
  pick.
* **the path**: :meth:`Channel.native_reason` and :meth:`Channel.point_to_point` are the only
  places that decide between the op library (no Python in the step) and ``numpy_function``.
* **the communicator**: Python-path ops reach it through :attr:`Channel.link`, an object
  holding nothing but the current backend, so that a ``numpy_function`` (which TensorFlow
  keeps for the rest of the process) never holds a graph, and a rebind reaches it.
* **the count**: every graph op that reaches a communicator is recorded on its graph
  (:func:`tarantella.comm.order.traced_collectives`), so a test can hold the traced graphs
  against the channel.
* **the host side**: :meth:`Channel.broadcast_arrays`, the one host-side broadcast of many
  arrays (one message per dtype).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import tnt_core

from . import native as native_ops
from . import order
from .wire import from_wire, to_wire

__all__ = ["Channel", "Link", "world"]

class Link:
    """What a Python-path op needs at run time: the channel's current communicator.

    Held by the ops' functions instead of the channel: it keeps no graph and no tensor."""

    __slots__ = ("backend",)

    def __init__(self, backend: tnt_core.CommBackend) -> None:
        self.backend = backend


class Channel:
    """The collectives of one communicator: the job's (:func:`world`) or a group's
    (:meth:`split`).

    :param runtime: the rank's runtime (configuration: timeouts, native ops, fusion).
    :param backend: the communicator; the job's by default.
    """

    def __init__(self, runtime: tnt_core.Runtime, backend: tnt_core.CommBackend | None = None,
                 *, name: str = "world") -> None:
        self.runtime = runtime
        self.name = name
        self.link = Link(runtime.backend if backend is None else backend)
        #: how many times a communicator was bound after the first
        self.generation = 0
        self._on_bind: list[Callable[[], Callable[[Channel], None] | None]] = []
        self._vector_reducers: dict[tuple[str, int], native_ops.NativeReducer] = {}

    # -- the communicator ----------------------------------------------------------------------

    @property
    def backend(self) -> tnt_core.CommBackend:
        """The communicator every collective of this channel goes to now."""
        return self.link.backend

    @property
    def rank(self) -> int:
        return self.link.backend.rank

    @property
    def size(self) -> int:
        return self.link.backend.size

    def bind(self, backend: tnt_core.CommBackend) -> None:
        """Send every later collective to ``backend``.

        Python-path ops already traced reach it at once (through :attr:`link`); what holds
        the old communicator in compiled form (the native reducers, a traced step) is
        dropped by the callbacks registered with :meth:`on_bind`, and traced again at the
        next step."""
        self.link.backend = backend
        self.generation += 1
        self._vector_reducers.clear()
        alive = []
        for ref in self._on_bind:
            callback = ref()
            if callback is not None:
                alive.append(ref)
                callback(self)
        self._on_bind = alive

    def on_bind(self, callback: Callable[[Channel], None]) -> None:
        """Call ``callback(channel)`` after each :meth:`bind` (drop what was compiled for the
        old communicator). A bound method is held weakly: its object may go away."""
        if inspect.ismethod(callback):
            self._on_bind.append(weakref.WeakMethod(callback))
        else:
            self._on_bind.append(lambda: callback)

    def split(self, ranks: Sequence[int], *, name: str = "group") -> Channel | None:
        """A channel over a group of this channel's ranks (a collective of this channel:
        every rank calls it with the same list); None on a rank outside ``ranks``."""
        group = self.backend.split(list(ranks))
        return None if group is None else Channel(self.runtime, group, name=name)

    # -- the path --------------------------------------------------------------------------------

    def native_reason(self) -> str | None:
        """Why collectives over this channel cannot take the native path (the op library,
        no Python in the step), or None when they can; said once per process in the log."""
        return native_ops.unavailable_reason(self.runtime, self.backend)

    def point_to_point(self) -> native_ops.PointToPoint | None:
        """The native send and receive ops over this channel, or None for the Python path."""
        return native_ops.point_to_point(self.runtime, self.backend)

    def native_reducer(self, plan: tnt_core.BucketPlan, *, name: str,
                       overlap: bool = True) -> native_ops.NativeReducer:
        """A native reducer of ``plan`` over the current communicator."""
        return native_ops.NativeReducer(self.runtime, plan, backend=self.backend,
                                        overlap=overlap, name=name)

    @staticmethod
    def reduce_native(reducer: native_ops.NativeReducer, tensors: Sequence[tf.Tensor],
                      factor64: tf.Tensor) -> list[tf.Tensor]:
        """Graph ops: ``reducer``'s pushes and finish over ``tensors``, counted as collectives."""
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        out = reducer.reduce(tensors, factor64)
        order.count(*[op for op in graph.get_operations()[before:] if op.type.startswith("Tnt")])
        return out

    def vector_reducer(self, name: str, length: int) -> native_ops.NativeReducer:
        """The native reducer of a float64 vector summed every step (metric states, logs):
        one bucket, made once per (name, length) and communicator."""
        key = (name, length)
        reducer = self._vector_reducers.get(key)
        if reducer is None:
            plan = tnt_core.plan_buckets([((length,), np.float64)], 0,
                                         align_bytes=tnt_core.BUFFER_ALIGNMENT)
            reducer = self._vector_reducers[key] = self.native_reducer(plan, name=name)
        return reducer

    # -- order and count -------------------------------------------------------------------------

    previous = staticmethod(order.previous)
    record = staticmethod(order.record)
    count = staticmethod(order.count)

    def host_op(self, fn: Callable[..., Any], inputs: Sequence[Any], dtypes: Any, *,
                name: str, ordered: bool = True) -> Any:
        """Graph op: ``fn(backend, *arrays)`` on the host, as one stateful ``numpy_function``
        that reaches the channel's communicator when it runs; after the previous collective
        of the graph and recorded as the last when ``ordered``.

        ``fn`` must capture no tensor and no object holding one (TensorFlow keeps it for the
        rest of the process)."""
        link = self.link

        def run(*arrays: Any) -> Any:
            return fn(link.backend, *arrays)

        with tf.control_dependencies(self.previous() if ordered else []):
            inputs = [tf.identity(t) for t in inputs]
        out = tf.numpy_function(run, inputs, dtypes, stateful=True, name=name)
        first = out[0] if isinstance(out, (list, tuple)) else out
        self.count(first)
        if ordered:
            self.record([first])
        return out

    # -- the host side ---------------------------------------------------------------------------

    def broadcast_arrays(self, arrays: Sequence[Any],
                         roots: int | Sequence[int]) -> list[np.ndarray]:
        """Every array as its root has it: one broadcast per (root, dtype on the wire), in an
        order every rank derives alike (a collective: every rank passes arrays of the same
        shapes and dtypes, and the same roots; a rank that is not an array's root passes any
        values of that shape). Dtypes the backend does not carry travel as their bytes
        (:mod:`tarantella.comm.wire`). Returns new arrays; the inputs are not changed."""
        arrays = [np.asarray(a) for a in arrays]
        root_of = [roots] * len(arrays) if isinstance(roots, int) else [int(r) for r in roots]
        if len(root_of) != len(arrays):
            raise ValueError(f"broadcast_arrays: {len(arrays)} arrays but {len(root_of)} roots")
        wires = [to_wire(a) for a in arrays]
        groups: dict[tuple[int, str], list[int]] = {}
        for i, w in enumerate(wires):
            groups.setdefault((root_of[i], w.dtype.str), []).append(i)
        out: list[np.ndarray] = list(arrays)
        backend = self.backend
        for (root, _), ids in sorted(groups.items()):
            flat = np.concatenate([wires[i] for i in ids])
            received = np.asarray(backend.broadcast(flat, root=root))
            offset = 0
            for i in ids:
                size = wires[i].size
                out[i] = np.array(from_wire(received[offset:offset + size], arrays[i].shape,
                                            arrays[i].dtype), copy=True)
                offset += size
        return out

    def broadcast_bytes(self, payload: bytes, root: int) -> bytes:
        """``payload`` as the root has it (a collective; the others pass any bytes)."""
        length = self.broadcast_arrays([np.array([len(payload)], dtype=np.int64)], root)[0]
        buffer = np.frombuffer(payload, dtype=np.uint8) if self.rank == root \
            else np.zeros(int(length[0]), dtype=np.uint8)
        return self.broadcast_arrays([buffer], root)[0].tobytes()

    def gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, by rank, on every rank (small payloads: one broadcast
        per rank)."""
        return [self.broadcast_bytes(payload, root) for root in range(self.size)]


_worlds: dict[int, Channel] = {}
_lock = threading.Lock()


def world(runtime: tnt_core.Runtime | None = None) -> Channel:
    """The channel over the job's communicator (one per runtime)."""
    runtime = tnt_core.init() if runtime is None else runtime
    with _lock:
        channel = _worlds.get(id(runtime))
        if channel is None or channel.runtime is not runtime:
            channel = _worlds[id(runtime)] = Channel(runtime)
        return channel
