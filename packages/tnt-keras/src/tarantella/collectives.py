"""The collectives a user's script calls: ``tnt.TensorAllreducer``, ``tnt.TensorBroadcaster``,
``tnt.TensorAllgatherer``, ``tnt.Barrier``, and the groups of ranks they run in, ``tnt.Group``.

The names, constructor arguments and group-relative ranks are those of the original
Tarantella; the values are NumPy arrays, TensorFlow tensors, Python or NumPy scalars, and
lists, tuples and dicts of them. Results have the structure and types of the inputs
(numpy in, numpy out; ``tf.Tensor`` in, ``tf.Tensor`` out) and inputs are never modified.
Each object is built for the structure, dtypes and shapes of the ``inputs`` it is given,
then called as often as needed. Every rank of the group makes the same calls in the same
order; the ranks first agree that they passed the same structure, shapes and dtypes
(:class:`tnt_core.CollectiveMismatchError` on every rank if not).

Everything runs eagerly, on the host, through the job's communication backend
(``tnt_core.init().backend``); ``tarantella.comm.graph_ops`` holds the graph ops the training
step uses instead. User guide: ``docs/collectives.md``.
"""

from __future__ import annotations

import enum
import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

import tnt_core

from . import comm
from .comm import Channel
from .errors import NotSupportedError
from .reporting.tracebacks import user_facing

__all__ = [
    "Barrier",
    "Group",
    "ReductionOp",
    "TensorAllgatherer",
    "TensorAllreducer",
    "TensorBroadcaster",
    "allgather",
    "allreduce",
    "broadcast",
    "get_group_master_rank",
    "is_group_master_rank",
]


class ReductionOp(enum.Enum):
    """How :class:`TensorAllreducer` combines the ranks' values, element by element."""

    SUM = "sum"
    #: the sum divided by the number of ranks in the group (floating-point values only)
    AVERAGE = "average"
    PROD = "product"
    MIN = "min"
    MAX = "max"


def _reduction_op(value: Any, where: str) -> ReductionOp:
    if isinstance(value, ReductionOp):
        return value
    if isinstance(value, str):
        for op in ReductionOp:
            if value.lower() in (op.name.lower(), op.value):
                return op
    raise ValueError(f"{where}(reduction_op={value!r}): not a reduction; use tnt.ReductionOp.SUM "
                     "(the default), AVERAGE, PROD, MIN or MAX")


# -- groups ----------------------------------------------------------------------------------

def _runtime() -> tnt_core.Runtime:
    return tnt_core.init()


def _check_ranks(ranks: Any, size: int) -> tuple[int, ...]:
    where = f"tnt.Group(ranks={ranks!r})"
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (Sequence, range)):
        raise TypeError(f"{where}: pass a list of ranks, e.g. tnt.Group([0, 1]) (or no argument "
                        "for all ranks)")
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise TypeError(f"{where}: ranks are ints; got a {type(r).__name__}")
        if not 0 <= int(r) < size:
            raise ValueError(f"{where}: rank {r} is not a rank of this job (0..{size - 1})")
        out.append(int(r))
    if not out:
        raise ValueError(f"{where}: a group needs at least one rank")
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: a rank is listed twice")
    return tuple(out)


def _requested(row: np.ndarray) -> tuple[int, ...]:
    """The ranks one rank asked for, from its row of the exchange (index in group, or -1)."""
    members = [(int(i), r) for r, i in enumerate(row) if i >= 0]
    return tuple(r for _, r in sorted(members))


