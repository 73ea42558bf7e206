"""A rank that dies of a peer's failure: one line, at-exit handlers run, exit code 75."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tnt_core import PEER_FAILURE_EXIT_CODE, CommError
from tnt_core._peer_failure import comm_error_of

pytestmark = pytest.mark.timeout(60)

PRELUDE = """
import atexit, sys
from tnt_core import CommError
from tnt_core._peer_failure import install_excepthook
install_excepthook()
atexit.register(lambda: print("at exit", flush=True))
"""


def _run(body: str, **env: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **env})


def test_an_uncaught_comm_error_is_one_line_and_its_own_exit_code():
    res = _run('raise CommError("rank 1 (pid 7) closed its communicator", rank=0, operation="allreduce #2")')
    assert res.returncode == PEER_FAILURE_EXIT_CODE
    assert res.stderr.splitlines() == [
        "tnt_core.CommError: [rank 0: allreduce #2] rank 1 (pid 7) closed its communicator"]
    assert res.stdout == "at exit\n"


def test_an_exception_after_a_failed_collective_counts_as_its_consequence():
    # a framework (tf.numpy_function) re-raises the CommError as its own type, unchained
    res = _run("""
        try:
            raise CommError("peer gone", rank=1)
        except CommError:
            pass
        raise RuntimeError("UnknownError: CommError: peer gone")
    """)
    assert res.returncode == PEER_FAILURE_EXIT_CODE
    assert res.stderr.splitlines() == ["tnt_core.CommError: [rank 1] peer gone"]


def test_other_exceptions_keep_their_traceback_and_exit_code():
    res = _run('raise ValueError("boom")')
    assert res.returncode == 1
    assert "Traceback" in res.stderr and res.stderr.rstrip().endswith("ValueError: boom")
    assert res.stdout == "at exit\n"
    res = _run("sys.exit(3)")
    assert res.returncode == 3


def test_comm_error_of_follows_the_chain():
    inner = CommError("x", rank=0)
    try:
        try:
            raise inner
        except CommError as exc:
            raise KeyError("outer") from exc
    except KeyError as outer:
        assert comm_error_of(outer) is inner


def test_a_handled_comm_error_explains_no_later_failure(monkeypatch):
    """An elastic rank's membership watcher polls the store with timeouts (each a CommError)
    and a recovered failure is over: neither may turn a later ValueError of the user's into
    a peer's failure."""
    import tnt_core._errors as errors

    monkeypatch.setattr(errors, "_first_comm_error", [])  # a fresh process's
    polled = CommError("keys were not set within the timeout", operation="wait")
    errors.handled(polled)
    assert comm_error_of(ValueError("the user's own")) is None
    failed = CommError("peer 2 closed the connection", rank=0)
    assert comm_error_of(ValueError("after it")) is failed
    errors.handled()  # recovered
    assert comm_error_of(ValueError("later")) is None
