"""The collectives a script calls (``tnt.TensorAllreducer``, ``TensorBroadcaster``,
``TensorAllgatherer``, ``Barrier``, ``Group``): ``docs/collectives.md``.

Several ranks: ``workers/user_collectives_worker.py`` runs every case in the two multi-rank
launches of the suite worker (``tnt_keras_helpers``: 3 ranks on gloo, 2 on ``store``) and checks its
results against what NumPy computes from every rank's values; this test reads their
reports. One rank: in-process checks of results, types and the errors, and that the docs
quote the real messages.
"""

from __future__ import annotations

import json
import re
import traceback
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tarantella as tnt
import tnt_core
from tarantella import collectives as user_collectives
from tarantella.comm import Channel
from tnt_keras_helpers import NATIVE_PATH, PYTHON_PATH, launch_params

pytestmark = pytest.mark.timeout(300)

DOCS = Path(__file__).resolve().parents[3] / "docs" / "collectives.md"


@pytest.fixture(scope="session", params=launch_params([NATIVE_PATH, PYTHON_PATH]))
def reports(request, suite_runs) -> list[dict]:
    out, nprocs, _ = suite_runs.get(request.param)
    return [json.loads((out / "collectives" / f"rank{r}.json").read_text()) for r in range(nprocs)]


@pytest.mark.timeout(1500)  # the first test of a launch waits for it
def test_every_case_passes_on_every_rank(reports):
    names = list(reports[0])
    assert len(names) >= 19
    failed = [f"rank {r}, {name}:\n{rep[name]['detail']}" for r, rep in enumerate(reports)
              for name in names if not rep.get(name, {"ok": False})["ok"]]
    assert all(list(rep) == names for rep in reports)
    assert not failed, "\n\n".join(failed)


# -- one rank, in this process ----------------------------------------------------------------

def test_one_rank_returns_the_inputs_in_their_structure_and_types():
    x = {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
         "b": [tf.constant([1, 2], tf.int16), 3.5, True, 7], "c": (np.float32(2), tf.Variable([1.0]))}
    for out in (tnt.TensorAllreducer(x)(x), tnt.TensorBroadcaster(x)(), tnt.broadcast(x),
                tnt.allreduce(x, reduction_op="max")):
        assert list(out) == ["a", "b", "c"] and type(out["c"]) is tuple
        assert type(out["a"]) is np.ndarray and out["a"].dtype == np.float32
        np.testing.assert_array_equal(out["a"], x["a"])
        assert out["a"] is not x["a"]
        assert isinstance(out["b"][0], tf.Tensor) and out["b"][0].dtype == tf.int16
        assert out["b"][1:] == [3.5, True, 7] and [type(v) for v in out["b"][1:]] == [float, bool, int]
        assert type(out["c"][0]) is np.float32 and isinstance(out["c"][1], tf.Tensor)
    gathered = tnt.TensorAllgatherer(x)(x)
    assert gathered["a"].shape == (2, 3) and gathered["b"][1].shape == (1,)
    assert isinstance(gathered["b"][1], np.ndarray) and gathered["b"][2].dtype == np.bool_
    np.testing.assert_array_equal(tnt.allgather(50), [50])


def test_results_are_new_arrays_and_inputs_stay_as_they_were():
    x = np.ones(4, np.float32)
    for out in (tnt.allreduce(x), tnt.broadcast(x), tnt.allgather(x)):
        out[:] = 5
        np.testing.assert_array_equal(x, np.ones(4))


def test_split_phase_and_barrier_at_one_rank():
    reducer = tnt.TensorAllreducer([np.ones(2), 1.0])
    reducer.start([np.ones(2) * 3, 2.0])
    out = reducer.wait_for_completion()
    np.testing.assert_array_equal(out[0], [3.0, 3.0])
    assert out[1] == 2.0
    assert tnt.Barrier().execute() is None and tnt.Barrier(tnt.Group([0]))() is None


