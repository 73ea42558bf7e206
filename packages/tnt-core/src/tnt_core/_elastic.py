"""Elastic membership: which processes make up the job, generation after generation.

In an elastic job (``tnt run --min-np/--max-restarts``) ranks may die, be replaced, or be
added. ``tnt run``'s supervisor sees a rank's exit at once; it publishes the next
*membership generation* in the rendezvous store: the processes that form the job now, in
rank order, and where each runs. Every process has a *member id* that stays when its rank
changes (its first rank; a replacement gets a fresh one), so a survivor finds its new rank
in the record. Survivors keep their order: they are ranks ``0..k-1`` of the new
generation, and ranks started for it (replacements, growth) come after them, so rank 0 of
a generation with survivors is always a survivor (the one that holds the state).

Every rank of an elastic job runs a :class:`GenerationWatcher`: when a newer generation
appears, it aborts the current communicator, so a collective waiting for a rank that left
fails at once with :class:`~tnt_core.CommError`, whatever the transport and wherever the
rank was. The framework then calls :func:`tnt_core.rejoin`, which returns a new backend
over the new membership (see :meth:`tnt_core.Runtime.rejoin`).

Store keys (the launcher contract):

``tnt/elastic/membership/G``
    JSON of :class:`Membership` generation ``G`` (generation 0 is the job as started).
``tnt/elastic/latest``
    ``G`` of the newest generation, set after its record.
``tnt/elastic/ready/M``
    set by the ``tnt_core.init()`` of a process started for the job (member ``M``) that is
    in no generation yet: it is ready to connect, and ``tnt run`` publishes a generation
    with it. The others go on without it while it starts (when they are ``--min-np``).
``tnt/elastic/finished/M``
    the last generation member ``M`` bound, set when its runtime stops: ranks that joined
    in a later generation cannot connect without it, and ``tnt run`` ends them.
``tnt/elastic/restart_all``
    set by a rank whose job cannot go on without any one of its ranks (a pipeline stage
    is held by its ranks alone), saying why: when a rank dies, ``tnt run`` restarts every
    rank (while ``--max-restarts`` lasts) instead of going on without it or replacing it.
``tnt/elastic/settle/L/G/M``, ``.../L/G/claim``, ``.../L/G/outcome``
    member ``M``'s word on operation ``L`` of generation ``G`` (b"1" completed, b"0"
    failed), and the outcome the first member to know it wrote (:func:`settle`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ._errors import CommError, TntError, handled

__all__ = ["FINISHED_KEY", "LATEST_KEY", "MEMBERSHIP_KEY", "READY_KEY", "RESTART_ALL_KEY",
           "SETTLE_KEY", "Departure", "GenerationWatcher",
           "Membership", "interrupt_on_change", "join_membership", "latest_generation",
           "publish_membership", "read_membership", "settle"]

log = logging.getLogger("tnt.elastic")

MEMBERSHIP_KEY = "tnt/elastic/membership/{generation}"
LATEST_KEY = "tnt/elastic/latest"
READY_KEY = "tnt/elastic/ready/{member}"
FINISHED_KEY = "tnt/elastic/finished/{member}"
RESTART_ALL_KEY = "tnt/elastic/restart_all"
#: a member's word on an operation of a generation (``settle``): b"1" completed, b"0" failed
SETTLE_KEY = "tnt/elastic/settle/{label}/{generation}/{member}"
#: the first member to decide an operation's outcome takes this counter to 1 and writes it
SETTLE_CLAIM_KEY = "tnt/elastic/settle/{label}/{generation}/claim"
SETTLE_OUTCOME_KEY = "tnt/elastic/settle/{label}/{generation}/outcome"
#: seconds a watcher's store wait lasts before it looks whether it should stop
_WATCH_POLL_S = 0.5


@dataclass(frozen=True)
class Departure:
    """A process that left the job: its member id, its rank in the generation it left,
    and why (``killed by SIGKILL``, ``exited with code 1 (ValueError: ...)``)."""

    member: int
    rank: int
    reason: str


@dataclass(frozen=True)
class Membership:
    """One generation of an elastic job.

    :param generation: 0 for the job as started, one more at each change.
    :param members: the member id of each rank, in rank order.
    :param hosts: the host of each rank (local rank and size follow from them).
    :param joined: the ranks started for this generation: they hold no state yet and
        must receive it from rank 0.
    :param departed: the processes of the previous generation that are gone.
    """

    generation: int
    members: tuple[int, ...]
    hosts: tuple[str, ...]
    joined: tuple[int, ...] = ()
    departed: tuple[Departure, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if len(self.hosts) != len(self.members) or len(set(self.members)) != len(self.members):
            raise ValueError(f"membership {self.generation}: members {self.members} and hosts "
                             f"{self.hosts} do not match")

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def only_joins(self) -> bool:
        """Ranks joined and none left: every member of the previous generation is alive,
        so its communicator still works and the ranks may move to this one at a point they
        agree on, rather than abort the collective in flight."""
        return bool(self.joined) and not self.departed

    def seen_after(self, previous: Membership) -> Membership:
        """This generation as a rank that bound ``previous`` last sees it: ``joined`` lists
        every member that rank has not worked with. (The record lists the members new since
        the generation before it, which a rank that skipped generations never bound: a
        replacement started for generation 2 is no newcomer in generation 3's record.)"""
        joined = tuple(r for r, m in enumerate(self.members) if m not in previous.members)
        return self if joined == self.joined else replace(self, joined=joined)

    def rank_of(self, member: int) -> int | None:
        """The rank of ``member`` in this generation, None when it is not part of it."""
        try:
            return self.members.index(member)
        except ValueError:
            return None

    def local_rank(self, rank: int) -> int:
        host = self.hosts[rank]
        return sum(1 for h in self.hosts[:rank] if h == host)

    def local_size(self, rank: int) -> int:
        return self.hosts.count(self.hosts[rank])

    def to_json(self) -> bytes:
        return json.dumps({
            "generation": self.generation, "members": list(self.members),
            "hosts": list(self.hosts), "joined": list(self.joined),
            "departed": [[d.member, d.rank, d.reason] for d in self.departed],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Membership:
        data = json.loads(raw)
        return cls(generation=int(data["generation"]),
                   members=tuple(int(m) for m in data["members"]),
                   hosts=tuple(str(h) for h in data["hosts"]),
                   joined=tuple(int(r) for r in data.get("joined", ())),
                   departed=tuple(Departure(int(m), int(r), str(why))
                                  for m, r, why in data.get("departed", ())))

    def describe_change(self) -> str:
        """``generation 2: 2 ranks; rank 1 left (killed by SIGKILL); rank 2 joined``."""
        parts = [f"generation {self.generation}: {self.size} rank{'s' if self.size != 1 else ''}"]
        parts += [f"rank {d.rank} left ({d.reason})" for d in self.departed]
        if self.joined:
            parts.append(f"rank{'s' if len(self.joined) > 1 else ''} "
                         f"{', '.join(map(str, self.joined))} joined")
        return "; ".join(parts)


def publish_membership(store: Any, membership: Membership) -> None:
    """Make ``membership`` the newest generation (its record first, then the pointer)."""
    store.set(MEMBERSHIP_KEY.format(generation=membership.generation), membership.to_json())
    store.set(LATEST_KEY, str(membership.generation).encode())


def interrupt_on_change(store: Any, generation: int) -> Callable[[], str | None]:
    """For :attr:`tnt_core.StoreClient.interrupt`: ends a wait of a rank of ``generation``
    (e.g. a backend's connect waiting for a peer's address) once a later generation is
    published: the peer it waits for may be gone, and the job has moved on without it."""
    key = MEMBERSHIP_KEY.format(generation=generation + 1)

    def interrupt() -> str | None:
        if not store.check([key]):
            return None
        return (f"the elastic job's membership changed while waiting (generation "
                f"{generation + 1} is out); call tnt_core.rejoin()")

    return interrupt


def latest_generation(store: Any, at_least: int = 0) -> int:
    """The newest generation published (0 when none was), and at least ``at_least`` (a
    generation its caller has read).

    The pointer is set after the record it points to, so a reader between the two sets
    finds it one behind: the records decide. A rank that took the pointer there would
    connect the previous generation's communicator again, with the addresses its peers
    left in the store, and wait there while they connect the new one."""
    generation = int(store.get(LATEST_KEY)) if store.check([LATEST_KEY]) else 0
    generation = max(generation, at_least)
    while store.check([MEMBERSHIP_KEY.format(generation=generation + 1)]):
        generation += 1
    return generation


def settle(store: Any, label: str, membership: Membership, member: int, completed: bool,
           timeout: float, poll_s: float = 0.01) -> bool:
    """Whether every member of ``membership`` that is still in the job completed operation
    ``label`` in its generation: one answer for all, which a death cannot split.

    Why not a collective: when a rank dies in one, it may complete on some ranks and fail on
    others, and the ranks it completed on leave while the others wait for them in vain.
    Each member says here whether it completed (``completed``); the first member to know
    the outcome writes it, and every member returns the outcome written: False as soon as a
    member of the newest membership said it failed, True once every member of the newest
    membership (the dead are not in it) said it completed. A member that failed says so
    and returns False at once.

    :raises CommError: no outcome within ``timeout`` seconds.
    """
    keys = {name: key.format(label=label, generation=membership.generation)
            for name, key in (("claim", SETTLE_CLAIM_KEY), ("outcome", SETTLE_OUTCOME_KEY))}
    word = SETTLE_KEY.format(label=label, generation=membership.generation, member="{member}")
    store.set(word.format(member=member), b"1" if completed else b"0")
    if not completed:
        return False
    deadline = time.monotonic() + timeout
    while not store.check([keys["outcome"]]):
        newest = read_membership(store, latest_generation(store, membership.generation))
        members = [m for m in newest.members if m in membership.members]
        said = {m: store.get(word.format(member=m)) for m in members
                if store.check([word.format(member=m)])}
        outcome = False if b"0" in said.values() else True if len(said) == len(members) else None
        if outcome is not None:
            if store.add(keys["claim"], 1) == 1:
                store.set(keys["outcome"], b"1" if outcome else b"0")
            break
        if time.monotonic() > deadline:
            missing = [m for m in members if m not in said]
            raise CommError(f"{label}: members {missing} of generation {membership.generation} "
                            f"did not say within {timeout:g}s whether they completed it",
                            operation="settle")
        time.sleep(poll_s)
    return bool(store.get(keys["outcome"], max(deadline - time.monotonic(), 1.0)) == b"1")


def read_membership(store: Any, generation: int, timeout: float | None = None) -> Membership:
    """Generation ``generation``, waiting up to ``timeout`` seconds for it to be published."""
    return Membership.from_json(store.get(MEMBERSHIP_KEY.format(generation=generation), timeout))


def join_membership(store: Any, member: int, timeout: float) -> Membership:
    """The newest generation with ``member`` in it. A member in none yet (a process
    started for the job) says it is ready and waits up to ``timeout`` for one."""
    deadline = time.monotonic() + timeout
    membership = read_membership(store, latest_generation(store), timeout)
    if membership.rank_of(member) is not None:
        return membership
    store.set(READY_KEY.format(member=member), b"1")
    while membership.rank_of(member) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommError(f"member {member} was not taken into the elastic job within "
                            f"{timeout:g}s (tnt run publishes a generation with it once "
                            "it is ready)", operation="join")
        membership = read_membership(store, membership.generation + 1, left)
    return read_membership(store, latest_generation(store, membership.generation), timeout)


class GenerationWatcher:
    """A daemon thread that waits for the generation after ``generation`` and calls
    ``on_change(membership)`` when it is published; it watches the one after it too while
    ``on_change`` returns True. Its own store client: the caller's stays free for its
    requests."""

    def __init__(self, store_factory: Callable[[], Any], generation: int,
                 on_change: Callable[[Membership], bool | None]) -> None:
        self.generation = generation
        self._store_factory = store_factory
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tnt-elastic-watcher",
                                        daemon=True)

    def start(self) -> GenerationWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the thread ends within a poll interval; not waited for)."""
        self._stop.set()

    def _run(self) -> None:
        try:
            store = self._store_factory()
        except (TntError, OSError) as exc:
            log.warning("elastic: cannot watch the membership (%s); a departed rank is "
                        "noticed only by the communicator", exc)
            return
        watched = self.generation + 1
        try:
            while not self._stop.is_set():
                key = MEMBERSHIP_KEY.format(generation=watched)
                try:
                    store.wait([key], timeout=_WATCH_POLL_S)
                except CommError as timeout:
                    handled(timeout)  # polled again: it explains nothing that fails later
                    if not store.check([key]):  # a timeout; a lost store raises here
                        continue
                if self._stop.is_set():
                    return
                if not self._on_change(read_membership(store, watched, _WATCH_POLL_S)):
                    return
                watched += 1
        except (TntError, OSError, ValueError) as exc:
            log.debug("elastic watcher ends: %s", exc)  # the store closed: the job is over
        finally:
            try:
                store.close()
            except (TntError, OSError):
                pass