class Group:
    """A group of ranks with a communicator of its own: the collectives given this group run
    among its members only.

    ``tnt.Group()`` is every rank of the job (no communication). ``tnt.Group(ranks)`` is a
    **collective of the whole job**: every rank calls it, at the same point of the program.
    Ranks may ask for different groups, as in the original Tarantella where each rank builds
    the group it belongs to (e.g. ``tnt.Group([0, 1])`` on ranks 0 and 1, ``tnt.Group([2, 3])``
    on ranks 2 and 3), or all ask for the same one (a rank outside it gets a ``Group`` it is no
    member of). Every member of a group must ask for that group. Position in ``ranks`` is the
    group rank: ``tnt.Group([2, 0])`` has rank 2 as its group rank 0.

    Needs a backend with groups (``backend.supports("groups")``: gloo, mpi), except for a
    group of all ranks in order.
    """

    _ranks: tuple[int, ...]
    _channel: Channel | None

    @user_facing
    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        runtime = _runtime()
        world = comm.world(runtime)
        if ranks is None:
            self._ranks, self._channel = tuple(range(runtime.size)), world
            return
        wanted = _check_ranks(ranks, runtime.size)
        self._ranks = wanted
        backend = _split(world.backend, wanted, runtime.size, runtime.rank)
        if backend is None or backend is world.backend:
            self._channel = None if backend is None else world
        else:
            self._channel = Channel(runtime, backend, name=f"group{list(wanted)}")
            weakref.finalize(self, backend.close)

    @property
    def ranks(self) -> list[int]:
        """The members' ranks in the job (their global ranks), in group-rank order."""
        return list(self._ranks)

    @property
    def group(self) -> list[int]:
        """The members' global ranks (the original Tarantella's name for :attr:`ranks`)."""
        return list(self._ranks)

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self._ranks)

    @property
    def rank(self) -> int | None:
        """This rank's rank in the group (0..size-1); None if it is not a member."""
        me = _runtime().rank
        return self._ranks.index(me) if me in self._ranks else None

    @property
    def global_rank(self) -> int:
        """This rank's rank in the job (``tnt.get_rank()``)."""
        return _runtime().rank

    def contains(self, rank: int) -> bool:
        """True if the job's rank ``rank`` is a member."""
        return rank in self._ranks

    def contains_global_rank(self, rank: int) -> bool:
        """As :meth:`contains` (the original Tarantella's name)."""
        return rank in self._ranks

    def contains_rank(self, group_rank: int) -> bool:
        """True if ``group_rank`` is a rank of the group (0..size-1)."""
        return 0 <= group_rank < len(self._ranks)

    @user_facing
    def to_global_rank(self, group_rank: int) -> int:
        """The job's rank of the member with group rank ``group_rank``."""
        if not (isinstance(group_rank, (int, np.integer)) and self.contains_rank(int(group_rank))):
            raise ValueError(f"{self!r}.to_global_rank({group_rank!r}): group ranks are "
                             f"0..{self.size - 1}")
        return self._ranks[int(group_rank)]

    @user_facing
    def to_group_rank(self, global_rank: int) -> int:
        """The group rank of the job's rank ``global_rank``."""
        if global_rank not in self._ranks:
            raise ValueError(f"{self!r}.to_group_rank({global_rank!r}): rank {global_rank} is not "
                             "a member of the group")
        return self._ranks.index(global_rank)

    def __repr__(self) -> str:
        return f"tnt.Group({list(self._ranks)})"

    def _member_channel(self, where: str) -> Channel:
        if self._channel is None:
            raise ValueError(
                f"{where}(group={self!r}): rank {_runtime().rank} is not a member of the group; "
                "only its members call its collectives (guard them with "
                "`if group.contains(tnt.get_rank()):`)"
            )
        return self._channel


def _split(world: tnt_core.CommBackend, wanted: tuple[int, ...], size: int,
           rank: int) -> tnt_core.CommBackend | None:
    """Every rank says which group it wants (one allgather); each distinct group is then
    split off the job's communicator, in the same order on every rank."""
    everyone = tuple(range(size))
    if size == 1:
        return world
    row = np.full(size, -1, dtype=np.int64)
    for index, r in enumerate(wanted):
        row[r] = index
    table = world.allgather(row)
    asked = [_requested(table[r]) for r in range(size)]
    distinct = list(dict.fromkeys(asked))
    where = f"tnt.Group(ranks={list(wanted)})"
    for group in distinct:
        for member in group:
            if asked[member] != group:
                asker = asked.index(group)
                raise ValueError(
                    f"{where}: rank {asker} asked for the group {list(group)}, but its member rank "
                    f"{member} asked for {list(asked[member])}; every member of a group must ask for "
                    "that group (ranks outside it may ask for it too)"
                )
    if any(g != everyone for g in distinct) and not world.supports("groups"):
        raise NotSupportedError(
            f"{where}: the {world.name!r} backend does not support groups; run with a backend that "
            "does (gloo or mpi: `tnt run --backend gloo`, or TNT_BACKEND=gloo), or use tnt.Group() "
            "(all ranks)"
        )
    mine: tnt_core.CommBackend | None = None
    for group in distinct:
        sub = world if group == everyone else world.split(list(group))
        if group == wanted:
            mine = sub if rank in group else None
    return mine


