"""Elastic membership: the generation records, the interrupted store wait, rejoin's refusal.

The launches (a rank killed, replaced, evicted) are in tnt-cli's test_cli_elastic.py.
"""

import threading
import time

import pytest

import tnt_core
from tnt_core import (
    CommError,
    Config,
    ConfigError,
    Departure,
    Membership,
    StoreClient,
    StoreServer,
    connect_store,
    latest_generation,
    publish_membership,
    read_membership,
)


@pytest.fixture
def server():
    with StoreServer("127.0.0.1", 0, key="secret") as s:
        yield s


def test_membership_places_ranks_and_round_trips():
    m = Membership(2, members=(0, 2, 5), hosts=("a", "b", "a"), joined=(2,),
                   departed=(Departure(1, 1, "was killed by signal SIGKILL"),))
    assert Membership.from_json(m.to_json()) == m
    assert m.size == 3 and m.rank_of(5) == 2 and m.rank_of(1) is None
    assert [m.local_rank(r) for r in range(3)] == [0, 0, 1]
    assert [m.local_size(r) for r in range(3)] == [2, 1, 2]
    assert m.describe_change() == ("generation 2: 3 ranks; rank 1 left (was killed by signal "
                                   "SIGKILL); rank 2 joined")
    with pytest.raises(ValueError, match="do not match"):
        Membership(0, members=(0, 0), hosts=("a", "a"))


def test_publish_and_read_the_newest_generation(server):
    host, port = server.address
    with StoreClient(host, port, server.key, connect_timeout=5) as store:
        assert latest_generation(store) == 0
        publish_membership(store, Membership(0, (0, 1, 2), ("h",) * 3))
        publish_membership(store, Membership(1, (0, 2), ("h",) * 2))
        assert latest_generation(store) == 1
        assert read_membership(store, 1, 1.0).members == (0, 2)
        # the launcher between a record and its pointer: the record is the newest
        store.set("tnt/elastic/membership/2", Membership(2, (0,), ("h",)).to_json())
        assert int(store.get("tnt/elastic/latest")) == 1
        assert latest_generation(store) == 2 and latest_generation(store, 1) == 2
        assert latest_generation(store, 3) == 3  # what its caller read counts


def test_an_elastic_ranks_store_wait_ends_when_the_job_moves_on(server):
    """A rank of generation 0 waiting for a key (a backend's connect waiting for a peer's
    address) stops waiting once generation 1 is out, instead of at TNT_TIMEOUT_S."""
    host, port = server.address
    config = Config(rank=0, size=2, local_size=2, rendezvous=f"{host}:{port}",
                    rendezvous_key=server.key, elastic=True, timeout_s=10.0)
    with connect_store(config) as waiting, connect_store(config) as launcher:
        timer = threading.Timer(0.3, publish_membership,
                                (launcher, Membership(1, (0,), ("h",))))
        timer.start()
        started = time.monotonic()
        with pytest.raises(CommError, match="generation 1 is out"):
            waiting.get("never-set")
        assert time.monotonic() - started < 5.0
        timer.join()
        # a job that is not elastic waits as before: up to its timeout
        plain = connect_store(config.with_overrides(elastic=False))
        assert plain.interrupt is None
        plain.close()


