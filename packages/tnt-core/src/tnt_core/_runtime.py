"""The process's view of the job: rank, size and the chosen backend.

One :class:`Runtime` per process, made by :func:`tnt_core.init` (``_lifecycle``) and handed
to the ``tnt_runtime_*`` hooks; it knows nothing of how its backend was chosen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import pluggy

from ._backend import BackendSpec, CommBackend
from ._config import Config
from ._elastic import (
    FINISHED_KEY,
    RESTART_ALL_KEY,
    GenerationWatcher,
    Membership,
    latest_generation,
    read_membership,
    settle,
)
from ._errors import CommError, ConfigError, TntError, handled
from ._log import configure_logging, logger
from ._rendezvous import StoreClient, connect_store
from ._stall_inspector import StallInspector, start_inspector
from ._stall_ledger import ledger
from ._watched_backend import WatchedBackend

__all__ = ["BackendStarter", "Runtime", "MASTER_RANK", "in_membership", "store_client"]

#: starts the backend named (or chosen) for a configuration: ``(config, name, plugins)`` to
#: ``(communicator, spec)``
BackendStarter = Callable[[Config, "str | None", pluggy.PluginManager],
                          "tuple[CommBackend, BackendSpec]"]

#: the rank that writes checkpoints and prints progress
MASTER_RANK = 0


def in_membership(config: Config, membership: Membership) -> Config:
    """``config`` for this process's place in ``membership``."""
    member = config.rank if config.member_id is None else config.member_id
    rank = membership.rank_of(member)
    if rank is None:
        raise CommError(f"this process (rank {config.rank} of generation {config.generation}) "
                        f"is no longer part of the elastic job: {membership.describe_change()}",
                        rank=config.rank, operation="rejoin")
    return config.with_overrides(rank=rank, size=membership.size,
                                 local_rank=membership.local_rank(rank),
                                 local_size=membership.local_size(rank),
                                 generation=membership.generation, member_id=member)


def store_client(config: Config) -> StoreClient:
    return connect_store(config, connect_timeout=10.0)


