"""``tnt run``'s side of an elastic job: the membership, published generation by generation.

The supervisor sees a rank's exit the moment it happens; it hands it to :class:`ElasticJob`,
which publishes the next membership generation in the rendezvous store (tnt_core's elastic membership:
the survivors renumbered in their old order) when at least ``--min-np`` are left, and gives
the supervisor the processes to start: a replacement while ``--max-restarts`` lasts, new
ranks on slots the discovery script reports, up to ``--max-np``. Those join in a later
generation, once their ``tnt_core.init()`` says they are ready (after their imports), so a
slow start-up does not stall the others. Below ``--min-np``, counting those starting, it
says why the job ends, in one line naming the ranks that died and how.

A process keeps one name for the whole job, its *member id*: its first rank, or the next
unused number for a process started later. Labels, output prefixes and messages use it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tnt_core import (
    FINISHED_KEY,
    NOT_ARRIVED_KEY,
    READY_KEY,
    RESTART_ALL_KEY,
    Departure,
    Membership,
    StoreClient,
    TntError,
    publish_membership,
)

from .errors import UsageError
from .job import Job, Rendezvous
from .launchers.base import Launcher, ProcessSpec
from .placement import Placement, RankSlot

__all__ = ["ElasticJob", "ElasticLimits", "HostDiscovery", "parse_hosts"]

#: seconds between two runs of the host discovery script
DISCOVERY_INTERVAL_S = 1.0
#: seconds one run of the discovery script may take
DISCOVERY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ElasticLimits:
    """``--min-np``, ``--max-np``, ``--max-restarts`` resolved against ``-n``."""

    min_np: int
    max_np: int
    max_restarts: int


def parse_hosts(text: str) -> dict[str, int]:
    """``HOST:SLOTS`` lines (``HOST`` alone: one slot; ``#`` comments) -> slots by host."""
    hosts: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, slots = line.rpartition(":")
        if not sep:
            host, slots = line, "1"
        if not host or not slots.isdigit():
            raise ValueError(f"{raw.strip()!r} is not HOST:SLOTS")
        hosts[host] = hosts.get(host, 0) + int(slots)
    return hosts


class HostDiscovery:
    """Runs ``--host-discovery-script`` every :data:`DISCOVERY_INTERVAL_S` in a thread and
    calls ``changed(hosts)`` when its answer differs from the last one."""

    def __init__(self, script: str, warn: Callable[[str], None],
                 usable: Callable[[str], bool] = lambda host: True) -> None:
        self.script, self._warn, self._usable = script, warn, usable
        self._changed: Callable[[dict[str, int]], None] = lambda hosts: None
        self._last: dict[str, int] | None = None
        self._unusable: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tnt-host-discovery", daemon=True)

    def discover(self) -> dict[str, int] | None:
        """One run of the script: slots by host, None when it failed (said once)."""
        try:
            out = subprocess.run([self.script], capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL, timeout=DISCOVERY_TIMEOUT_S)
            if out.returncode != 0:
                raise ValueError(f"exited with code {out.returncode}: "
                                 f"{out.stderr.strip().splitlines()[-1:] or ''}")
            hosts = parse_hosts(out.stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            self._warn(f"--host-discovery-script {self.script}: {exc}; hosts unchanged")
            return None
        unusable = [h for h in hosts if not self._usable(h)]
        if unusable and unusable != self._unusable:
            self._warn(f"--host-discovery-script {self.script}: {', '.join(unusable)} not used: "
                       "the local launcher runs ranks on this machine only (--launcher ssh)")
        self._unusable = unusable
        return {h: slots for h, slots in hosts.items() if h not in unusable}

    def start(self, first: dict[str, int], changed: Callable[[dict[str, int]], None]) -> None:
        self._last, self._changed = first, changed
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(DISCOVERY_INTERVAL_S):
            hosts = self.discover()
            if hosts is not None and hosts != self._last and not self._stop.is_set():
                self._last = hosts
                self._changed(hosts)


@dataclass
class _Member:
    slot: RankSlot  # its rank is the member id
    label: str


class ElasticJob:
    """The membership of an elastic job and its changes (called by the supervisor's loop).

    :param procs: generation 0's processes, one per rank in rank order (their index is
        their member id).
    :param make_process: makes the process of a new member on a slot, with variables
        added to its environment.
    :param hosts: slots by host of the discovery script's first answer (None: no script).
    :param slots: generation 0's placement (GPUs, local ranks), by rank.
    """

    def __init__(self, limits: ElasticLimits, procs: list[ProcessSpec], store: StoreClient,
                 make_process: Callable[[RankSlot, dict[str, str]], ProcessSpec],
                 hosts: dict[str, int] | None = None,
                 slots: tuple[RankSlot, ...] | None = None, restarts: int = 0) -> None:
        self.limits = limits
        self.store = store
        self._make_process = make_process
        #: the members of the newest generation still alive, in its rank order
        self.members: list[int] = []
        #: members started for the job, not in a generation yet (their processes start up)
        self.pending: list[int] = []
        self._ready: set[int] = set()
        self.known: dict[int, _Member] = {}
        for proc in procs:
            if len(proc.ranks) != 1:
                raise UsageError("elastic options need one process per rank (--launcher "
                                 "local or ssh)")
            slot = (slots[proc.ranks[0]] if slots is not None
                    else RankSlot(proc.ranks[0], proc.host, 0, 1))
            self.members.append(proc.ranks[0])
            self.known[proc.ranks[0]] = _Member(slot, proc.label)
        #: in how many shares each host's cores are cut for binding (``--bind-to core``): its
        #: generation 0's ranks, or the slots of its first discovery
        self._shares = {self.known[m].slot.host: self.known[m].slot.core_share[1]
                        for m in self.members}
        self.next_member = len(procs)
        self.generation = 0
        #: the newest generation published, and every one by number
        self.published = self.membership()
        self.history: dict[int, Membership] = {0: self.published}
        #: a member finished its script: the job is ending, nobody is taken in any more
        self.finishing = False
        #: the labels of the members whose script ended well (exit code 0)
        self.done: list[str] = []
        #: members ended because the job finished before they could join (their exit is
        #: no failure)
        self.ended: set[int] = set()
        #: left since the newest generation was published
        self._departed: list[Departure] = []
        #: restarts used so far in the job (a restart of every rank counts as one)
        self.restarts = restarts
        #: every process that left, in order: (label, reason)
        self.departures: list[tuple[str, str]] = []
        #: slots by host the discovery script last reported (None: no script)
        self.hosts = hosts
        self._lock = threading.Lock()

    # -- generations ------------------------------------------------------------------------
    def membership(self, joined: tuple[int, ...] = (),
                   departed: tuple[Departure, ...] = ()) -> Membership:
        return Membership(self.generation, tuple(self.members),
                          tuple(self.known[m].slot.host for m in self.members), joined, departed)

    def publish_initial(self) -> None:
        publish_membership(self.store, self.published)

    def change(self, gone: dict[int, str]) -> tuple[list[ProcessSpec], str | None]:
        """Members ``gone`` (member id -> why) left. A replacement is started for each
        while ``--max-restarts`` lasts; the survivors go on in a new generation at once if
        they are at least ``--min-np``, else it waits for the replacements to be ready.

        Returns the processes to start, and None; or no process and the one line that
        ends the job (fewer than ``--min-np`` ranks left, counting those starting)."""
        with self._lock:
            gone = {m: why for m, why in gone.items() if m in self.members or m in self.pending}
            if not gone:
                return [], None
            for m, why in gone.items():
                if m in self.members:
                    self.members.remove(m)
                    self._departed.append(Departure(m, self.published.members.index(m), why))
                else:
                    self.pending.remove(m)
                self.departures.append((self.known[m].label, why))
            starting: list[int] = []
            for m in gone:
                slot = self.known[m].slot
                host = self._host_for(slot.host) if self.restarts < self.limits.max_restarts else None
                if host is None:
                    break
                self.restarts += 1
                starting.append(self._new_member(host, slot.gpu if host == slot.host else None))
            error = self._settle()
            return ([], error) if error else (self._processes(starting), None)

    def restart_all_reason(self) -> str | None:
        """Why the job cannot go on without any one of its ranks, when a rank said so
        (``tnt_core.RESTART_ALL_KEY``: a pipelined model); None otherwise."""
        try:
            if not self.store.check([RESTART_ALL_KEY]):
                return None
            return self.store.get(RESTART_ALL_KEY, 1.0).decode(errors="replace")
        except (TntError, OSError):
            return None

    def restart_all(self) -> bool:
        """Count a restart of every rank; False when ``--max-restarts`` is used up."""
        with self._lock:
            if self.restarts >= self.limits.max_restarts:
                return False
            self.restarts += 1
            return True

    def finished(self, member: int) -> tuple[bool, list[int]]:
        """``member`` exited with 0: it is done, and no later generation includes it (no
        generation is published for it: the others are finishing too). Returns whether
        every member is done (members still starting up have nothing to join), and the
        members that joined in a generation ``member`` never bound (it says which it bound
        last, ``FINISHED_KEY``): they wait for it in vain, and are to be ended."""
        with self._lock:
            self.finishing = True
            if member in self.members:
                self.members.remove(member)
                self.done.append(self.known[member].label)
            doomed: list[int] = []
            try:
                key = FINISHED_KEY.format(member=member)
                last = int(self.store.get(key, 1.0)) if self.store.check([key]) else None
            except (TntError, OSError, ValueError):
                last = None
            if last is not None and last < self.generation and last in self.history:
                doomed = [m for m in self.members if m not in self.history[last].members]
                self.members = [m for m in self.members if m not in doomed]
                self.ended.update(doomed)
            return not self.members, doomed

    def take_ready(self) -> tuple[Membership | None, str | None]:
        """Look whether members starting up are ready to join (their ``tnt_core.init()``
        said so in the store): the generation published for them, or the line that ends
        the job; (None, None) when nothing changed."""
        with self._lock:
            if self.finishing:
                return None, None  # the job is ending: nobody joins it any more
            fresh = [m for m in self.pending if m not in self._ready
                     and self.store.check([READY_KEY.format(member=m)])]
            if not fresh:
                return None, None
            self._ready.update(fresh)
            before = self.generation
            error = self._settle()
            return (self.published if self.generation != before else None), error

    def grow_or_shrink(self, hosts: dict[str, int]) -> tuple[list[int], list[ProcessSpec]]:
        """The discovery script's new answer: the members on hosts that vanished or lost
        slots (to be ended: their exits then count as failures), and the processes of new
        members on new slots (up to ``--max-np``; they join once ready)."""
        with self._lock:
            self.hosts = dict(hosts)
            doomed: list[int] = []
            for host in {self.known[m].slot.host for m in self.members + self.pending}:
                on_host = [m for m in self.members + self.pending
                           if self.known[m].slot.host == host]
                doomed += on_host[hosts.get(host, 0):]
            alive = len(self.members) + len(self.pending) - len(doomed)
            starting: list[int] = []
            while alive + len(starting) < self.limits.max_np:
                free = self._host_for(None)
                if free is None:
                    break
                starting.append(self._new_member(free, None))
            return doomed, self._processes(starting)

    def _new_member(self, host: str, gpu: str | None) -> int:
        """A member starting on ``host`` (with the GPU of the rank it replaces), bound to
        the share of the host's cores no live member holds (:meth:`_free_share`)."""
        member = self.next_member
        self.next_member += 1
        slot = RankSlot(member, host, 0, 1, gpu, cores=self._free_share(host))
        self.known[member] = _Member(slot, f"rank {member} on {host}")
        self.pending.append(member)
        return member

    def _free_share(self, host: str) -> tuple[int, int]:
        """The lowest share of ``host``'s cores that no live member holds: a replacement
        takes the cores of the rank it replaces, not those of a survivor (its local rank,
        the survivors' count before it, would name a survivor's share). ``(0, 1)``, the
        whole host, when every share is held (a host that now has more slots than when it
        was first used): the rank then runs unbound."""
        shares = self._shares.setdefault(host, (self.hosts or {}).get(host, 1))
        held = {self.known[m].slot.core_share[0] for m in self.members + self.pending
                if self.known[m].slot.host == host and self.known[m].slot.core_share[1] == shares}
        free = next((i for i in range(shares) if i not in held), None)
        return (0, 1) if free is None else (free, shares)

    def _processes(self, starting: list[int]) -> list[ProcessSpec]:
        """The processes of members starting up. Their rank and size are the place they
        expect (their ``tnt_core.init()`` reads the real one from the store); local rank
        and size count the host's ranks, for the threads per rank."""
        everyone = self.members + self.pending
        hosts = [self.known[m].slot.host for m in everyone]
        procs = []
        for m in starting:
            rank, host = everyone.index(m), self.known[m].slot.host
            slot = dataclasses.replace(self.known[m].slot, local_rank=hosts[:rank].count(host),
                                       local_size=hosts.count(host))
            env = {"TNT_ELASTIC": "1", "TNT_ELASTIC_JOINS": "1", "TNT_MEMBER_ID": str(m),
                   "TNT_GENERATION": str(self.generation), "TNT_RANK": str(rank),
                   "TNT_SIZE": str(len(everyone)), "TNT_LOCAL_RANK": str(slot.local_rank),
                   "TNT_LOCAL_SIZE": str(slot.local_size)}
            procs.append(self._make_process(slot, env))
        return procs

    def _settle(self) -> str | None:
        """Publish the next generation when one is due and it has ``--min-np`` ranks: the
        survivors, then the members that are ready. The one line that ends the job when
        even with those starting up there are fewer than ``--min-np``."""
        if len(self.members) + len(self.pending) < self.limits.min_np:
            size = len(self.members) + len(self.pending)
            left = "no rank is" if size == 0 else f"{size} rank{'s are' if size > 1 else ' is'}"
            died = "; ".join(f"{label} {why}" for label, why in self.departures)
            if self.done:  # the others' scripts ended well: this is not the job shrinking
                return (f"{left} still running ({', '.join(self.done)} finished), fewer than "
                        f"--min-np {self.limits.min_np}: {died}")
            return f"{left} left, fewer than --min-np {self.limits.min_np}: {died}"
        joining = [m for m in self.pending if m in self._ready]
        if not (self._departed or joining) or len(self.members) + len(joining) < self.limits.min_np:
            return None  # nothing to publish, or waiting for replacements to be ready
        self.pending = [m for m in self.pending if m not in joining]
        self.members += joining
        self.generation += 1
        first = len(self.members) - len(joining)
        membership = self.membership(tuple(range(first, len(self.members))), tuple(self._departed))
        publish_membership(self.store, membership)
        self.published, self._departed = membership, []
        self.history[membership.generation] = membership
        return None

    def _host_for(self, preferred: str | None) -> str | None:
        """A host with a free slot (``preferred`` first); without a discovery script the
        job's hosts are fixed: a replacement goes where its predecessor ran."""
        if self.hosts is None:
            return preferred
        used: dict[str, int] = {}
        for m in self.members + self.pending:
            used[self.known[m].slot.host] = used.get(self.known[m].slot.host, 0) + 1
        order = ([preferred] if preferred in self.hosts else []) + list(self.hosts)
        return next((h for h in order if used.get(h, 0) < self.hosts[h]), None)

    def take_hung(self) -> tuple[list[int], str] | None:
        """The members a stall inspector found hung (its record is then removed), and its
        sentence about them; None when there is none, or when the record is of an older
        generation: its ranks were that generation's numbers, and the wait it explains
        ended with it (the survivors go on in the newer one; a rank that hangs there is
        found there)."""
        try:
            if not self.store.check([NOT_ARRIVED_KEY]):
                return None
            record = json.loads(self.store.get(NOT_ARRIVED_KEY, 1.0))
            self.store.delete(NOT_ARRIVED_KEY)
        except (TntError, OSError, ValueError):
            return None
        with self._lock:
            if record.get("generation", self.generation) != self.generation:
                return None
            members = [self.members[r] for r in record.get("ranks", ())
                       if isinstance(r, int) and 0 <= r < len(self.members)]
        return members, str(record.get("text", "hung"))


def with_env(proc: ProcessSpec, env: dict[str, str], job: Job) -> ProcessSpec:
    """``proc`` whose rank gets ``env`` on top of its variables (written last: it wins)."""
    spec = dict(proc.specs[0])
    spec["env"] = [*spec["env"], *([k, v] for k, v in env.items())]
    stdin = (job.encode(spec) + "\n").encode() if proc.stdin is not None else None
    return dataclasses.replace(proc, specs=[spec], stdin=stdin)


def process_maker(job: Job, launcher: Launcher, rendezvous: Rendezvous
                  ) -> Callable[[RankSlot, dict[str, str]], ProcessSpec]:
    """Makes the process of one new member, as ``launcher`` starts a rank on its host."""

    def make(slot: RankSlot, env: dict[str, str]) -> ProcessSpec:
        one = dataclasses.replace(job, placement=Placement((slot,)))
        return with_env(launcher.processes(one, rendezvous)[0], env, job)

    return make