def test_rejoin_outside_an_elastic_job_says_how_to_start_one(monkeypatch):
    for name in ("TNT_RANK", "TNT_SIZE", "TNT_ELASTIC", "TNT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    tnt_core.shutdown()
    try:
        with pytest.raises(ConfigError, match="--min-np"):
            tnt_core.rejoin(timeout=0.1)
        assert tnt_core.membership_changed() is False
        assert tnt_core.init().generation == 0 and tnt_core.init().membership is None
    finally:
        tnt_core.shutdown()


def test_a_generation_that_only_adds_ranks_leaves_the_communicator_working(server):
    """Ranks joining abort nothing: the watcher marks the generation pending (the ranks move
    there where they agree, ``newest_seen``) and watches on; a later generation in which a
    rank left aborts the communicator as before. A rank rejoining there skips the
    generation that added a rank: that rank is still one it must give its state to."""
    from types import SimpleNamespace

    from tnt_core._runtime import Runtime

    host, port = server.address
    config = Config(rank=0, size=2, local_size=2, rendezvous=f"{host}:{port}",
                    rendezvous_key=server.key, elastic=True, timeout_s=10.0)
    aborted: list[str] = []

    class Backend:  # the watcher holds its backend weakly
        name, rank, size = "fake", 0, 2

        def abort(self, reason: str) -> None:
            aborted.append(reason)

        def close(self) -> None:
            pass

    backend = Backend()
    start = Membership(0, (0, 1), ("h", "h"))
    runtime = Runtime(config, backend, SimpleNamespace(name="fake"), SimpleNamespace(), start,
                      starter=lambda config, name, pm: (Backend(), SimpleNamespace(name="fake")))
    with connect_store(config) as launcher:
        publish_membership(launcher, start)
        runtime.watch_membership()
        try:
            publish_membership(launcher, Membership(1, (0, 1, 2), ("h",) * 3, joined=(2,)))
            deadline = time.monotonic() + 5
            while runtime.pending_join is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert runtime.pending_join is not None and runtime.pending_join.generation == 1
            assert not aborted and not runtime.membership_changed()
            assert runtime.newest_seen() == 1 and runtime.generation == 0
            publish_membership(launcher, Membership(2, (0, 2), ("h",) * 2,
                                                    departed=(Departure(1, 1, "killed"),)))
            while not aborted and time.monotonic() < deadline:
                time.sleep(0.01)
            assert aborted and "rank 1 left (killed)" in aborted[0]
            assert runtime.membership_changed() and runtime.newest_seen() == 2
            runtime.rejoin(timeout=5)
            # generation 2's record lists no newcomer (member 2 came in generation 1)
            assert runtime.generation == 2 and runtime.membership.joined == (1,)
        finally:
            runtime._watcher.stop()


def test_a_process_started_late_takes_the_newer_generation_its_connect_met(server, monkeypatch):
    """A replacement connecting in generation 1 while a rank leaves (generation 2 is out)
    starts over in generation 2; the failed connect then explains no later exception (the
    process would otherwise end as a peer's consequence, exit 75, on its own bug)."""
    from types import SimpleNamespace

    from tnt_core import _errors, _lifecycle
    from tnt_core._peer_failure import comm_error_of

    host, port = server.address
    config = Config(rank=1, size=2, local_size=2, rendezvous=f"{host}:{port}",
                    rendezvous_key=server.key, elastic=True, timeout_s=10.0, member_id=3)
    tried: list[int] = []

    def start_backend(config, name, pm):
        tried.append(config.size)
        if len(tried) == 1:  # generation 1's peer leaves while this rank connects
            publish_membership(launcher, Membership(2, (0, 3), ("h",) * 2, joined=(1,),
                                                    departed=(Departure(2, 1, "killed"),)))
            raise CommError("the elastic job's membership changed while waiting "
                            "(generation 2 is out)")
        return SimpleNamespace(name="fake"), SimpleNamespace(name="fake")

    monkeypatch.setattr(_lifecycle, "start_backend", start_backend)
    monkeypatch.setattr(_errors, "_first_comm_error", [])
    with connect_store(config) as launcher:
        publish_membership(launcher, Membership(1, (0, 2, 3), ("h",) * 3, joined=(1, 2)))
        _, _, joined, membership = _lifecycle._start_elastic(config, "gloo", None)
    assert tried == [3, 2] and membership.generation == 2 and joined.rank == 1
    assert comm_error_of(ValueError("the user's own bug")) is None


@pytest.mark.parametrize("case", ["a", "b"])
def test_settle_gives_every_survivor_one_outcome_whoever_dies(server, case):
    """``settle``, what ``hvd.elastic.run``'s return agrees through: (a) member 2 dies
    after its last collective and says nothing; the others completed: once ``tnt run``
    publishes the generation without it, both get True (a barrier could have completed on
    one and failed on the other). (b) member 1 failed and says so: member 0, which
    completed, gets False; member 1 then leaves, and member 2, completing later, still gets
    False (the first outcome stands), so all three go round again together."""
    from tnt_core._elastic import settle

    host, port = server.address
    generation0 = Membership(0, (0, 1, 2), ("h",) * 3)

    def store() -> StoreClient:
        return StoreClient(host, port, server.key, connect_timeout=5)

    publish_membership(store(), generation0)
    got: dict[int, bool] = {}

    def member(m: int, completed: bool = True) -> threading.Thread:
        t = threading.Thread(target=lambda: got.__setitem__(
            m, settle(store(), "run/0", generation0, m, completed, timeout=10.0, poll_s=0.005)))
        t.start()
        return t

    if case == "a":
        waiting = [member(0), member(1)]
        time.sleep(0.2)
        assert got == {}  # member 2's word is missing while it is in the job
        publish_membership(store(), Membership(1, (0, 1), ("h",) * 2))
    else:
        waiting = [member(0)]
        time.sleep(0.1)
        member(1, completed=False).join(5)
        waiting[0].join(5)
        publish_membership(store(), Membership(1, (0, 2), ("h",) * 2))
        waiting.append(member(2))
    for t in waiting:
        t.join(5)
    assert got == ({0: True, 1: True} if case == "a" else {0: False, 1: False, 2: False})
