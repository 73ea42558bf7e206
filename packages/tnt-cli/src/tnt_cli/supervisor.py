"""Process supervision: start the launcher's processes, stream their output, end the job.

* Output is forwarded line by line as it arrives (the agents already applied the
  master-only / ``[rank]`` prefix policy), never buffered to the end.
* The exit code is the first failing process's exit code (a rank's own code: agents
  pass it through), 0 when all succeed, 128+N when signal N interrupted the launcher.
* When a rank fails, or on SIGINT/SIGTERM/SIGHUP, every other process is asked to end
  (stdin closed, the launcher's stop signal sent to its process group); whatever still
  runs after the grace period is killed. A second Ctrl+C kills at once.
* Every process runs in a session of its own, so a terminal's Ctrl+C reaches only
  ``tnt run``, which ends the ranks in order rather than leaving half of them running.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, BinaryIO

from .agent import describe_exit
from .launchers.base import ProcessSpec

# what signal.signal() returns: the previous handler (None: not installed from Python)
_Handler = Callable[[int, FrameType | None], Any] | int | None

__all__ = ["Supervisor"]

#: extra seconds, beyond the agents' own grace period, before process groups are killed
KILL_MARGIN_S = 2.0


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


def _pump(pipe: BinaryIO, sink: _Sink) -> None:
    with pipe:
        for line in iter(pipe.readline, b""):
            sink.write(line if line.endswith(b"\n") else line + b"\n")


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Run ``specs`` to the end and return the job's exit code."""

    def __init__(self, specs: Sequence[ProcessSpec], grace_s: float, *, prog: str = "tnt run",
                 stdout: BinaryIO | None = None, stderr: BinaryIO | None = None) -> None:
        self.specs = list(specs)
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

    def say(self, message: str) -> None:
        self.err.write(f"{self.prog}: {message}\n".encode())

    def rank_failed(self, rank: int, code: int) -> None:
        """Report a failed rank the processes' own exit codes cannot show (thread-safe):
        under mpirun/srun one process stands for all ranks and may not end them."""
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
    def _start(self, index: int, spec: ProcessSpec) -> subprocess.Popen | None:
        env = dict(os.environ)
        env.update(spec.env)
        try:
            proc = subprocess.Popen(
                spec.argv, env=env, start_new_session=True,
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
        for pipe, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
            t = threading.Thread(target=_pump, args=(pipe, sink), daemon=True)
            t.start()
            self.threads.append(t)
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
            self._stop_all()
            self._kill_all()  # nothing may outlive tnt run, whatever happened above
            for sig, handler in previous.items():
                if handler is not None:  # None: the handler was not Python's; nothing to put back
                    signal.signal(sig, handler)

    def _run(self) -> int:
        for index, spec in enumerate(self.specs):
            self.procs.append(self._start(index, spec))
            if not self.events.empty() and self.stopping_since is None:
                self._handle_pending()
            if self.stopping_since is not None:
                break
        while self.running:
            try:
                kind, index, value = self.events.get(timeout=0.2)
            except queue.Empty:
                self._escalate()
                continue
            self._handle(kind, index, value)
            self._escalate()
        for t in self.threads:
            t.join(timeout=2.0)
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
        code = value if value >= 0 else 128 - value
        if code == 0 or self.stopping_since is not None:
            return
        self.exit_code = code
        if kind == "rank-failed":
            label, what = f"rank {index}", describe_exit(value)
        else:
            label, what = self.specs[index].label, describe_exit(value)
        others = " ending the other ranks" if len(self.specs) > 1 or kind == "rank-failed" else ""
        hint = self.specs[index].failure_hints.get(code) if kind == "exit" else None
        self.say(f"{label} failed: {what}" + (f" ({hint})" if hint else "")
                 + (f";{others}" if others else ""))
        self._stop_all()

    def _escalate(self) -> None:
        if self.stopping_since is None or self.killed:
            return
        if time.monotonic() - self.stopping_since > self.grace_s + KILL_MARGIN_S:
            self._kill_all()