def test_groups_at_one_rank():
    for g in (tnt.Group(), tnt.Group([0]), tnt.Group(range(1))):
        assert (g.ranks, g.group, g.size, g.rank, g.global_rank) == ([0], [0], 1, 0, 0)
        assert g.contains(0) and g.contains_global_rank(0) and not g.contains(1)
        assert g.contains_rank(0) and not g.contains_rank(1)
        assert g.to_global_rank(0) == 0 and g.to_group_rank(0) == 0
        assert tnt.is_group_master_rank(g) and tnt.get_group_master_rank(g) == 0
    assert tnt.is_group_master_rank() == tnt.is_master_rank()
    assert repr(tnt.Group([0])) == "tnt.Group([0])"


def _pair(backend=None) -> tnt.Group:
    """A two-rank group as a rank of a larger job sees it (``backend`` None: not a member)."""
    group = object.__new__(tnt.Group)
    group._ranks = (0, 1)
    group._channel = None if backend is None else Channel(tnt_core.init(), backend)
    return group


class _Peers:
    """A job's communicator as a rank sees it through the group exchange: every rank's
    request comes from ``table``."""

    rank = 0

    def __init__(self, table, name="loopback", groups=False, disagree=False):
        self.table, self.name, self.groups, self.disagree = np.array(table), name, groups, disagree
        self.size = len(table) if table is not None else 2

    def allgather(self, row):
        return self.table

    def supports(self, capability):
        return self.groups

    def allreduce(self, buf, op="sum"):
        return buf + 1 if self.disagree else buf

    def split(self, ranks):
        raise AssertionError("not expected")


BAD = [
    (TypeError, "inputs['name'] is a str", lambda: tnt.TensorAllreducer({"loss": 0.5, "name": "run-1"})),
    (TypeError, "dtype uint64", lambda: tnt.TensorAllgatherer(np.zeros(2, np.uint64))),
    (TypeError, "inputs is a complex", lambda: tnt.allreduce(1j)),
    (TypeError, "dtype complex128", lambda: tnt.allreduce(np.ones(2, np.complex128))),
    (TypeError, "dtype string", lambda: tnt.TensorBroadcaster(tf.constant(["a"]))),
    (TypeError, "is a RaggedTensor", lambda: tnt.allreduce(tf.ragged.constant([[1], [2, 3]]))),
    (TypeError, "is a NoneType", lambda: tnt.allreduce([1.0, None])),
    (TypeError, "whose average would be rounded",
     lambda: tnt.TensorAllreducer(np.arange(3), reduction_op=tnt.ReductionOp.AVERAGE)),
    (ValueError, "reduction_op='mean'", lambda: tnt.TensorAllreducer(1.0, reduction_op="mean")),
    (ValueError, "root_rank=2", lambda: tnt.TensorBroadcaster(np.zeros(3), root_rank=2,
                                                              group=_pair(tnt_core.init().backend))),
    (ValueError, "root_rank=-1", lambda: tnt.broadcast(1.0, root_rank=-1)),
    (ValueError, "is not a member of the group", lambda: tnt.TensorAllreducer(1.0, group=_pair())),
    (ValueError, "is not a member of the group", lambda: tnt.Barrier(_pair())),
    (ValueError, "built for float64 (3,)", lambda: tnt.TensorAllreducer(np.zeros(3))(np.zeros(4))),
    (ValueError, "another structure", lambda: tnt.TensorAllgatherer([1.0])([1.0, 2.0])),
    (ValueError, "trailing dimensions", lambda: tnt.TensorAllgatherer(np.zeros((2, 3)))(np.zeros((2, 4)))),
    (TypeError, "pass a tnt.Group", lambda: tnt.allgather(1.0, group=[0])),
    (TypeError, "pass a list of ranks", lambda: tnt.Group(0)),
    (ValueError, "rank 1 is not a rank of this job", lambda: tnt.Group([1])),
    (ValueError, "a rank is listed twice", lambda: tnt.Group([0, 0])),
    (ValueError, "at least one rank", lambda: tnt.Group([])),
    (ValueError, "group ranks are 0..0", lambda: tnt.Group().to_global_rank(1)),
    (RuntimeError, "call start(inputs) first", lambda: tnt.TensorAllreducer(1.0).wait_for_completion()),
]


