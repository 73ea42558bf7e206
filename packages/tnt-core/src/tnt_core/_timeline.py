"""A Chrome-trace timeline of training steps (``TNT_TIMELINE=path.json``).

Open the file in chrome://tracing or https://ui.perfetto.dev: one process per rank, one
lane per activity (backprop, each fusion bucket's allreduce, the optimizer), so overlap of
communication with backprop is visible. The writer only records; what to record is
decided by the framework integration (tnt-keras) and :class:`tnt_core.FusedAllreducer`.

Each rank writes its own file: ``path`` on the master, ``<stem>.rank<R><suffix>`` on the
others (or ``path`` with ``{rank}`` replaced, if it contains that placeholder). A missing
directory is created when the timeline starts (as Keras' TensorBoard and ModelCheckpoint
create theirs); one that cannot be created or written fails then, with a
:class:`~tnt_core.ConfigError` naming ``TNT_TIMELINE``, not after the training.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._errors import ConfigError
from ._settings import TNT_TIMELINE, bad_input

__all__ = ["Timeline", "timeline_path"]


def timeline_path(path: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes for ``TNT_TIMELINE=path``."""
    text = str(path)
    if "{rank}" in text:
        return Path(text.replace("{rank}", str(rank)))
    p = Path(text)
    return p if rank == 0 else p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


class Timeline:
    """Collects trace events in memory and writes them as Chrome-trace JSON on ``close``.

    Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux, the clock native
    backends stamp completions with), written as microseconds since the timeline began.
    """

    def __init__(self, path: str | os.PathLike[str], rank: int = 0) -> None:
        self.path = timeline_path(path, rank)
        self.rank = rank
        TNT_TIMELINE.check_host(str(path))  # the rule tnt run checks for its own host
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise bad_input(ConfigError(
                f"TNT_TIMELINE={str(path)!r} cannot be written: {self.path.parent}: "
                f"{exc.strerror or exc}")) from None
        self._t0 = time.perf_counter()
        self._events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            # the clock reading of ts 0: ranks on one host share the clock, so their traces
            # can be put on one time axis (ts + origin)
            {"name": "clock_origin", "ph": "M", "pid": rank,
             "args": {"perf_counter_s": self._t0}},
        ]
        self._lanes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _lane(self, lane: str) -> int:
        tid = self._lanes.get(lane)
        if tid is None:
            tid = self._lanes[lane] = len(self._lanes) + 1
            self._events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                                 "args": {"name": lane}})
            self._events.append({"name": "thread_sort_index", "ph": "M", "pid": self.rank,
                                 "tid": tid, "args": {"sort_index": tid}})
        return tid

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def complete(self, name: str, lane: str, start: float, end: float, **args: object) -> None:
        """Record an activity that ran from ``start`` to ``end`` (perf_counter seconds)."""
        with self._lock:
            if self._closed:
                return
            event = {"name": name, "ph": "X", "pid": self.rank, "tid": self._lane(lane),
                     "ts": self._us(start), "dur": max(self._us(end) - self._us(start), 0.0)}
            if args:
                event["args"] = args
            self._events.append(event)

    def instant(self, name: str, lane: str, **args: object) -> None:
        with self._lock:
            if self._closed:
                return
            self._events.append({"name": name, "ph": "i", "s": "t", "pid": self.rank,
                                 "tid": self._lane(lane), "ts": self._us(time.perf_counter()),
                                 "args": args})

    @contextmanager
    def span(self, name: str, lane: str, **args: object) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, lane, start, time.perf_counter(), **args)

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def close(self) -> Path:
        """Write the trace file (idempotent); return its path."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(self.path.suffix + ".tmp")
                tmp.write_text(json.dumps({"traceEvents": self._events, "displayTimeUnit": "ms"}))
                os.replace(tmp, self.path)
        return self.path