def _group(group: Any, where: str) -> Group:
    if group is None:
        return Group()
    if not isinstance(group, Group):
        raise TypeError(f"{where}(group={group!r}): pass a tnt.Group (made on every rank with "
                        "tnt.Group(ranks)), or None for all ranks")
    return group


def get_group_master_rank(group: Group | None = None) -> int:
    """The job's rank of the group's master: its group rank 0 (``group.ranks[0]``), as the
    job's master is rank 0 (``tnt.get_master_rank()``)."""
    return _group(group, "tnt.get_group_master_rank").ranks[0]


def is_group_master_rank(group: Group | None = None) -> bool:
    """True on the group's master rank, its group rank 0; False elsewhere (also on ranks
    outside the group). ``is_group_master_rank(tnt.Group())`` is ``tnt.is_master_rank()``."""
    return _runtime().rank == get_group_master_rank(group)


# -- values: structures of numbers, arrays and tensors -----------------------------------------

#: what each supported dtype travels as (the backends move float16/32/64 and int32/64)
_WIRE = {
    "float16": "float16", "float32": "float32", "float64": "float64",
    "int32": "int32", "int64": "int64",
    "bool": "int32", "int8": "int32", "int16": "int32", "uint8": "int32", "uint16": "int32",
    "uint32": "int64", "bfloat16": "float32",
}
_SUPPORTED = "float16, bfloat16, float32, float64, int8, int16, int32, int64, uint8, uint16, uint32, bool"


@dataclass(frozen=True)
class _Leaf:
    path: str
    kind: str  # "py" (Python scalar), "npscalar", "np" (ndarray), "tf" (tensor or variable)
    dtype: np.dtype
    shape: tuple[int, ...]
    pytype: type | None = None
    tf_dtype: Any = None

    @property
    def wire(self) -> np.dtype:
        return np.dtype(_WIRE[self.dtype.name])

    def describe(self) -> str:
        return f"{self.path}: {self.dtype.name} {self.shape}"


@dataclass(frozen=True)
class _Tree:
    """A structure's containers; leaves are numbered in a fixed order (dict keys sorted),
    the same on every rank whatever order its dicts were filled in."""

    kind: str  # "leaf", "list", "tuple", "dict"
    index: int = -1
    container: type | None = None
    keys: tuple[Any, ...] = ()  # a dict's keys, sorted: the order of its leaves
    order: tuple[Any, ...] = ()  # the same keys in the dict's own order: the result's
    children: tuple[_Tree, ...] = ()

    def signature(self) -> str:
        if self.kind == "leaf":
            return "*"
        inner = ",".join(c.signature() for c in self.children)
        if self.kind == "dict":
            return "{" + ",".join(f"{k!r}:{c.signature()}" for k, c in zip(self.keys, self.children)) + "}"
        return f"{self.kind}[{inner}]"

    def rebuild(self, values: Sequence[Any]) -> Any:
        if self.kind == "leaf":
            return values[self.index]
        items = [c.rebuild(values) for c in self.children]
        if self.kind == "dict":
            by_key = dict(zip(self.keys, items))
            return {k: by_key[k] for k in self.order}
        if self.kind == "tuple":
            if self.container is not None and hasattr(self.container, "_fields"):  # a namedtuple
                return self.container(*items)
            return tuple(items)
        return items


