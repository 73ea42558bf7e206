"""Process supervision: start the launcher's processes, stream their output, end the job.

* Output is forwarded line by line as it arrives (the agents already applied the
  master-only / ``[rank]`` prefix policy), never buffered to the end.
* The exit code is the failing rank's exit code (a rank's own code: agents pass it
  through), 0 when all succeed, 128+N when signal N interrupted the launcher.
* The rank named is the one that failed first, not the first to exit: a rank that failed
  because a peer failed exits with ``tnt_core.PEER_FAILURE_EXIT_CODE``,
  often before the rank that caused it has finished printing. On such an exit ``tnt run``
  waits up to ``SETTLE_S`` for a rank that fails with another code and names it, with the
  last line of its error output (its exception); if none does, it names the ranks still
  running (they did not take part in the collective the others failed in: hung), else the
  first rank that exited. Nothing is stopped meanwhile, so the failing rank's traceback
  gets out.
* Under mpirun/srun one process stands for every rank, and it ends with a code of its own
  once a rank failed (Hydra: 9, the signal it killed the others with). The agents report
  each failed rank through the rendezvous store, and those reports may arrive after that
  exit; so the process is named only if none arrives within ``SETTLE_S``. A report also
  outruns the agent's own line about its rank (``[R] tnt: rank R on HOST exited ...``),
  which comes through mpiexec's output: the verdict waits for that line (up to
  ``AGENT_LINE_WAIT_S``), so that it stays the last one.
* When a rank fails, or on SIGINT/SIGTERM/SIGHUP, every other process is asked to end
  (stdin closed, the launcher's stop signal sent to its process group); whatever still
  runs after the grace period is killed. A second Ctrl+C kills at once.
* In an elastic job (:mod:`tnt_cli.elastic`) a failed rank changes the membership
  instead: the next generation goes on without it, processes started for the job (a
  replacement, ranks on discovered slots) join once ready, a rank the stall inspector
  found hung is killed; the job ends only below ``--min-np``.
* A host lost during the job: ssh (``ProcessSpec.lost_connection_code``) ends after its
  agent said the rank started and before it said the rank exited (the agent's status
  lines, :data:`~tnt_cli.agent.STATUS_PREFIX`, read here and never shown). The verdict names
  the host and its ranks, and the other connections to that host are killed at once: a
  closed stdin cannot reach a host that is gone.
* Every process runs in a session of its own, so a terminal's Ctrl+C reaches only
  ``tnt run``, which ends the ranks in order rather than leaving half of them running.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, BinaryIO

from tnt_core import carry_priority

from .agent import PEER_FAILURE_EXIT_CODE, STATUS_PREFIX, describe_exit, exception_text, stated_reason
from .elastic import ElasticJob
from .launchers.base import ProcessSpec

# what signal.signal() returns: the previous handler (None: not installed from Python)
_Handler = Callable[[int, FrameType | None], Any] | int | None

__all__ = ["Supervisor", "exception_text"]

#: extra seconds, beyond the agents' own grace period, before process groups are killed
KILL_MARGIN_S = 2.0
_PR_SET_PDEATHSIG = 1
#: seconds a rank's exit with PEER_FAILURE_EXIT_CODE waits for the rank that failed first,
#: and the exit of a process standing for several ranks (mpirun/srun) for their reports
SETTLE_S = 1.5
#: seconds an exit of mpirun/srun waits at least for reports of its ranks once one came
LAUNCHER_DRAIN_S = 0.5
#: seconds the verdict on an agent's report waits for the agent's line about its rank
AGENT_LINE_WAIT_S = 1.0
#: seconds between two looks of an elastic job's supervisor for a rank the stall
#: inspector found hung (it is then evicted)
HUNG_POLL_S = 1.0
#: seconds the ranks left running get to end on their own once every rank is to restart
#: (the survivors of a pipelined job under ALL write the step in flight first), before
#: they are stopped
RESTART_WAIT_S = 30.0
#: the line an agent under mpirun/srun writes when its rank failed (see agent.Agent.run)
_AGENT_EXIT_LINE = re.compile(rb"^\[(\d+)\] tnt: rank (\d+) on \S+ (?:exited|was killed)")


#: what a connection lost after its rank started means
_WENT_DOWN = "the link to the host or the host itself went down"


def _connection_ended(spec: ProcessSpec, value: int, who: str) -> str:
    tool = os.path.basename(spec.argv[0]) if spec.argv else "launcher"
    return f"its {tool} connection ended (exit {value}) after {who} had started"


class _Sink:
    """A shared output stream written one whole line at a time."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.broken = False

    def write(self, line: bytes) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                self.stream.write(line)
                self.stream.flush()
            except (OSError, ValueError):  # reader went away (tnt run | head)
                self.broken = True


