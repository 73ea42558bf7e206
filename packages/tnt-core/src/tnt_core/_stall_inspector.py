"""The stall inspector: when a collective waits too long, say for whom and where they are.

Left alone, a job whose rank hangs says nothing until ``TNT_TIMEOUT_S`` (30 min by
default) ends it. So, like Horovod's stall inspector, a daemon thread per rank
(:class:`StallInspector`) publishes the rank's ledger (``_stall_ledger``) to the job's
rendezvous store every few seconds (a heartbeat: a rank that stopped publishing is stuck
outside Python's reach, or dead) and checks the local wait:

* after ``TNT_STALL_WARN_S`` (default 60 s; 0 turns the inspector off) in one collective,
  the lowest-numbered waiting rank logs which ranks have not entered it and where they
  were last seen;
* when the wait then fails at ``TNT_TIMEOUT_S``, the :class:`~tnt_core.CommError` carries
  the same diagnosis (through :class:`~tnt_core.WatchedBackend`), and the store gets it
  under :data:`NOT_ARRIVED_KEY`, from which the launcher's last line names those ranks
  (part of the launcher contract).

Without a TCP rendezvous store (a plain ``mpiexec`` job), the warning still comes, from
every waiting rank, but cannot name the ranks it waits for.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._config import Config
from ._errors import CommError, TntError
from ._rendezvous import connect_store
from ._watched_backend import WatchedBackend

__all__ = ["StallInspector", "start_inspector", "ANY_RANK", "NOT_ARRIVED_KEY"]

log = logging.getLogger("tnt.stall")

#: ``extra=`` for a log record that every rank shows (the rank filter keeps only errors
#: of non-master ranks): the stall report comes from whichever rank waits
ANY_RANK = {"tnt_any_rank": True}

_KEY = "tnt/stall/{rank}"
#: store key a rank whose wait failed sets, for the launcher's verdict: JSON
#: ``{"ranks": [...], "text": "...", "seen": "..."}``: the ranks that did not arrive, a
#: sentence naming them, and one saying where they were last seen
NOT_ARRIVED_KEY = "tnt/stall/not-arrived"


@dataclass
class _Peer:
    rank: int
    record: dict[str, Any] | None  # None: never published


def _place(peer: _Peer, now: float) -> str:
    """Where ``peer`` was last seen: ``epoch 2, step 5, fit, outside any collective, after
    #26; alive, heartbeat 1s ago`` (epochs 1-based, as Keras prints them)."""
    rec = peer.record
    if rec is None:
        return "never reported (did it start?)"
    parts = []
    if rec.get("epoch") is not None:
        parts.append(f"epoch {rec['epoch'] + 1}")
    if rec.get("step") is not None:
        parts.append(f"step {rec['step']}")
    if rec.get("phase"):
        parts.append(str(rec["phase"]))
    if not rec.get("entered"):
        parts.append("before its first collective")
    elif rec.get("waiting_for"):
        parts.append(f"waiting in {rec['op']} #{rec['waiting_for']}")
    else:
        parts.append(f"outside any collective, after #{rec['entered']}")
    age = max(0.0, now - float(rec.get("t", now)))
    if age <= 1.5 * float(rec.get("every", 10.0)) + 1.0:
        heart = f"alive, heartbeat {age:.0f}s ago"
    else:  # its inspector thread stopped publishing: the process is gone or frozen
        heart = f"silent for {age:.0f}s (dead, or frozen holding Python's lock)"
    return f"{', '.join(parts)}; {heart}"


def _where(peer: _Peer, now: float) -> str:
    return f"rank {peer.rank} ({_place(peer, now)})"


