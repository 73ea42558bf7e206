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


def test_a_waiter_runs_queued_operations_itself_in_order():
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    ran_on = []
    gate = threading.Event()

    def occupy() -> None:
        gate.wait(5)
        ran_on.append(("first", threading.current_thread().name))

    # the first operation occupies the thread; the waiter must not run anything meanwhile
    first = worker.submit(occupy, "op0")
    time.sleep(0.05)
    later = [worker.submit(lambda i=i: ran_on.append((i, threading.current_thread().name)), f"op{i + 1}")
             for i in range(3)]
    threading.Timer(0.1, gate.set).start()
    later[-1].wait()
    assert [what for what, _ in ran_on] == ["first", 0, 1, 2]
    assert ran_on[0][1] == "t"
    assert all(h.done() for h in [first, *later])
    # nothing queued and the thread idle: the waiter runs its operation itself
    ran_on.clear()
    worker.submit(lambda: ran_on.append(threading.current_thread().name), "op5").wait()
    assert len(ran_on) == 1
    worker.close()


def test_inline_run_is_the_caller_thread_when_the_worker_is_asleep():
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    names = set()
    for _ in range(200):
        worker.submit(lambda: names.add(threading.current_thread().name), "op").wait()
    assert threading.current_thread().name in names  # at least some ran inline
    worker.close()


def test_a_short_wait_timeout_never_runs_inline_and_times_out():
    worker = CommThread("t", rank=1, timeout_s=10, run_in_waiter=True)
    gate = threading.Event()
    blocker = worker.submit(lambda: gate.wait(5), "slow #1")
    queued = worker.submit(lambda: time.sleep(2), "queued #2")
    t0 = time.perf_counter()
    with pytest.raises(CommError, match=r"queued #2\] did not complete within 0.2s"):
        queued.wait(0.2)
    assert time.perf_counter() - t0 < 1.0
    gate.set()
    blocker.wait()
    worker.close()


def test_inline_failure_poisons_later_operations():
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    with pytest.raises(CommError, match="ZeroDivisionError"):
        worker.submit(lambda: 1 / 0, "bad #1").wait()
    with pytest.raises(CommError, match="an earlier collective failed"):
        worker.submit(lambda: None, "after #2")
    worker.close()


def test_has_waiters_while_a_thread_is_blocked():
    worker = CommThread("t", rank=0, timeout_s=10)
    seen = []
    gate = threading.Event()

    def op():
        gate.wait(5)
        seen.append(worker.has_waiters)

    handle = worker.submit(op, "op")
    assert not worker.has_waiters
    threading.Timer(0.1, gate.set).start()
    handle.wait()
    assert seen == [True]
    assert not worker.has_waiters
    worker.close()


def test_close_runs_what_is_queued():
    worker = CommThread("t", rank=0, timeout_s=10)
    seen = []
    handles = [worker.submit(lambda i=i: (time.sleep(0.01), seen.append(i)), f"op{i}") for i in range(5)]
    worker.close()
    assert seen == list(range(5))
    assert all(h.done() for h in handles)


def _name() -> str:
    return threading.current_thread().name


def test_call_runs_on_the_caller_when_idle_and_behind_the_queue_otherwise():
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    assert worker.call(_name, "barrier #1") == threading.current_thread().name
    gate = threading.Event()
    order = []
    first = worker.submit(lambda: (gate.wait(5), order.append("first"))[1], "op #2")
    time.sleep(0.05)  # the thread has taken it
    threading.Timer(0.1, gate.set).start()
    worker.call(lambda: order.append("call"), "barrier #3")
    assert order == ["first", "call"]
    assert first.done()
    worker.close()


def test_call_without_run_in_waiter_goes_through_the_thread():
    worker = CommThread("t", rank=0, timeout_s=10)
    assert worker.call(_name, "barrier #1") == "t"
    worker.close()


def test_a_failed_call_poisons_the_thread_and_names_the_operation():
    worker = CommThread("t", rank=4, timeout_s=10, run_in_waiter=True)
    with pytest.raises(CommError, match=r"rank 4: broadcast #1\] ZeroDivisionError") as info:
        worker.call(lambda: 1 / 0, "broadcast #1")
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(CommError, match="an earlier collective failed"):
        worker.call(lambda: None, "barrier #2")
    worker.close()


def test_the_thread_steps_aside_while_a_waiter_runs_the_queue():
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    gate = threading.Event()
    ran_on = []
    first = worker.submit(lambda: (gate.wait(5), ran_on.append(_name()))[1], "op #1")
    time.sleep(0.05)  # running on the thread
    rest = [worker.submit(lambda: ran_on.append(_name()), f"op #{i}") for i in range(2, 7)]
    threading.Timer(0.1, gate.set).start()
    rest[-1].wait()
    me = threading.current_thread().name
    # the first ran on the thread; after it the thread left the queue to the waiter
    assert ran_on == ["t"] + [me] * 5
    assert first.done() and all(h.done() for h in rest)
    worker.close()