def _leaf_spec(x: Any, path: str, where: str) -> _Leaf | None:
    """The description of a leaf value, None if ``x`` is a container; raises for anything
    that is neither."""
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{where}: {path} is a {type(x).__name__}; pass numbers, numpy arrays or "
                        "TensorFlow tensors (or lists/dicts of them)")
    if isinstance(x, bool):
        return _checked(_Leaf(path, "py", np.dtype(bool), (), bool), where)
    if isinstance(x, int):
        if not -2**63 <= x < 2**63:
            raise ValueError(f"{where}: {path} = {x} does not fit in int64")
        return _checked(_Leaf(path, "py", np.dtype(np.int64), (), int), where)
    if isinstance(x, float):
        return _checked(_Leaf(path, "py", np.dtype(np.float64), (), float), where)
    if isinstance(x, np.generic):
        return _checked(_Leaf(path, "npscalar", x.dtype, ()), where)
    if isinstance(x, np.ndarray):
        return _checked(_Leaf(path, "np", x.dtype, tuple(x.shape)), where)
    if isinstance(x, (tf.Tensor, tf.Variable)):
        if isinstance(x, tf.Tensor) and tf.is_symbolic_tensor(x):
            raise NotSupportedError(
                f"{where}: {path} is a symbolic tensor (inside a tf.function or a Keras step); "
                "call the collective eagerly, outside tf.function"
            )
        dtype = np.dtype(x.dtype.as_numpy_dtype) if x.dtype != tf.string else np.dtype(object)
        name = x.dtype.name if x.dtype == tf.string else None
        return _checked(_Leaf(path, "tf", dtype, tuple(x.shape), tf_dtype=x.dtype), where, name)
    if isinstance(x, (tf.RaggedTensor, tf.SparseTensor, tf.IndexedSlices)):
        raise TypeError(f"{where}: {path} is a {type(x).__name__}; pass a dense tensor "
                        "(e.g. tf.convert_to_tensor(x) or x.to_tensor())")
    if isinstance(x, (list, tuple, dict)):
        return None
    raise TypeError(f"{where}: {path} is a {type(x).__name__}; pass numbers, numpy arrays or "
                    "TensorFlow tensors (or lists, tuples and dicts of them)")


def _checked(leaf: _Leaf, where: str, name: str | None = None) -> _Leaf:
    if leaf.dtype.name not in _WIRE:
        raise TypeError(f"{where}: {leaf.path} has dtype {name or leaf.dtype.name}, which the "
                        f"collectives do not support; use one of {_SUPPORTED}")
    return leaf


def _flatten(x: Any, where: str) -> tuple[_Tree, list[Any], list[_Leaf]]:
    values: list[Any] = []
    specs: list[_Leaf] = []

    def walk(v: Any, path: str) -> _Tree:
        spec = _leaf_spec(v, path, where)
        if spec is not None:
            values.append(v)
            specs.append(spec)
            return _Tree("leaf", index=len(values) - 1)
        if isinstance(v, dict):
            keys = sorted(v, key=repr)
            return _Tree("dict", keys=tuple(keys), order=tuple(v),
                         children=tuple(walk(v[k], f"{path}[{k!r}]") for k in keys))
        kind = "tuple" if isinstance(v, tuple) else "list"
        return _Tree(kind, container=type(v),
                     children=tuple(walk(e, f"{path}[{i}]") for i, e in enumerate(v)))

    tree = walk(x, "inputs")
    return tree, values, specs


def _as_wire(value: Any, spec: _Leaf) -> np.ndarray:
    """A new, C-contiguous array of the value in the dtype it travels as."""
    if spec.kind == "tf":
        value = value.numpy()
    return np.array(value, dtype=spec.wire, order="C", copy=True)


def _from_wire(arr: np.ndarray, spec: _Leaf, shape: tuple[int, ...] | None = None) -> Any:
    """The result for ``spec`` from the array ``arr`` of its wire dtype."""
    out = arr != 0 if spec.dtype == np.bool_ else arr.astype(spec.dtype, copy=False)
    out = out.reshape(spec.shape if shape is None else shape)
    if spec.kind == "tf":
        return tf.convert_to_tensor(out, dtype=spec.tf_dtype)
    if shape is not None and spec.kind in ("py", "npscalar"):  # gathered scalars: an array
        return out
    if spec.kind == "py":
        assert spec.pytype is not None
        return spec.pytype(out.item())
    if spec.kind == "npscalar":
        return out[()]
    return out


