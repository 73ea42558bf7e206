"""Failure attribution: ``tnt run``'s last line names the rank that failed first.

A rank that fails because a peer failed exits with ``PEER_FAILURE_EXIT_CODE`` and says
why in one line; the launcher names the rank that caused it, with its exception, even
when that rank is the last to exit, or the rank that hangs.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from io import BytesIO

import pytest

import tnt_core
from tnt_cli import agent
from tnt_cli.launchers.base import ProcessSpec
from tnt_cli.run import _not_arrived_reader, _watch_rank_failures
from tnt_cli.supervisor import SETTLE_S, Supervisor, exception_text
from tnt_core import NOT_ARRIVED_KEY, StoreClient, StoreServer

pytestmark = pytest.mark.timeout(60)


def _last(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_the_exit_code_for_a_peers_failure_is_the_same_on_both_sides():
    assert agent.PEER_FAILURE_EXIT_CODE == tnt_core.PEER_FAILURE_EXIT_CODE


@pytest.mark.parametrize(("line", "text"), [
    ("ValueError: boom", "ValueError: boom"),
    ("[1] tnt_core.CommError: [rank 1: allreduce #2] x", "CommError: [rank 1: allreduce #2] x"),
    ("KeyboardInterrupt", "KeyboardInterrupt"),
    ("  File \"x.py\", line 3, in <module>", None),
    ("Error: not an exception line", None),
    ("epoch 1/3: loss 0.5", None),
])
def test_exception_text(line, text):
    assert exception_text(line) == text


def _supervise(*scripts: str, stdin: bytes | None = None) -> tuple[int, str, float]:
    specs = [ProcessSpec(argv=[sys.executable, "-c", s], host="localhost", ranks=(r,), specs=[],
                         stdin=stdin)
             for r, s in enumerate(scripts)]
    err = BytesIO()
    start = time.monotonic()
    code = Supervisor(specs, grace_s=1.0, stdout=BytesIO(), stderr=err).run()
    return code, err.getvalue().decode(), time.monotonic() - start


def test_a_consequence_that_exits_first_is_not_named():
    code, err, _ = _supervise(
        f"import sys; print('CommError: peer 1 closed', file=sys.stderr); "
        f"sys.exit({agent.PEER_FAILURE_EXIT_CODE})",
        "import time; time.sleep(0.4); raise ValueError('boom')")
    assert code == 1
    assert _last(err) == ("tnt run: rank 1 on localhost failed: exited with code 1 "
                          "(ValueError: boom); ending the other ranks")
    assert "Traceback" in err  # the cause's own traceback got out before the verdict


@pytest.mark.parametrize(("exit_call", "said"), [
    ("sys.exit('no data in ./data: run get_data.py first')",
     "exited with code 1 (no data in ./data: run get_data.py first)"),
    ("print('prog: error: argument --epochs: invalid int', file=sys.stderr); sys.exit(2)",
     "exited with code 2 (prog: error: argument --epochs: invalid int)"),
    # another code does not say its reason in its last line: nothing is quoted
    ("print('epoch 1/3', file=sys.stderr); sys.exit(3)", "exited with code 3"),
])
def test_a_rank_that_exits_saying_why_is_quoted(exit_call, said):
    code, err, _ = _supervise("import time; time.sleep(5)", f"import sys; {exit_call}")
    assert _last(err) == f"tnt run: rank 1 on localhost failed: {said}; ending the other ranks"
    assert code == int(said.split()[3])


def test_the_verdict_is_the_last_line_even_when_a_peer_prints_while_it_ends():
    # rank 0 prints its CommError only once told to end (its stdin closes, as an agent's
    # does): after the verdict on rank 1 was known
    code, err, _ = _supervise(
        "import sys; sys.stdin.read(); "
        "print('CommError: rank 1 exited during the allreduce', file=sys.stderr, flush=True); "
        f"sys.exit({agent.PEER_FAILURE_EXIT_CODE})",
        "import os, time; time.sleep(0.3); os._exit(3)", stdin=b"")
    assert code == 3
    assert "CommError: rank 1 exited during the allreduce" in err
    assert _last(err) == "tnt run: rank 1 on localhost failed: exited with code 3; ending the other ranks"


def test_the_rank_still_running_is_named_when_only_consequences_failed():
    code, err, took = _supervise(
        f"import sys; sys.exit({agent.PEER_FAILURE_EXIT_CODE})",
        "import time; time.sleep(60)",
        f"import sys, time; time.sleep(0.2); sys.exit({agent.PEER_FAILURE_EXIT_CODE})")
    assert code == 1
    assert _last(err).startswith("tnt run: rank 1 on localhost did not take part in a collective")
    assert "rank 0 on localhost failed waiting for it" in _last(err)
    assert took < SETTLE_S + 4.0


@pytest.mark.parametrize(("said", "verdict"), [
    ((), "rank 1 on node1.invalid failed: exited with code 255 (ssh could not reach "
         "node1.invalid? `ssh node1.invalid true` must work without a prompt); ending the other ranks"),
    (("started node1",), "lost host node1.invalid (node1) during the job (rank 1): its ssh "
                         "connection ended (exit 255) after it had started; the link to the host "
                         "or the host itself went down; ending the other ranks"),
    (("started node1", "exited 255"), "rank 1 on node1.invalid failed: exited with code 255; "
                                      "ending the other ranks"),
], ids=["never-reached", "lost", "rank-exited-255"])
def test_an_ssh_exit_255_is_told_by_what_the_agent_said(said, verdict, tmp_path):
    """ssh's 255: no rank started (ssh never reached the host), the rank started and the
    connection ended (the host was lost), or the agent said its rank exited with 255."""
    ssh = tmp_path / "ssh"  # a Python named ssh stands for it
    ssh.symlink_to(sys.executable)
    lines = "".join(f"sys.stderr.buffer.write({line!r}); "
                    for line in (agent.STATUS_PREFIX + s.encode() + b"\n" for s in said))
    remote = ProcessSpec(argv=[str(ssh), "-c", f"import os, sys; {lines}sys.stderr.flush(); "
                               "os._exit(255)"],
                         host="node1.invalid", ranks=(1,), specs=[], lost_connection_code=255,
                         failure_hints={255: "ssh could not reach node1.invalid? `ssh node1.invalid "
                                             "true` must work without a prompt"})
    local = ProcessSpec(argv=[sys.executable, "-c", "import sys; sys.stdin.read()"], host="localhost",
                        ranks=(0,), specs=[], stdin=b"")
    err = BytesIO()
    code = Supervisor([local, remote], grace_s=1.0, stdout=BytesIO(), stderr=err).run()
    assert code == 255
    text = err.getvalue().decode()
    assert "tnt-agent" not in text  # status lines are read, never shown
    assert text.strip().splitlines() == [f"tnt run: {verdict}"]


def test_only_consequences_and_nothing_running_names_the_first():
    code, err, _ = _supervise(
        f"import sys; sys.exit({agent.PEER_FAILURE_EXIT_CODE})",
        f"import sys, time; time.sleep(0.2); sys.exit({agent.PEER_FAILURE_EXIT_CODE})")
    assert code == 1
    assert _last(err) == "tnt run: rank 0 on localhost failed first, in a collective; ending the other ranks"


def test_the_rank_that_raised_is_named_not_the_peer_that_exited_first(run_tnt, h):
    pytest.importorskip("tnt_comm_gloo")
    for _ in range(3):  # the peer's CommError usually ends its process first
        res = run_tnt("-n", "2", "--backend", "gloo", "--timeout", "20", "--",
                      h.rank_script("peer_failure.py"), env={"TNT_TEST_FAIL_RANK": "1"}, timeout=30)
        assert res.returncode == 1, res.stderr
        assert _last(res.stderr) == ("tnt run: rank 1 on localhost failed: exited with code 1 "
                                     "(ValueError: boom); ending the other ranks"), res.stderr
        assert "[1] ValueError: boom" in res.stderr  # the hidden rank's traceback is shown
        # the consequence is one line, not a traceback
        assert res.stderr.count("Traceback") == 1, res.stderr
        comm = [line for line in res.stderr.splitlines() if "CommError" in line]
        assert len(comm) <= 1 and all(line.startswith("tnt_core.CommError: [rank 0: ")
                                      for line in comm), res.stderr


def test_the_stall_inspectors_verdict_names_the_ranks_that_did_not_arrive():
    """What a waiting rank's stall inspector left in the store (tnt_core.NOT_ARRIVED_KEY) is the
    verdict, also where processes cannot tell (mpirun/srun: one process for all ranks)."""
    record = {"ranks": [2], "text": "rank 2 did not arrive at allreduce #7 within 3s (hung or too slow?)",
              "seen": "last seen: rank 2 (epoch 1, step 4, fit; alive, heartbeat 1s ago)"}
    specs = [ProcessSpec(argv=[sys.executable, "-c", f"import sys; sys.exit({agent.PEER_FAILURE_EXIT_CODE})"],
                         host="localhost", ranks=(0,), specs=[]),
             ProcessSpec(argv=[sys.executable, "-c", "import time; time.sleep(60)"],
                         host="localhost", ranks=(1,), specs=[])]
    err = BytesIO()
    code = Supervisor(specs, grace_s=1.0, stdout=BytesIO(), stderr=err,
                      not_arrived=lambda: json.dumps(record)).run()
    assert code == 1
    assert _last(err.getvalue().decode()) == (
        "tnt run: rank 2 did not arrive at allreduce #7 within 3s (hung or too slow?); rank 0 on "
        "localhost failed waiting for it; last seen: rank 2 (epoch 1, step 4, fit; alive, "
        "heartbeat 1s ago); ending the other ranks")


def test_an_agent_reports_its_ranks_cause():
    sup = Supervisor([], grace_s=1.0, stdout=BytesIO(), stderr=BytesIO())
    sup.rank_failed(3, 1, "[3] ValueError: boom")
    assert sup.rank_causes == {3: "ValueError: boom"}


def test_the_hung_rank_is_named(run_tnt, h):
    started = time.monotonic()
    res = run_tnt("-n", "3", "--backend", "store", "--timeout", "3", "--",
                  h.rank_script("peer_failure.py"), env={"TNT_TEST_HANG_RANK": "1"}, timeout=30)
    took = time.monotonic() - started
    assert res.returncode == 1, res.stderr
    assert _last(res.stderr).startswith(
        "tnt run: rank 1 did not arrive at allreduce #"), res.stderr
    assert "within 3s (hung or too slow?); rank " in _last(res.stderr)
    assert "; last seen: rank 1 (" in _last(res.stderr)
    assert took < 3 + SETTLE_S + 8, f"the job took {took:.1f}s to end"



def test_a_hidden_ranks_stall_report_is_shown(run_tnt, h):
    """Rank 0 hangs: rank 1, the lowest waiting rank, reports the stall. Its output is
    hidden (not the master, no --output-on-all-devices), yet the tnt log line passes."""
    res = run_tnt("-n", "3", "--backend", "store", "--timeout", "4", "-x", "TNT_STALL_WARN_S=1",
                  "--", h.rank_script("peer_failure.py"), env={"TNT_TEST_HANG_RANK": "0"},
                  timeout=30)
    assert res.returncode == 1, res.stderr
    reports = [line for line in res.stderr.splitlines() if "WARNING tnt.stall: stall:" in line]
    assert len(reports) == 1 and reports[0].startswith("[tnt 1] WARNING tnt.stall: stall: rank 1 "
                                                       "has waited "), res.stderr
    # 3 allreduces done, each after its agreement allreduce (the collective agreement): 6 operations
    assert "not arrived: rank 0 (outside any collective, after #6; alive, heartbeat " in reports[0]
    assert _last(res.stderr).startswith("tnt run: rank 0 did not arrive at allreduce #7 within 4s"), \
        res.stderr


@pytest.mark.parametrize(("line", "shown"), [
    (b"[tnt 1] WARNING tnt.stall: stall: rank 1 has waited 60s", True),
    (b"[tnt 12] ERROR tnt: boom", True),
    (b"[tnt 1] INFO tnt: chatter", False),
    (b"WARNING: something else", False),
])
def test_which_lines_of_a_hidden_rank_pass(line, shown):
    assert bool(agent.LOG_LINE_OF_TNT.match(line)) is shown


STALL_RECORD = {"ranks": [1], "text": "rank 1 did not arrive at allreduce #9 within 10s (hung or too slow?)",
                "seen": "last seen: rank 1 (outside any collective, after #8; alive, heartbeat 0s ago)"}


@pytest.mark.parametrize(("reports", "stalled", "expected"), [
    # rank 1 hangs: ranks 0 and 2 time out and exit 75, then Hydra ends rank 1 and exits 9
    ([(2, 75, "[2] tnt_core.CommError: [rank 2: allreduce #9] did not complete")], True,
     "tnt run: rank 1 did not arrive at allreduce #9 within 10s (hung or too slow?); rank 2 "
     "failed waiting for it; last seen: rank 1 (outside any collective, after #8; alive, "
     "heartbeat 0s ago); ending the other ranks"),
    # rank 1 raises; rank 2's consequence is reported first, the cause after it
    ([(2, 75, "CommError: [rank 2: allreduce #9] peer closed"), (1, 1, "ValueError: boom")], False,
     "tnt run: rank 1 failed: exited with code 1 (ValueError: boom); ending the other ranks"),
    # no rank reported anything: mpiexec itself is the cause
    ([], False, "tnt run: ranks 0-2 via "),
])
def test_under_mpirun_the_ranks_reports_outweigh_mpiexecs_own_exit(reports, stalled, expected):
    """mpiexec ends with a code of its own (9) when a rank fails; the agents' reports, which
    come through the store and often after that exit, name the rank (a race: the job once
    blamed "ranks 0-2 via mpiexec" instead of the hung rank)."""
    with StoreServer() as store:
        env = {"TNT_RENDEZVOUS": store.url, "TNT_RENDEZVOUS_KEY": store.key}
        mpiexec = ProcessSpec(argv=[sys.executable, "-c", "import sys; sys.exit(9)"], host="",
                              ranks=(0, 1, 2), specs=[])
        err = BytesIO()
        sup = Supervisor([mpiexec], grace_s=1.0, stdout=BytesIO(), stderr=err,
                         not_arrived=_not_arrived_reader(store), rank_reports=True)
        _watch_rank_failures(store, sup)

        def agents() -> None:
            time.sleep(0.3)  # after mpiexec's exit
            if stalled:
                with StoreClient(*store.address, store.key) as client:
                    client.set(NOT_ARRIVED_KEY, json.dumps(STALL_RECORD).encode())
            for rank, code, line in reports:
                agent.report_failure(env, rank, code, line)

        threading.Thread(target=agents, daemon=True).start()
        code = sup.run()
    last = _last(err.getvalue().decode())
    assert last.startswith(expected), last
    assert code == {True: 1, False: 1 if reports else 9}[stalled]


def test_under_mpirun_rank_0s_exception_is_in_the_verdict(run_tnt, h):
    """The master's error output goes straight out, so its agent once reported no cause."""
    from tnt_cli.launchers.mpirun import find_mpiexec

    if find_mpiexec() is None:
        pytest.skip("no mpiexec (pip install mpich)")
    res = run_tnt("--launcher", "mpirun", "-n", "2", "--backend", "store", "--timeout", "20", "--",
                  h.rank_script("peer_failure.py"), env={"TNT_TEST_FAIL_RANK": "0"}, timeout=40)
    assert res.returncode == 1, res.stderr
    assert _last(res.stderr) == ("tnt run: rank 0 failed: exited with code 1 (ValueError: boom); "
                                 "ending the other ranks"), res.stderr