@pytest.mark.parametrize("kind,fragment,call", BAD, ids=[f"{b[0].__name__}-{b[1]}" for b in BAD])
def test_bad_arguments_fail_with_one_clear_line(kind, fragment, call):
    with pytest.raises(kind) as info:
        call()
    assert fragment in str(info.value) and "\n" not in str(info.value)
    exc = info.value
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
    inside = [f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(info.tb)
              if any(d in f.filename for d in ("/tarantella/", "/tnt_core/", "/tensorflow/", "/numpy/"))]
    assert len(inside) <= 2, inside  # the entry point and the line that refused


def test_symbolic_tensors_are_refused_inside_tf_function():
    @tf.function
    def step(x):
        return tnt.allreduce(x)

    with pytest.raises(tnt.NotSupportedError, match="call the collective eagerly"):
        step(tf.ones(2))


def test_groups_need_a_backend_that_has_them_unless_all_ranks_in_order():
    asked = [[0, 1, -1]] * 3
    with pytest.raises(tnt.NotSupportedError, match="'loopback' backend does not support groups"):
        user_collectives._split(_Peers(asked), (0, 1), 3, 0)
    everyone = _Peers([[0, 1, 2]] * 3)
    assert user_collectives._split(everyone, (0, 1, 2), 3, 0) is everyone


def test_every_member_must_ask_for_its_group():
    with pytest.raises(ValueError, match="but its member rank 1 asked for \\[1, 0\\]"):
        user_collectives._split(_Peers([[0, 1], [1, 0]], groups=True), (0, 1), 2, 0)
    with pytest.raises(ValueError, match="but its member rank 0 asked for \\[0\\]"):
        user_collectives._split(_Peers([[0, -1], [0, 1]], groups=True), (0,), 2, 0)


def test_structures_that_differ_between_ranks_are_refused():
    x = [np.zeros(3, np.float32), np.zeros((2, 4))]
    with pytest.raises(tnt_core.CollectiveMismatchError, match="passed different inputs"):
        tnt.TensorAllreducer(x, group=_pair(_Peers(None, disagree=True)))(x)


def _norm(line: str) -> str:  # as tests/test_docs_messages.py compares quoted lines
    line = re.sub(r"(?<![\w.])/[^\s)'`,]+", "PATH", line.strip())
    return re.sub(r"\d+", "#", line)


def test_docs_quote_the_real_messages():
    quoted = {_norm(line) for block in re.findall(r"```text\n(.*?)```", DOCS.read_text(), re.DOTALL)
              for line in block.splitlines() if line.strip()}
    x = [np.zeros(3, np.float32), np.zeros((2, 4))]
    calls = [
        lambda: tnt.TensorAllreducer({"loss": 0.5, "name": "run-1"}),
        lambda: tnt.TensorAllreducer(np.arange(3), reduction_op=tnt.ReductionOp.AVERAGE),
        lambda: tnt.TensorBroadcaster(np.zeros(3), root_rank=2, group=_pair(tnt_core.init().backend)),
        lambda: tnt.TensorAllreducer(1.0, group=_pair()),
        lambda: tnt.TensorAllreducer(np.zeros(3))(np.zeros(4)),
        lambda: tnt.TensorAllreducer(x, group=_pair(_Peers(None, disagree=True)))(x),
        lambda: user_collectives._split(_Peers([[0, 1], [1, 0]], groups=True), (0, 1), 2, 0),
        lambda: user_collectives._split(_Peers([[0, 1, -1]] * 3), (0, 1), 3, 0),
    ]
    for call in calls:
        with pytest.raises(Exception) as info:
            call()
        kind = type(info.value)
        name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
        line = f"{name}: {info.value}"
        assert _norm(line) in quoted, f"docs/collectives.md does not quote:\n{line}"