def _fingerprint(tree: _Tree, specs: Sequence[_Leaf], extra: str, *, gather: bool = False) -> int:
    """64 bits that differ (almost surely) when structures, dtypes or shapes differ; for an
    allgather the first dimension of each leaf is left out (it may differ)."""
    shapes = [s.shape[1:] if gather and s.shape else s.shape for s in specs]
    text = f"{extra}|{tree.signature()}|" + ";".join(
        f"{s.dtype.name}:{len(s.shape)}:{shape}" for s, shape in zip(specs, shapes))
    return int(np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), dtype="<i8")[0])


def _agree(backend: tnt_core.CommBackend, fingerprint: int, where: str,
           specs: Sequence[_Leaf]) -> None:
    """Every rank of ``backend`` passed the same structure (one small allreduce), else every
    rank raises :class:`tnt_core.CollectiveMismatchError`."""
    words = np.array([fingerprint, -fingerprint], dtype=np.int64)
    if fingerprint == -2**63:  # (its negation does not fit)
        words[1] = 2**63 - 1
    high = backend.allreduce(words.copy(), "max")
    if not np.array_equal(high, words):
        shown = "; ".join(s.describe() for s in specs[:6]) + ("; ..." if len(specs) > 6 else "")
        raise tnt_core.CollectiveMismatchError(
            f"{where}: the ranks of the group passed different inputs (structure, dtypes or "
            f"shapes); this rank passed {len(specs)} value(s): {shown}. Every rank must pass the "
            "same structure with the same dtypes and shapes", rank=_runtime().rank)


def _same_form(specs: Sequence[_Leaf], tree: _Tree, built: Sequence[_Leaf], built_tree: _Tree,
               where: str, *, gather: bool = False) -> None:
    """The values of a call have the form the object was built for."""
    if tree.signature() != built_tree.signature() or len(specs) != len(built):
        raise ValueError(f"{where}: inputs has another structure than the one the object was built "
                         f"for ({built_tree.signature()} != {tree.signature()}); build a new one for "
                         "other inputs")
    for s, b in zip(specs, built):
        same_shape = (s.shape[1:] == b.shape[1:] and len(s.shape) == len(b.shape)) if gather \
            else s.shape == b.shape
        if s.dtype != b.dtype or not same_shape:
            what = "dtype and trailing dimensions" if gather else "dtype and shape"
            raise ValueError(f"{where}: {s.path} is {s.dtype.name} {s.shape}, but the object was "
                             f"built for {b.dtype.name} {b.shape} (the {what} must match); build "
                             "a new one for other inputs")


