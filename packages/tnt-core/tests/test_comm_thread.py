import threading
import time

import numpy as np
import pytest

from tnt_core import CommError, CommThread


def test_operations_run_in_submission_order():
    worker = CommThread("t", rank=0, timeout_s=10)
    seen = []
    handles = [worker.submit(lambda i=i: (time.sleep(0.001 * (5 - i % 5)), seen.append(i))[1], f"op{i}")
               for i in range(20)]
    handles[-1].wait()
    assert seen == list(range(20))
    assert all(h.done() for h in handles)
    worker.close()


def test_timeout_raises_comm_error_and_poisons_later_ops():
    worker = CommThread("t", rank=2, timeout_s=0.2)
    release = threading.Event()
    hung = worker.submit(lambda: release.wait(10), "allreduce #1")
    with pytest.raises(CommError, match=r"rank 2: allreduce #1\] did not complete within 0.2s"):
        hung.wait()
    with pytest.raises(CommError, match="an earlier collective failed"):
        worker.submit(lambda: None, "allreduce #2")
    release.set()
    worker.close()


def test_failure_in_an_operation_reaches_its_waiter_and_the_next():
    worker = CommThread("t", rank=0, timeout_s=5)
    bad = worker.submit(lambda: 1 / 0, "broadcast #1")
    after = worker.submit(lambda: 42, "barrier #2")
    with pytest.raises(CommError, match="ZeroDivisionError"):
        bad.wait()
    with pytest.raises(CommError, match="an earlier collective failed"):
        after.wait()
    worker.close()


def test_waiting_does_not_spin_a_core():
    import resource

    worker = CommThread("t", rank=0, timeout_s=10)
    handle = worker.submit(lambda: time.sleep(1.0), "slow", np.zeros(1))
    t0 = resource.getrusage(resource.RUSAGE_SELF)
    handle.wait()
    t1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (t1.ru_utime - t0.ru_utime) + (t1.ru_stime - t0.ru_stime)
    assert cpu < 0.1, f"waiting 1 s cost {cpu:.3f} s of CPU"
    worker.close()
    worker.close()
    with pytest.raises(CommError, match="closed"):
        worker.submit(lambda: None, "late")