class Runtime:
    """The process's view of the job: rank, size and the chosen backend."""

    def __init__(self, config: Config, backend: CommBackend, spec: BackendSpec,
                 plugin_manager: pluggy.PluginManager,
                 membership: Membership | None = None,
                 starter: BackendStarter | None = None) -> None:
        self.config = config
        #: the job's communicator; in a multi-rank job a :class:`~tnt_core.WatchedBackend`
        #: around the plugin's backend (its ``inner``), which counts collectives for the
        #: stall inspector
        self.backend = backend
        self.backend_spec = spec
        self.plugin_manager = plugin_manager
        self.stall_inspector: StallInspector | None = None
        #: an elastic job's current generation (None: not an elastic job)
        self.membership = membership
        #: a newer generation the watcher saw (the backend was aborted for it)
        self.pending_membership: Membership | None = None
        #: a newer generation that only adds ranks (:attr:`Membership.only_joins`): the
        #: backend still works, and the ranks rejoin at a point they agree on
        self.pending_join: Membership | None = None
        #: this process was started for a running elastic job (a replacement, or a rank on
        #: a new slot): it holds no state until a survivor gives it
        self.joined_late = False
        self._watcher: GenerationWatcher | None = None
        #: how a backend is started for a configuration (``_backend_choice.start_backend``,
        #: handed in by ``_lifecycle``: this module does not choose backends)
        self._starter = starter
        self._stopped = False

    # ranks come from the backend: under mpiexec MPI knows them, not the environment
    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def size(self) -> int:
        return self.backend.size

    @property
    def local_rank(self) -> int:
        return self.backend.local_rank

    @property
    def local_size(self) -> int:
        return self.backend.local_size

    @property
    def master_rank(self) -> int:
        return MASTER_RANK

    @property
    def is_master(self) -> bool:
        return self.rank == MASTER_RANK

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def generation(self) -> int:
        """The elastic job's membership generation this runtime's backend spans (0: as
        started, and always in a job that is not elastic)."""
        return self.config.generation

    # -- elastic jobs ------------------------------------------------------------------------

    def watch_membership(self) -> None:
        """Abort the current backend as soon as a newer generation is published."""
        if self.membership is None or not self.config.rendezvous:
            return
        # weak: the watcher thread may outlive the runtime (it is a daemon blocked in the
        # store at exit) and must not keep the communicator alive
        runtime, backend = weakref.ref(self), weakref.ref(self.backend)
        config, generation = self.config, self.generation

        def changed(newer: Membership) -> bool:
            owner, comm = runtime(), backend()
            # a watcher stopped by a rejoin may call back after the runtime moved on
            current = owner is not None and newer.generation > owner.generation
            if newer.only_joins:  # nobody left: the collectives go on until the ranks agree
                if owner is not None and current:
                    owner.pending_join = newer
                logger.info("elastic: %s; the ranks take it in at a step boundary",
                            newer.describe_change())
                return True
            if owner is not None and current:
                owner.pending_membership = newer
            if comm is not None:
                logger.info("elastic: %s; aborting the communicator of generation %d",
                            newer.describe_change(), generation)
                comm.abort(f"the elastic job's membership changed ({newer.describe_change()}); "
                           "call tnt_core.rejoin() for the new communicator")
            return False

        self._watcher = GenerationWatcher(lambda: store_client(config), generation,
                                          changed).start()

    def membership_changed(self) -> bool:
        """True once a generation newer than this runtime's in which ranks left is
        published (its backend is then aborted: every collective fails until
        :meth:`rejoin`). Does not block. A generation that only adds ranks is
        :attr:`pending_join` instead."""
        return self.pending_membership is not None

    def newest_seen(self) -> int:
        """The newest generation this rank knows of (its own, or one published since):
        ranks that agree on the largest move to it together with :meth:`rejoin`."""
        pending = [m.generation for m in (self.pending_membership, self.pending_join)
                   if m is not None]
        return max([self.generation, *pending])

    def rejoin(self, timeout: float | None = None) -> CommBackend:
        """Wait for the elastic job's next membership generation and return a backend over it.

        What a rank calls when a collective failed with :class:`~tnt_core.CommError` (a
        peer died, or the watcher aborted the backend because the membership changed).
        Waits up to ``timeout`` seconds (default ``TNT_TIMEOUT_S``) for ``tnt run`` to
        publish the generation after this one, takes the newest, closes the old backend
        and starts the same backend plugin over the new members. :attr:`rank`,
        :attr:`size`, :attr:`local_rank`, :attr:`local_size` and :attr:`membership`
        answer for the new generation afterwards; its ``joined`` ranks start with no
        state and must get it from rank 0, a survivor.

        :raises ConfigError: the job is not elastic.
        :raises CommError: no new generation within ``timeout``, or this process is not
            part of it (evicted: ``tnt run`` is about to end it).
        """
        if self.membership is None:
            raise ConfigError("tnt_core.rejoin() needs an elastic job: start it with "
                              "`tnt run --min-np M` (or --max-restarts R)")
        wait = self.config.timeout_s if timeout is None else timeout
        store = store_client(self.config)
        store.interrupt = None  # its own waits are for the generations it asks for
        try:
            try:
                read_membership(store, self.generation + 1, wait)
            except CommError:
                raise CommError(f"no new membership generation within {wait:g}s after "
                                f"generation {self.generation}", rank=self.rank,
                                operation="rejoin") from None
            while True:
                newest = read_membership(store, latest_generation(store, self.generation + 1),
                                         wait)
                try:
                    self._bind(newest)
                    handled()  # the job moved on: the failures of before explain nothing later
                    return self.backend
                except CommError:
                    if latest_generation(store, newest.generation) == newest.generation:
                        raise
                    # another change while connecting: the newest generation is the one
        finally:
            store.close()

    def settle(self, label: str, completed: bool, timeout: float | None = None) -> bool:
        """Whether every rank completed operation ``label`` (the last one before the ranks
        part: an ``hvd.elastic.run`` function's return), in one answer that a rank's death
        cannot split, as a collective's failure can (:func:`tnt_core._elastic.settle`).
        Call it on every rank, with ``completed`` False on a rank that failed in it; waits up
        to ``timeout`` seconds (default ``TNT_TIMEOUT_S``). Outside an elastic job:
        ``completed`` (a failure ends such a job).

        :raises CommError: no outcome in time.
        """
        if self.membership is None or not self.config.rendezvous:
            return completed
        member = self.config.rank if self.config.member_id is None else self.config.member_id
        store = store_client(self.config)
        try:
            return settle(store, label, self.membership, member, completed,
                          self.config.timeout_s if timeout is None else timeout)
        finally:
            store.close()

    def _bind(self, membership: Membership) -> None:
        config = in_membership(self.config, membership)
        self._retire()
        ledger().entered = 0  # every member of a generation numbers its collectives from 0
        name = "local" if config.size == 1 else (
            None if self.backend_spec.name == "local" else self.backend_spec.name)
        if self._starter is None:
            raise ConfigError("this runtime was made without a backend starter: it cannot rejoin")
        self.backend, self.backend_spec = self._starter(config, name, self.plugin_manager)
        if self.membership is not None:
            membership = membership.seen_after(self.membership)
        self.config, self.membership, self.pending_membership = config, membership, None
        self.pending_join = None
        configure_logging(config, rank=config.rank)
        if isinstance(self.backend, WatchedBackend):
            self.stall_inspector = start_inspector(self.backend, config, config.stall_warn_s)
        self.watch_membership()
        logger.info("elastic: rank %d of %d in %s", config.rank, config.size,
                    membership.describe_change())

    def _retire(self) -> None:
        """Stop watching the old generation and close its backend (aborted first: a
        collective with a departed rank must not hold the close up)."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self.stall_inspector is not None:
            self.stall_inspector.stop()
            self.stall_inspector = None
        try:
            self.backend.abort("this rank moves to a new membership generation")
            self.backend.close()
        except CommError as exc:
            logger.debug("closing the old generation's backend: %s", exc)

    def stop(self) -> None:
        """Run ``tnt_runtime_stopping`` hooks, then close the backend. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.plugin_manager.hook.tnt_runtime_stopping(runtime=self)
        finally:
            self._say_finished()
            if self._watcher is not None:
                self._watcher.stop()
            if self.stall_inspector is not None:
                self.stall_inspector.stop()
            self.backend.close()

    def restart_all_on_failure(self, reason: str) -> None:
        """Tell ``tnt run`` that this elastic job cannot go on without any one of its ranks
        (``reason`` says why): when a rank dies, every rank is restarted (while
        ``--max-restarts`` lasts), to resume from the job's last checkpoint. Nothing
        outside an elastic job."""
        if self.membership is None or not self.config.rendezvous:
            return
        with connect_store(self.config, connect_timeout=10.0) as store:
            store.set(RESTART_ALL_KEY, reason.encode())

    def _say_finished(self) -> None:
        """An elastic rank stopping: the generation it bound last, for ``tnt run`` (ranks
        that joined in a later one wait for this rank in vain)."""
        if self.membership is None or not self.config.rendezvous or self.config.member_id is None:
            return
        try:
            with connect_store(self.config, connect_timeout=1.0) as store:
                store.set(FINISHED_KEY.format(member=self.config.member_id),
                          str(self.generation).encode())
        except (TntError, OSError) as exc:
            logger.debug("elastic: could not say this rank finished: %s", exc)

    def __repr__(self) -> str:
        return f"<Runtime rank {self.rank}/{self.size} backend {self.backend.name!r}>"