class StallInspector:
    """The daemon thread of one rank: heartbeat to the store, and the stall check.

    :param store_factory: opens this thread's own store client (None: no store, the
        warning cannot name peers).
    """

    def __init__(self, backend: WatchedBackend, config: Config, warn_s: float,
                 store_factory: Callable[[], Any] | None) -> None:
        self.backend = backend
        self.ledger = backend.ledger
        self.rank, self.size = backend.rank, backend.size
        self.warn_s = warn_s
        self.timeout_s = config.timeout_s
        #: the elastic generation whose ranks this inspector numbers: ``tnt run`` maps the
        #: ranks of its verdict to processes only within that generation
        self.generation = config.generation
        # several beats within the warning time and within the timeout, so that a peer's
        # record read then is younger than the wait it explains
        self.interval = max(0.5, min(10.0, warn_s / 4, self.timeout_s / 4))
        self.ledger.heartbeat_s = self.interval
        self._store_factory = store_factory
        self._store: Any = None
        self._stop = threading.Event()
        self._warned_for = 0
        self._last_diagnosis: tuple[int, str] | None = None
        self._lock = threading.Lock()
        backend.explain = self.explain
        self._thread = threading.Thread(target=self._run, name="tnt-stall-inspector", daemon=True)

    def start(self) -> StallInspector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except (CommError, OSError):  # the store may be gone with the launcher
                pass

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        if self._store_factory is not None:
            try:
                self._store = self._store_factory()
            except (TntError, OSError) as exc:
                log.debug("stall inspector without the store: %s", exc)
        self._publish()  # at once: a rank that hangs before its first beat is still seen
        next_beat = time.monotonic() + self.interval
        tick = min(1.0, self.interval)
        while not self._stop.wait(tick):
            now = time.monotonic()
            if now >= next_beat:
                self._publish()
                next_beat = now + self.interval
            seq = self.ledger.waiting_for
            if seq and seq != self._warned_for and now - self.ledger.waiting_since >= self.warn_s:
                self._warned_for = seq
                self._publish()
                self._warn(seq, now - self.ledger.waiting_since)

    def _publish(self) -> None:
        if self._store is None:
            return
        try:
            self._store.set(_KEY.format(rank=self.rank), json.dumps(self.ledger.record()).encode())
        except (CommError, OSError) as exc:  # the launcher ended: the job is ending anyway
            log.debug("stall heartbeat failed: %s", exc)
            self._store = None

    def _peers(self) -> list[_Peer] | None:
        store = self._store
        if store is None:
            return None
        peers = []
        try:
            for rank in range(self.size):
                key = _KEY.format(rank=rank)
                record = json.loads(store.get(key)) if store.check([key]) else None
                peers.append(_Peer(rank, record))
        except (CommError, OSError, ValueError) as exc:
            log.debug("stall inspector cannot read the store: %s", exc)
            return None
        return peers

    def diagnose(self, seq: int) -> tuple[str, bool, list[_Peer]] | None:
        """The ranks that have not entered collective ``seq`` and where they were last
        seen; whether this rank is the lowest one waiting (the one that reports); and
        those ranks."""
        peers = self._peers()
        if peers is None:
            return None
        now = time.time()
        missing = [p for p in peers if p.rank != self.rank
                   and (p.record is None or p.record["entered"] < seq)]
        lower_waiting = any(p.rank < self.rank and p.record is not None
                            and p.record.get("waiting_for") == seq
                            and p.record.get("waited_s", 0) > 0
                            for p in peers)
        if missing:
            text = ("not arrived: " + "; ".join(_where(p, now) for p in missing))
        else:
            text = ("every rank has entered it (a slow transport, or ranks that disagree on "
                    "the order of collectives)")
        with self._lock:
            self._last_diagnosis = (seq, text)
        return text, not lower_waiting, missing

    def _warn(self, seq: int, waited: float) -> None:
        op = self.ledger.waiting_op or "collective"
        head = (f"stall: rank {self.rank} has waited {waited:.0f}s in {op} #{seq} "
                f"(TNT_STALL_WARN_S={self.warn_s:g}; the job ends at TNT_TIMEOUT_S="
                f"{self.timeout_s:g}s)")
        result = self.diagnose(seq)
        if result is None:
            log.warning("%s; the ranks it waits for are unknown without tnt run's rendezvous "
                        "store", head, extra=ANY_RANK)
            return
        text, reporter, _ = result
        if reporter:
            log.warning("%s; %s", head, text, extra=ANY_RANK)

    def explain(self, seq: int, waited: float) -> str | None:
        """For a wait on ``seq`` that failed after ``waited`` seconds: the diagnosis, fresh
        if the store answers; the ranks that did not arrive also go to the store for the
        launcher. None for a wait that failed fast: the backend's error (a peer that
        closed its connection) says what happened, and its peers' records may be older."""
        if waited < min(self.warn_s, 0.5 * self.timeout_s):
            return None
        result = self.diagnose(seq)
        if result is not None:
            text, _, missing = result
            if missing:
                self._tell_launcher(seq, missing)
            return text
        with self._lock:
            last = self._last_diagnosis
        return last[1] if last and last[0] == seq else None


    def _tell_launcher(self, seq: int, missing: list[_Peer]) -> None:
        op = self.ledger.waiting_op or "collective"
        names = ", ".join(str(p.rank) for p in missing)
        now = time.time()
        several = len(missing) > 1
        text = (f"rank{'s' if several else ''} {names} did not arrive at {op} #{seq} "
                f"within {self.timeout_s:g}s (hung or too slow?)")
        seen = "last seen: " + "; ".join(_where(p, now) for p in missing)
        record = {"ranks": [p.rank for p in missing], "text": text, "seen": seen,
                  "generation": self.generation}
        store = self._store
        if store is None:
            return
        try:
            store.set(NOT_ARRIVED_KEY, json.dumps(record).encode())
        except (CommError, OSError) as exc:
            log.debug("cannot leave the stall verdict in the store: %s", exc)


def start_inspector(backend: WatchedBackend, config: Config, warn_s: float) -> StallInspector | None:
    """The inspector of a multi-rank job (None for one rank or ``warn_s`` 0)."""
    if warn_s <= 0 or backend.size < 2:
        return None
    factory = None
    if config.rendezvous and config.rendezvous_key and not config.rendezvous.startswith("file:"):
        def factory() -> Any:
            return connect_store(config.with_overrides(rank=backend.rank), connect_timeout=10.0)
    return StallInspector(backend, config, warn_s, factory).start()