def _pump(pipe: BinaryIO, sink: _Sink, seen: Callable[[bytes], None] | None = None,
          status: Callable[[bytes], None] | None = None) -> None:
    """Forward ``pipe`` to ``sink`` line by line; an agent's status line goes to ``status``."""
    with pipe:
        for line in iter(pipe.readline, b""):
            if status is not None and line.startswith(STATUS_PREFIX):
                status(line[len(STATUS_PREFIX):])
                continue
            sink.write(line if line.endswith(b"\n") else line + b"\n")
            if seen is not None:
                seen(line)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Run ``specs`` to the end and return the job's exit code."""

    def __init__(self, specs: Sequence[ProcessSpec], grace_s: float, *, prog: str = "tnt run",
                 stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 not_arrived: Callable[[], str | None] | None = None,
                 rank_reports: bool = False, elastic: ElasticJob | None = None) -> None:
        self.specs = list(specs)
        #: an elastic job: a rank's failure changes the membership instead of ending the job
        self.elastic = elastic
        self._hosts: dict[str, int] | None = None  # the discovery script's newest answer
        self._next_hung_poll = 0.0
        self._pid = os.getpid()
        self._prctl: Callable[..., int] | None
        try:  # looked up before fork: the child must not load libraries
            self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            self._prctl = None
        #: reads the stall inspector's verdict on a failed wait: which ranks did not arrive
        self.not_arrived = not_arrived
        #: agents report failed ranks through :meth:`rank_failed` (mpirun/srun)
        self.rank_reports = rank_reports
        #: ``(index, exit status)`` of a process standing for several ranks that failed,
        #: named only if no report of its ranks arrives within ``SETTLE_S``
        self.launcher_exit: tuple[int, int] | None = None
        #: ranks whose agent's line about their failure has gone out (mpirun/srun)
        self.agent_lines: set[int] = set()
        self._agent_line = threading.Condition()
        self.grace_s = grace_s
        self.prog = prog
        self.out = _Sink(stdout or sys.stdout.buffer)
        self.err = _Sink(stderr or sys.stderr.buffer)
        self.events: queue.Queue[tuple[str, int, int]] = queue.Queue()
        self.procs: list[subprocess.Popen | None] = []
        #: indexes of started processes whose exit has not been handled yet
        self.running: set[int] = set()
        self.threads: list[threading.Thread] = []
        self.exit_code: int | None = None
        self.stopping_since: float | None = None
        self.killed = False
        #: per process: the last exception line of its error output, its last line at
        #: all (a ``sys.exit("message")``'s reason), its stderr pump
        self.last_exception: dict[int, str] = {}
        self.last_line: dict[int, str] = {}
        #: per rank reported by an agent under mpirun/srun: the reason in its last line
        self.rank_causes: dict[int, str] = {}
        self.err_pumps: dict[int, threading.Thread] = {}
        #: per process whose agent said so (status lines): the host name its rank started
        #: on, and the exit code the agent ended with
        self.agent_started: dict[int, str] = {}
        self.agent_exited: dict[int, int] = {}
        #: failures because a peer failed, in order, before the verdict: (kind, index)
        self.secondary: list[tuple[str, int]] = []
        self.settle_until: float | None = None
        #: an elastic job that cannot go on without a rank lost one: every rank ends, and
        #: ``tnt run`` starts them all again (the line that said so)
        self.restart_all: str | None = None
        #: when the ranks still running are stopped, if they have not ended by then
        self.restart_deadline: float | None = None
        #: such a job's ranks that exited because a peer failed, and when to name them if
        #: the rank that failed first has not exited by then: (index, exit status, deadline)
        self.consequences: list[tuple[int, int, float]] = []
        #: the verdict, held back until the other processes ended and their output was
        #: read, so that it is the last line however their output and their end interleave
        self.verdict: str | None = None

    def say(self, message: str) -> None:
        self.err.write(f"{self.prog}: {message}\n".encode())

    def _conclude(self, message: str) -> None:
        """Name the failure: printed once every process ended (:meth:`_say_verdict`)."""
        if self.verdict is None:
            self.verdict = message

    def _say_verdict(self) -> None:
        verdict, self.verdict = self.verdict, None
        if verdict is not None:
            self.say(verdict)

    def rank_failed(self, rank: int, code: int, last_line: str = "") -> None:
        """Report a failed rank the processes' own exit codes cannot show (thread-safe):
        under mpirun/srun one process stands for all ranks and may not end them.
        ``last_line``: the last line of the rank's error output (its cause, if any)."""
        cause = exception_text(last_line) or stated_reason(last_line, code) if last_line else None
        if cause:
            self.rank_causes[rank] = cause
        self.events.put(("rank-failed", rank, code))

    # -- signals ----------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.events.put(("signal", -1, signum))

    def _install_signals(self) -> dict[signal.Signals, _Handler]:
        previous: dict[signal.Signals, _Handler] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    # -- processes --------------------------------------------------------------------
    def _preexec(self) -> None:
        """In the child between fork and exec: SIGTERM it when tnt run dies, even by
        SIGKILL. mpiexec/srun, in a session of their own, outlived a killed tnt run and
        kept every rank running; on SIGTERM they end their ranks and clean up. And the
        child's session keeps tnt run's priority (``nice tnt run ...``)."""
        carry_priority()
        if self._prctl is not None:
            self._prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != self._pid:  # tnt run died between fork and prctl
            os._exit(143)

    def _start(self, index: int, spec: ProcessSpec) -> subprocess.Popen | None:
        env = dict(os.environ)
        env.update(spec.env)
        try:
            proc = subprocess.Popen(
                spec.argv, env=env, start_new_session=True, preexec_fn=self._preexec,
                stdin=subprocess.PIPE if spec.stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            self.say(f"cannot start {spec.label}: {spec.argv[0]}: {exc.strerror or exc}")
            self.events.put(("exit", index, 127))
            return None
        if spec.stdin is not None and proc.stdin is not None:
            try:
                proc.stdin.write(spec.stdin)
                proc.stdin.flush()
            except OSError:
                pass  # it died at once; its exit code tells why
        def seen(line: bytes) -> None:
            decoded = line.decode(errors="replace").strip()
            if decoded:
                self.last_line[index] = decoded
            text = exception_text(decoded)
            if text is not None:
                self.last_exception[index] = text
            said = _AGENT_EXIT_LINE.match(line)
            if said is not None and said.group(1) == said.group(2):
                with self._agent_line:
                    self.agent_lines.add(int(said.group(1)))
                    self._agent_line.notify_all()

        def status(text: bytes) -> None:
            what, _, value = text.decode(errors="replace").strip().partition(" ")
            if what == "started":
                self.agent_started[index] = value
            elif what == "exited" and value.lstrip("-").isdigit():
                self.agent_exited[index] = int(value)

        for pipe, sink, watch, told in ((proc.stdout, self.out, None, None),
                                        (proc.stderr, self.err, seen, status)):
            t = threading.Thread(target=_pump, args=(pipe, sink, watch, told), daemon=True)
            t.start()
            self.threads.append(t)
        self.err_pumps[index] = t
        self.running.add(index)  # before the waiter can report its exit
        waiter = threading.Thread(target=lambda: self.events.put(("exit", index, proc.wait())),
                                  daemon=True)
        waiter.start()
        return proc

    def _stop_all(self) -> None:
        """Ask every running process to end its ranks."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        for spec, proc in zip(self.specs, self.procs):
            if proc is None or proc.poll() is not None:
                continue
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            if spec.stop_signal is not None:
                _killpg(proc.pid, spec.stop_signal)

    def _kill_all(self) -> None:
        self.killed = True
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                _killpg(proc.pid, signal.SIGKILL)

    def run(self) -> int:
        previous = self._install_signals()
        try:
            return self._run()
        finally:
            self._say_verdict()  # if _run did not get to it
            self._stop_all()
            self._kill_all()  # nothing may outlive tnt run, whatever happened above
            for sig, handler in previous.items():
                if handler is not None:  # None: the handler was not Python's; nothing to put back
                    signal.signal(sig, handler)

    def _run(self) -> int:
        for index, spec in enumerate(list(self.specs)):  # an elastic job may add some meanwhile
            self.procs.append(self._start(index, spec))
            if not self.events.empty() and self.stopping_since is None:
                self._handle_pending()
            if self.stopping_since is not None:
                break
        while self.running or (self.launcher_exit is not None and self.stopping_since is None):
            try:
                kind, index, value = self.events.get(timeout=0.1)
            except queue.Empty:
                self._escalate()
                continue
            self._handle(kind, index, value)
            self._escalate()
        settled = self.stopping_since is None and self.restart_deadline is None
        if self.secondary and settled:
            self._name_secondary()  # every process ended within the settle time
        if self.consequences and settled:
            self._depart(*self.consequences[0][:2])  # likewise, in an elastic job
        for t in self.threads:  # the processes' output, read to its end
            t.join(timeout=2.0)
        self._say_verdict()
        return self.exit_code if self.exit_code is not None else 0

    def _handle_pending(self) -> None:
        while True:
            try:
                kind, index, value = self.events.get_nowait()
            except queue.Empty:
                return
            self._handle(kind, index, value)

    def _handle(self, kind: str, index: int, value: int) -> None:
        if kind == "exit":
            self.running.discard(index)
        if kind == "signal":
            name = signal.Signals(value).name
            if self.stopping_since is None:
                self.say(f"{name}: ending all ranks (press Ctrl+C again to kill them at once)")
                if self.exit_code is None:
                    self.exit_code = 128 + value
                self._stop_all()
            elif not self.killed:
                self.say(f"{name} again: killing all ranks")
                self._kill_all()
            return
        if kind == "hosts":
            self._hosts_changed()
            return
        code = value if value >= 0 else 128 - value
        if self.restart_deadline is not None:
            return  # every rank restarts: the others end on their own, as expected
        if code == 0 and kind == "exit" and self.elastic is not None and self.stopping_since is None:
            done, doomed = self.elastic.finished(index)
            self._end_unjoined(doomed)
            if done:
                self._stop_all()  # every member is done: those starting up have nothing to join
        if code == 0 or self.stopping_since is not None:
            return
        if kind == "exit" and self.elastic is not None:
            if index in self.elastic.ended:
                return
            if code == PEER_FAILURE_EXIT_CODE and self.elastic.restart_all_reason() is not None:
                # every rank restarts for the rank that died, whose exit may come a moment
                # after this consequence's: name it, as a job that is not elastic does
                self.consequences.append((index, value, time.monotonic() + SETTLE_S))
                return
            self._depart(index, value)
            return
        if kind == "exit" and self.rank_reports and len(self.specs[index].ranks) > 1:
            # mpiexec/srun ended because a rank failed: the ranks' reports say which and
            # why, and may still be on their way through the store
            if self.launcher_exit is None:
                self.launcher_exit = (index, value)
                # its agents reported before they exited: what is in the store arrives in
                # moments, all the more when some report already came
                wait = SETTLE_S if self.settle_until is None else LAUNCHER_DRAIN_S
                self.settle_until = max(self.settle_until or 0.0, time.monotonic() + wait)
            return
        if code == PEER_FAILURE_EXIT_CODE:  # a consequence: wait a little for the cause
            self.secondary.append((kind, index))
            if self.settle_until is None:
                self.settle_until = time.monotonic() + SETTLE_S
            return
        self._fail(kind, index, value)

    # -- elastic jobs -----------------------------------------------------------------------
    def _depart(self, index: int, value: int) -> None:
        """Process ``index`` of an elastic job failed: the next generation goes on without
        it (a replacement joins later, while restarts last), or the job ends below --min-np."""
        assert self.elastic is not None
        cause = self._cause(index, value)  # not waited for: the survivors wait on us
        if self._lost_connection(index, value):
            why = (f"was lost: {_connection_ended(self.specs[index], value, 'it')}; "
                   f"{_WENT_DOWN}")
        else:
            why = describe_exit(value) + (f" ({cause})" if cause else "")
        reason = self.elastic.restart_all_reason()
        if reason is not None:
            self._restart_all(index, value, why, reason)
            return
        before = self.elastic.generation
        procs, error = self.elastic.change({index: why})
        if error is not None:
            self.exit_code = value if value >= 0 else 128 - value
            self._conclude(error)
            self._stop_all()
            return
        self._say_change(f"{self.specs[index].label} {why}", before)
        self._start_members(procs)

    def _restart_all(self, index: int, value: int, why: str, reason: str) -> None:
        """A rank of a job that cannot go on without it (``reason``) died: every rank ends,
        to be started again while ``--max-restarts`` lasts; else the job fails as a job
        that is not elastic does."""
        assert self.elastic is not None
        label = self.specs[index].label
        if not self.elastic.restart_all():
            self.exit_code = value if value >= 0 else 128 - value
            limit = self.elastic.limits.max_restarts
            used = f", and --max-restarts {limit} is used up" if limit else ""
            self._conclude(f"{label} {why}; {reason}{used}; ending the other ranks")
            self._stop_all()
            return
        self.restart_all = (f"{label} {why}; {reason}: restarting every rank (restart "
                            f"{self.elastic.restarts} of {self.elastic.limits.max_restarts})")
        self.say(self.restart_all)
        self.restart_deadline = time.monotonic() + RESTART_WAIT_S  # they end on their own

    def _end_unjoined(self, members: Sequence[int]) -> None:
        """End members the job finished without (see ``ElasticJob.finished``)."""
        for member in members:
            proc = self.procs[member] if member < len(self.procs) else None
            if proc is not None and proc.poll() is None:
                self.say(f"{self.specs[member].label}: the job finished before it could join; "
                         "ending it")
                _killpg(proc.pid, signal.SIGKILL)

    def _say_change(self, what: str, before: int) -> None:
        assert self.elastic is not None
        if self.elastic.generation != before:
            what += (f"; going on with {len(self.elastic.members)} rank(s), generation "
                     f"{self.elastic.generation}")
        self.say(what)

    def _start_members(self, procs: Sequence[ProcessSpec]) -> None:
        """Start processes for the job; they join once ready (:meth:`_elastic_tick`)."""
        if procs:
            self.say(f"starting {', '.join(p.label for p in procs)}; "
                     f"{'they join' if len(procs) > 1 else 'it joins'} once ready")
        for spec in procs:
            index = len(self.specs)
            self.specs.append(spec)
            self.procs.append(self._start(index, spec))

    def hosts_changed(self, hosts: dict[str, int]) -> None:
        """The host discovery script's new answer (thread-safe)."""
        self._hosts = hosts
        self.events.put(("hosts", -1, 0))

    def _hosts_changed(self) -> None:
        if self.elastic is None or self._hosts is None or self.stopping_since is not None:
            return
        doomed, procs = self.elastic.grow_or_shrink(self._hosts)
        for member in doomed:
            proc = self.procs[member]
            if proc is not None and proc.poll() is None:
                self.say(f"{self.specs[member].label}: its host left the discovered hosts; "
                         "ending it")
                _killpg(proc.pid, signal.SIGKILL)
        self._start_members(procs)

    def _elastic_tick(self) -> None:
        """Members starting up that are ready join in a new generation; a rank the stall
        inspector found hung is evicted."""
        if self.elastic is None or self.stopping_since is not None or self.restart_deadline is not None:
            return
        if self.consequences and time.monotonic() >= self.consequences[0][2]:
            index, value, _ = self.consequences[0]  # no other rank's exit came: it is named
            self._depart(index, value)
            return
        if self.elastic.pending:
            before = self.elastic.generation
            joined, error = self.elastic.take_ready()
            if error is not None:
                self.exit_code = 1
                self._conclude(error)
                self._stop_all()
                return
            if joined is not None:
                names = ", ".join(self.specs[joined.members[r]].label for r in joined.joined)
                self._say_change(f"{names} joined", before)
        self._evict_hung()

    def _evict_hung(self) -> None:
        """In an elastic job, a rank the stall inspector found hung (it did not arrive at
        a collective within TNT_TIMEOUT_S) is killed: its exit changes the membership."""
        now = time.monotonic()
        if self.elastic is None or now < self._next_hung_poll:
            return
        self._next_hung_poll = now + HUNG_POLL_S
        found = self.elastic.take_hung()
        if found is None:
            return
        members, text = found
        for member in members:
            proc = self.procs[member] if member < len(self.procs) else None
            if proc is not None and proc.poll() is None:
                self.say(f"{self.specs[member].label}: evicted, {text}")
                _killpg(proc.pid, signal.SIGKILL)

    def _fail(self, kind: str, index: int, value: int) -> None:
        """Name the failure of ``index`` (exit status / reported code ``value``), end the job."""
        code = value if value >= 0 else 128 - value
        self.exit_code = code
        if kind == "rank-failed":  # its agent's line about it may still be on its way
            with self._agent_line:
                self._agent_line.wait_for(lambda: index in self.agent_lines, AGENT_LINE_WAIT_S)
        if kind == "exit" and self._lost_connection(index, value):
            self._lost_host(index, value)
            return
        started = index in self.agent_started  # then ssh did reach the host
        hint = self.specs[index].failure_hints.get(code) if kind == "exit" and not started else None
        notes = "; ".join(n for n in (hint, self._exception(kind, index, value)) if n)
        self._conclude(f"{self._label(kind, index)} failed: {describe_exit(value)}"
                       + (f" ({notes})" if notes else "") + self._ending(kind))
        self._stop_all()

    def _lost_connection(self, index: int, value: int) -> bool:
        """Whether process ``index`` (exit status ``value``) lost its host: the launching
        tool's connection ended after the agent said the rank started and before it said
        the rank exited."""
        spec = self.specs[index]
        if spec.lost_connection_code is None or value != spec.lost_connection_code:
            return False
        pump = self.err_pumps.get(index)
        if pump is not None:  # the agent's last status line, if it came, is read by now
            pump.join(timeout=1.0)
        return index in self.agent_started and index not in self.agent_exited

    def _lost_host(self, index: int, value: int) -> None:
        """Name the lost host and its ranks; kill the other connections to it (nothing
        reaches them any more), ask the rest to end."""
        host = self.specs[index].host
        same = [i for i, spec in enumerate(self.specs) if spec.host == host]
        ranks = sorted(r for i in same for r in self.specs[i].ranks)
        name = next((self.agent_started[i] for i in same if i in self.agent_started), "")
        where = f"{host} ({name})" if name and name != host else host
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        ended = _connection_ended(self.specs[index], value, "they" if len(ranks) > 1 else "it")
        self._conclude(f"lost host {where} during the job ({which}): {ended}; {_WENT_DOWN}"
                       f"{self._ending('exit')}")
        for i in same:
            proc = self.procs[i] if i < len(self.procs) else None
            if proc is not None and proc.poll() is None:
                _killpg(proc.pid, signal.SIGKILL)
        self._stop_all()

    def _label(self, kind: str, index: int) -> str:
        return f"rank {index}" if kind == "rank-failed" else self.specs[index].label

    def _ending(self, kind: str) -> str:
        return "; ending the other ranks" if len(self.specs) > 1 or kind == "rank-failed" else ""

    def _exception(self, kind: str, index: int, value: int | None = None) -> str | None:
        """The exception that process ``index`` printed last (its output read to the end),
        or for an exit ``value`` of 1 or 2 without one the reason in its last line."""
        if kind == "rank-failed":
            return self.rank_causes.get(index)
        if kind != "exit":
            return None
        pump = self.err_pumps.get(index)
        if pump is not None:
            pump.join(timeout=1.0)
        return self._cause(index, value)

    def _cause(self, index: int, value: int | None) -> str | None:
        """What process ``index`` said of its end: its last exception, else (exit status
        ``value`` 1 or 2) its last line, the message of a ``sys.exit("...")``."""
        cause = self.last_exception.get(index)
        if cause is None and value is not None:
            cause = stated_reason(self.last_line.get(index, ""), value)
        return cause

    def _name_secondary(self) -> None:
        """Only failures because a peer failed, for ``SETTLE_S``: name the ranks still
        running, which did not take part (hung), else the first rank that failed."""
        self.exit_code = 1  # what the rank's Python would have exited with
        kind, index = self.secondary[0]
        first = self._label(kind, index)
        cause = self._exception(kind, index)
        waiting = f"{first} failed waiting for it" + (f" ({cause})" if cause else "")
        verdict = self._stall_verdict()
        hung = [i for i in sorted(self.running) if len(self.specs[i].ranks) == 1]
        if verdict is not None:  # the stall inspector knows who did not arrive, and where
            text, several, seen = verdict  # the waiting rank's CommError is just above
            self._conclude(f"{text}; {first} failed waiting for {'them' if several else 'it'}"
                           f"{'; ' + seen if seen else ''}{self._ending(kind)}")
        elif hung and all(k == "exit" for k, _ in self.secondary):
            names = [self.specs[i].label for i in hung]
            if len(names) > 1:
                waiting = waiting.replace("waiting for it", "waiting for them")
            self._conclude(f"{', '.join(names)} did not take part in a collective (hung or too "
                           f"slow?): {waiting}{self._ending(kind)}")
        else:
            self._conclude(f"{first} failed first, in a collective" + (f" ({cause})" if cause else "")
                           + self._ending(kind))
        self._stop_all()

    def _stall_verdict(self) -> tuple[str, bool, str] | None:
        """``(text, several ranks, where last seen)`` of the stall inspector's record of a
        failed wait (tnt_core.NOT_ARRIVED_KEY)."""
        if self.not_arrived is None:
            return None
        try:
            record = json.loads(self.not_arrived() or "null")
            if not record:
                return None
            return str(record["text"]), len(record["ranks"]) > 1, str(record.get("seen", ""))
        except (ValueError, KeyError, TypeError):
            return None

    def _escalate(self) -> None:
        if self.restart_deadline is not None and self.stopping_since is None \
                and time.monotonic() >= self.restart_deadline:
            self._stop_all()  # a rank that did not end on its own
        self._elastic_tick()
        if self.stopping_since is None and self.settle_until is not None \
                and time.monotonic() >= self.settle_until:
            if self.launcher_exit is not None:  # what it printed last goes out first
                pump = self.err_pumps.get(self.launcher_exit[0])
                if pump is not None:
                    pump.join(timeout=1.0)
            if self.secondary:
                self._name_secondary()
            elif self.launcher_exit is not None:  # no rank reported: the process is the cause
                self._fail("exit", *self.launcher_exit)
        if self.stopping_since is None or self.killed:
            return
        if time.monotonic() - self.stopping_since > self.grace_s + KILL_MARGIN_S:
            self._kill_all()