def test_operations_left_when_a_waiter_returns_go_back_to_the_thread():
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    ran_on = {}
    first = worker.submit(lambda: ran_on.setdefault(1, _name()), "op #1")
    second = worker.submit(lambda: ran_on.setdefault(2, _name()), "op #2")
    first.wait()
    # nobody waits for the second: the thread must run it on its own
    deadline = time.monotonic() + 5
    while not second.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert second.done(), "an operation nobody waits for was left in the queue"
    assert ran_on[2] == "t"
    worker.close()


def test_wait_all_runs_the_batch_in_order_and_returns_every_result():
    from tnt_core import wait_all

    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    order = []
    handles = [worker.submit(lambda i=i: (order.append(i), i * i)[1], f"op #{i}") for i in range(10)]
    assert wait_all(handles) == [i * i for i in range(10)]
    assert order == list(range(10))
    assert wait_all([]) == []
    worker.close()


def test_wait_all_raises_the_first_failure_after_the_batch_completed():
    from tnt_core import wait_all

    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    handles = [worker.submit(lambda: 1, "op #1"), worker.submit(lambda: 1 / 0, "op #2"),
               worker.submit(lambda: 3, "op #3")]
    with pytest.raises(CommError, match=r"op #2\] ZeroDivisionError"):
        wait_all(handles)
    assert all(h.done() for h in handles)
    worker.close()


def test_wait_all_times_out_with_comm_error():
    from tnt_core import wait_all

    worker = CommThread("t", rank=1, timeout_s=10, run_in_waiter=True)
    gate = threading.Event()
    handles = [worker.submit(lambda: gate.wait(5), "slow #1"), worker.submit(lambda: None, "op #2")]
    t0 = time.perf_counter()
    with pytest.raises(CommError, match=r"op #2\] did not complete within 0.2s"):
        wait_all(handles, timeout=0.2)
    assert time.perf_counter() - t0 < 1.0
    gate.set()
    worker.close()


def test_two_waiting_threads_each_get_their_operation():
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    gate = threading.Event()
    blocker = worker.submit(lambda: gate.wait(5), "op #1")
    time.sleep(0.05)
    handles = [worker.submit(lambda i=i: i, f"op #{i}") for i in range(2, 8)]
    results = {}

    def waiter(i):
        results[i] = handles[i].wait()

    threads = [threading.Thread(target=waiter, args=(i,)) for i in (5, 1, 3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    gate.set()
    for t in threads:
        t.join(5)
    assert results == {5: 7, 1: 3, 3: 5}
    assert blocker.wait() is True
    worker.close()


def test_wait_all_of_handles_of_different_kinds():
    from tnt_core import CompletedHandle, wait_all

    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    buf = np.zeros(2)
    assert wait_all([CompletedHandle(buf), worker.submit(lambda: 5, "op #1")])[1] == 5
    worker.close()


def _interrupt():
    raise KeyboardInterrupt


def test_ctrl_c_in_an_operation_the_caller_runs_stays_a_keyboard_interrupt():
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    with pytest.raises(KeyboardInterrupt):
        worker.call(_interrupt, "allreduce #1")
    # the collective was abandoned half-way: nothing after it may run
    with pytest.raises(CommError, match=r"an earlier collective failed: .*allreduce #1\] KeyboardInterrupt"):
        worker.call(lambda: None, "allreduce #2")
    worker.close()

    # through the queue: run by this thread (KeyboardInterrupt) or, if it woke first, by
    # the communication thread, which must survive it (the waiter gets CommError)
    worker = CommThread("t", rank=0, timeout_s=10, run_in_waiter=True)
    handle = worker.submit(_interrupt, "allreduce #1")
    with pytest.raises((KeyboardInterrupt, CommError)):
        handle.wait()
    assert handle.done()
    with pytest.raises(CommError, match="KeyboardInterrupt"):
        handle.wait()
    with pytest.raises(CommError, match="an earlier collective failed"):
        worker.submit(lambda: None, "allreduce #2")
    worker.close()
    assert not worker._thread.is_alive()  # closed normally, not killed by the interrupt


def test_the_thread_survives_an_operation_raising_keyboard_interrupt():
    worker = CommThread("t", rank=0, timeout_s=10)  # every operation runs on the thread
    handle = worker.submit(_interrupt, "allreduce #1")
    with pytest.raises(CommError, match=r"allreduce #1\] KeyboardInterrupt"):
        handle.wait()
    assert worker._thread.is_alive()
    worker.close()