class _Pending:
    """A started collective: ``finish()`` waits and returns the result."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self.finish = finish


def _by_wire(specs: Sequence[_Leaf]) -> dict[np.dtype, list[int]]:
    groups: dict[np.dtype, list[int]] = {}
    for i, s in enumerate(specs):
        groups.setdefault(s.wire, []).append(i)
    return groups


# -- the collectives ---------------------------------------------------------------------------

class _StartAndWait:
    """The original Tarantella's split form of a collective: ``start(inputs)``, other work,
    then ``wait_for_completion()`` for the result."""

    _pending: _Pending | None = None
    _start_call = "start(inputs)"

    def _start(self, inputs: Any) -> _Pending:
        raise NotImplementedError

    @user_facing
    def start(self, inputs: Any = None) -> None:
        """Start the collective on ``inputs``; :meth:`wait_for_completion` returns the result."""
        self._pending = self._start(inputs)

    @user_facing
    def wait_for_completion(self, inputs: Any = None) -> Any:
        """The result of the collective :meth:`start` started (``inputs`` is not used)."""
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}.wait_for_completion(): call "
                               f"{self._start_call} first")
        pending, self._pending = self._pending, None
        return pending.finish()


class TensorAllreducer(_StartAndWait):
    """Reduce values over the ranks of a group, element by element: every rank gets the sum
    (or another :class:`ReductionOp`).

    ``allreducer = tnt.TensorAllreducer(inputs)`` builds it for the structure, dtypes and
    shapes of ``inputs``; ``allreducer(values)`` (or ``allreducer.allreduce(values)``)
    returns the reduction of ``values`` in the same structure and types. ``AVERAGE`` needs
    floating-point values; booleans reduce as 0/1 and come back as ``value != 0``
    (``SUM``/``MAX``: any rank true; ``PROD``/``MIN``: all ranks true); integers narrower
    than 32 bits wrap around as their own arithmetic would.

    :param inputs: a value of the form later calls pass (its values are not used).
    :param group: a :class:`Group` (the default, None: all ranks); only members call it.
    :param reduction_op: a :class:`ReductionOp` (or its name); ``SUM`` by default.
    """

    @user_facing
    def __init__(self, inputs: Any, group: Group | None = None,
                 reduction_op: ReductionOp | str = ReductionOp.SUM) -> None:
        where = "tnt.TensorAllreducer"
        self.group = _group(group, where)
        self.reduction_op = _reduction_op(reduction_op, where)
        self._tree, _, self._specs = _flatten(inputs, f"{where}(inputs=...)")
        if self.reduction_op is ReductionOp.AVERAGE:
            for s in self._specs:
                if s.wire.kind != "f":
                    raise TypeError(
                        f"{where}(reduction_op=ReductionOp.AVERAGE): {s.path} has dtype "
                        f"{s.dtype.name}, whose average would be rounded; cast it to a float "
                        "dtype, or use ReductionOp.SUM and divide"
                    )
        self._channel = self.group._member_channel(where)  # noqa: SLF001 (this module's class)
        self._pending: _Pending | None = None

    @user_facing
    def allreduce(self, inputs: Any) -> Any:
        """The reduction of ``inputs`` over the group's ranks (a collective of the group)."""
        return self._start(inputs).finish()

    __call__ = allreduce

    def _start(self, inputs: Any) -> _Pending:
        where = "TensorAllreducer.allreduce(inputs=...)"
        tree, values, specs = _flatten(inputs, where)
        _same_form(specs, tree, self._specs, self._tree, where)
        backend, size = self._channel.backend, self.group.size
        op = self.reduction_op
        wire_op = "sum" if op is ReductionOp.AVERAGE else op.value
        if len(specs) > 1 and size > 1:
            _agree(backend, _fingerprint(tree, specs, f"allreduce:{op.value}"), where, specs)
        buffers: list[tuple[list[int], np.ndarray, Any]] = []
        for dtype, members in _by_wire(specs).items():
            if len(members) == 1:  # sent in its own shape: the backend checks it agrees
                buf = _as_wire(values[members[0]], specs[members[0]]).reshape(
                    specs[members[0]].shape or (1,))
            else:
                buf = np.concatenate([_as_wire(values[i], specs[i]).ravel() for i in members]
                                     ) if members else np.zeros(0, dtype)
            # an empty buffer of a structure skips its collective (the ranks agreed on the
            # structure); a single value goes to the backend even empty, which checks it agrees
            wanted = size > 1 and (buf.size > 0 or len(specs) == 1)
            handle = backend.allreduce_async(buf, wire_op) if wanted else None
            buffers.append((members, buf, handle))

        def finish() -> Any:
            results: list[Any] = [None] * len(specs)
            for members, buf, handle in buffers:
                out = handle.wait() if handle is not None else buf
                if op is ReductionOp.AVERAGE:
                    out = out / np.asarray(size, dtype=out.dtype)
                flat = out.ravel()
                offset = 0
                for i in members:
                    n = int(np.prod(specs[i].shape, dtype=np.int64))
                    results[i] = _from_wire(flat[offset:offset + n], specs[i])
                    offset += n
            return tree.rebuild(results)

        return _Pending(finish)


