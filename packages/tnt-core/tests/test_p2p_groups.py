"""Point-to-point and groups in one process: the local backend, the default refusal of a
backend without the capabilities, and WatchedBackend's forwarding. The multi-rank checks
are conformance cases (tnt_core.testing.conformance: p2p-*, groups)."""

import numpy as np
import pytest

from tnt_core import CommBackend, CommError, LocalBackend, UnsupportedOperationError
from tnt_core._stall_ledger import Ledger
from tnt_core._watched_backend import WatchedBackend


class _CollectivesOnly(CommBackend):
    name = "thirdparty"

    def __init__(self) -> None:
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1

    def allreduce_async(self, buf, op="sum"):
        return LocalBackend().allreduce_async(buf, op)

    def broadcast(self, buf, root=0):
        return buf

    def allgather(self, buf):
        return buf[np.newaxis]

    def barrier(self):
        return None

    def close(self):
        return None


def test_a_backend_without_p2p_says_so_only_when_used():
    b = _CollectivesOnly()
    assert not b.supports("p2p") and not b.supports("groups")
    b.allreduce(np.ones(2, np.float32))  # data parallelism keeps working
    for call in (lambda: b.send_async(np.ones(1, np.float32), 0),
                 lambda: b.recv_async(np.ones(1, np.float32), 0),
                 lambda: b.split([0])):
        with pytest.raises(UnsupportedOperationError, match="'thirdparty' backend does not support"):
            call()
    with pytest.raises(ValueError, match="unknown capability"):
        b.supports("pipelines")


def test_local_backend_messages_to_itself_in_order_per_tag():
    b = LocalBackend()
    assert b.supports("p2p") and b.supports("groups")
    b.send_async(np.arange(3, dtype=np.int32), 0, tag=1)
    b.send_async(np.arange(3, dtype=np.int32) + 10, 0, tag=1)
    b.send_async(np.zeros(0, np.float64), 0, tag=2)
    assert b.recv_async(np.empty(0, np.float64), 0, tag=2).wait().size == 0
    assert b.recv_async(np.empty(3, np.int32), 0, tag=1).wait().tolist() == [0, 1, 2]
    assert b.recv_async(np.empty(3, np.int32), 0, tag=1).wait().tolist() == [10, 11, 12]
    with pytest.raises(CommError, match="rank 0"):
        b.recv_async(np.empty(3, np.int32), 0, tag=1).wait()
    b.send_async(np.ones(4, np.float32), 0)
    with pytest.raises(CommError, match="bytes"):
        b.recv_async(np.empty(2, np.float32), 0).wait()
    with pytest.raises(ValueError, match="not a rank"):
        b.send_async(np.ones(1, np.float32), 1)
    group = b.split([0])
    assert group is not None and group.size == 1
    with pytest.raises(ValueError, match="twice"):
        b.split([0, 0])


def test_watched_backend_forwards_and_wraps_groups_with_their_own_ledger():
    ledger = Ledger()
    w = WatchedBackend(LocalBackend(), ledger, agree=False)
    assert w.supports("p2p") and w.capabilities == frozenset({"p2p", "groups"})
    w.send_async(np.ones(2, np.float32), 0, 3)
    assert w.recv_async(np.zeros(2, np.float32), 0, 3).wait().tolist() == [1.0, 1.0]
    assert ledger.entered == 0, "p2p is not a collective: not counted"
    group = w.split([0])
    assert ledger.entered == 1, "split is a collective of the parent"
    assert isinstance(group, WatchedBackend) and group.ledger is not ledger
    group.allreduce(np.ones(1, np.float32))
    assert group.ledger.entered == 1 and ledger.entered == 1
    unsupported = WatchedBackend(_CollectivesOnly(), Ledger(), agree=False)
    with pytest.raises(UnsupportedOperationError):
        unsupported.split([0])