class TensorBroadcaster(_StartAndWait):
    """Send the values of one rank, the root, to every rank of a group.

    ``broadcaster = tnt.TensorBroadcaster(inputs, root_rank=0)`` is built on every rank for
    the structure, dtypes and shapes of ``inputs``; ``broadcaster.broadcast(values)`` on the
    root and ``broadcaster.broadcast()`` elsewhere (or ``broadcaster(values)`` everywhere:
    the other ranks' values are not used) return the root's values on every rank. A root
    that passes nothing sends the ``inputs`` it was built with.

    :param inputs: a value of the form the root sends.
    :param root_rank: the root's rank *in the group* (its group rank; for all ranks, the
        same as its rank in the job).
    :param group: a :class:`Group` (the default, None: all ranks); only members call it.
    """

    _start_call = "start()"

    @user_facing
    def __init__(self, inputs: Any, root_rank: int = 0, group: Group | None = None) -> None:
        where = "tnt.TensorBroadcaster"
        self.group = _group(group, where)
        if (isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer))
                or not 0 <= int(root_rank) < self.group.size):
            raise ValueError(
                f"{where}(root_rank={root_rank!r}): not a rank of {self.group!r}, whose group ranks "
                f"are 0..{self.group.size - 1}; root_rank is the root's rank in the group "
                "(group.to_group_rank(rank) gives it for a rank of the job)"
            )
        self.root_rank = int(root_rank)
        self._inputs = inputs
        self._tree, _, self._specs = _flatten(inputs, f"{where}(inputs=...)")
        self._channel = self.group._member_channel(where)  # noqa: SLF001 (this module's class)
        self._pending: _Pending | None = None

    @property
    def is_root(self) -> bool:
        return self.group.rank == self.root_rank

    @user_facing
    def broadcast(self, inputs: Any = None) -> Any:
        """The root's values on every rank of the group (a collective of the group)."""
        return self._start(inputs).finish()

    __call__ = broadcast

    def _start(self, inputs: Any) -> _Pending:
        where = "TensorBroadcaster.broadcast(inputs=...)"
        if inputs is None or not self.is_root:
            tree, specs = self._tree, self._specs
            if inputs is not None:  # another rank's values: only their form must be right
                other_tree, _, other_specs = _flatten(inputs, where)
                _same_form(other_specs, other_tree, specs, tree, where)
            values = _flatten(self._inputs, where)[1] if self.is_root else None
        else:
            tree, values, specs = _flatten(inputs, where)
            _same_form(specs, tree, self._specs, self._tree, where)
        backend, size = self._channel.backend, self.group.size
        if len(specs) > 1 and size > 1:
            _agree(backend, _fingerprint(tree, specs, f"broadcast:{self.root_rank}"), where, specs)
        results: list[Any] = [None] * len(specs)
        for dtype, members in _by_wire(specs).items():
            shapes = [specs[i].shape for i in members]
            counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
            if values is not None:
                parts = [_as_wire(values[i], specs[i]).ravel() for i in members]
                buf = np.concatenate(parts) if len(parts) > 1 else parts[0]
            else:
                buf = np.zeros(sum(counts), dtype)
            if len(members) == 1:
                buf = buf.reshape(shapes[0] or (1,))
            if size > 1 and (buf.size > 0 or len(specs) == 1):  # (as in the allreduce)
                buf = backend.broadcast(buf, self.root_rank)
            flat, offset = buf.ravel(), 0
            for i, n in zip(members, counts):
                results[i] = _from_wire(flat[offset:offset + n], specs[i])
                offset += n
        result = tree.rebuild(results)
        return _Pending(lambda: result)


class TensorAllgatherer(_StartAndWait):
    """Gather values from every rank of a group: every rank gets them concatenated along
    the first axis, in group-rank order.

    ``allgatherer = tnt.TensorAllgatherer(inputs)`` is built for the structure, dtypes and
    trailing dimensions of ``inputs``; ``allgatherer(values)`` (or ``.allgather(values)``)
    returns, for each array or tensor of shape ``(n_r, *rest)`` on rank ``r``, one of shape
    ``(n_0 + n_1 + ..., *rest)``. The first dimensions may differ between ranks (as the
    original's ``Allgatherv``); the other dimensions and the dtypes must agree. A scalar
    counts as one row: scalars gather into a 1-D array (numpy, or a tensor for a tensor).

    :param inputs: a value of the form later calls pass (its values are not used).
    :param group: a :class:`Group` (the default, None: all ranks); only members call it.
    """

    @user_facing
    def __init__(self, inputs: Any, group: Group | None = None) -> None:
        where = "tnt.TensorAllgatherer"
        self.group = _group(group, where)
        self._tree, _, self._specs = _flatten(inputs, f"{where}(inputs=...)")
        self._channel = self.group._member_channel(where)  # noqa: SLF001 (this module's class)
        self._pending: _Pending | None = None

    @user_facing
    def allgather(self, inputs: Any) -> Any:
        """Every rank's ``inputs``, concatenated along the first axis (a collective of the
        group)."""
        return self._start(inputs).finish()

    __call__ = allgather

    def _start(self, inputs: Any) -> _Pending:
        where = "TensorAllgatherer.allgather(inputs=...)"
        tree, values, specs = _flatten(inputs, where)
        _same_form(specs, tree, self._specs, self._tree, where, gather=True)
        backend, size = self._channel.backend, self.group.size
        rows = [s.shape if s.shape else (1,) for s in specs]  # a scalar is one row
        wire = [_as_wire(v, s).reshape(r) for v, s, r in zip(values, specs, rows)]
        if size == 1:
            result = tree.rebuild([_from_wire(w, s, w.shape) for w, s in zip(wire, specs)])
            return _Pending(lambda: result)
        _agree(backend, _fingerprint(tree, specs, "allgather", gather=True), where, specs)
        counts = backend.allgather(np.array([r[0] for r in rows], dtype=np.int64))  # (size, n)
        me = self.group.rank or 0
        results: list[Any] = [None] * len(specs)
        for dtype, members in _by_wire(specs).items():
            inner = [int(np.prod(rows[i][1:], dtype=np.int64)) for i in members]
            lengths = [sum(int(counts[r, i]) * k for i, k in zip(members, inner)) for r in range(size)]
            longest = max(lengths)
            if longest == 0:
                gathered = np.zeros((size, 0), dtype)
            else:
                buf = np.zeros(longest, dtype)
                if lengths[me]:
                    buf[:lengths[me]] = np.concatenate([wire[i].ravel() for i in members])
                gathered = backend.allgather(buf)
            offsets = [0] * size
            for i, k in zip(members, inner):
                pieces = []
                for r in range(size):
                    n = int(counts[r, i]) * k
                    piece = gathered[r, offsets[r]:offsets[r] + n]
                    pieces.append(piece.reshape((int(counts[r, i]), *rows[i][1:])))
                    offsets[r] += n
                joined = np.concatenate(pieces, axis=0)
                results[i] = _from_wire(joined, specs[i], joined.shape)
        result = tree.rebuild(results)
        return _Pending(lambda: result)


class Barrier:
    """Wait until every rank of the group has reached the barrier.

    ``barrier = tnt.Barrier(group)``; ``barrier.execute()`` (or ``barrier()``) on every
    member.

    :param group: a :class:`Group` (the default, None: all ranks); only members call it.
    """

    @user_facing
    def __init__(self, group: Group | None = None) -> None:
        self.group = _group(group, "tnt.Barrier")
        self._channel = self.group._member_channel("tnt.Barrier")  # noqa: SLF001 (this module's class)

    @user_facing
    def execute(self) -> None:
        """Return once every member of the group has called it (a collective of the group)."""
        if self.group.size > 1:
            self._channel.backend.barrier()

    __call__ = execute


# -- Horovod-style one-call forms ----------------------------------------------------------------

@user_facing
def allreduce(inputs: Any, reduction_op: ReductionOp | str = ReductionOp.SUM,
              group: Group | None = None) -> Any:
    """``tnt.TensorAllreducer(inputs, group, reduction_op)(inputs)`` in one call (as
    ``hvd.allreduce``, but summing by default, as the original Tarantella)."""
    return TensorAllreducer(inputs, group=group, reduction_op=reduction_op)(inputs)


@user_facing
def broadcast(inputs: Any, root_rank: int = 0, group: Group | None = None) -> Any:
    """The root's ``inputs`` on every rank (as ``hvd.broadcast``): every rank passes values
    of the same form; only the root's are sent."""
    return TensorBroadcaster(inputs, root_rank=root_rank, group=group)(inputs)


@user_facing
def allgather(inputs: Any, group: Group | None = None) -> Any:
    """Every rank's ``inputs`` concatenated along the first axis (as ``hvd.allgather``)."""
    return TensorAllgatherer(inputs, group=group)(inputs)
