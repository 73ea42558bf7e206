"""Elastic jobs (``--min-np``, ``--max-restarts``, ``--host-discovery-script``).

The launches run ``ranks/elastic_loop.py``, a numpy allreduce loop that checks every sum
against the size of the generation it completed in: a rank SIGKILLs itself, the others go
on (or a replacement joins), and the job ends below ``--min-np`` in one line.
"""

from __future__ import annotations

import json
import re

import pytest

from tnt_cli.elastic import ElasticJob, ElasticLimits, parse_hosts
from tnt_cli.launchers.base import ProcessSpec
from tnt_cli.placement import RankSlot
from tnt_cli.run import run_command
from tnt_core import (
    FINISHED_KEY,
    NOT_ARRIVED_KEY,
    READY_KEY,
    RESTART_ALL_KEY,
    StoreClient,
    StoreServer,
    read_membership,
)

pytestmark = pytest.mark.timeout(120)

_DONE = re.compile(r"^\[(\d+)\] done member (\d+) rank (\d+) size (\d+) generation (\d+) steps (\d+)$")


def _done(stdout: str) -> dict[int, tuple[int, int, int, int]]:
    """member -> (rank, size, generation, steps) of the ranks that finished."""
    found = {}
    for line in stdout.splitlines():
        m = _DONE.match(line)
        if m:
            found[int(m.group(2))] = tuple(int(g) for g in m.groups()[2:])
    return found


# -- no launch -------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["-n", "2", "--min-np", "3"], "--min-np 3 is more than the 2 rank(s)"),
    (["-n", "3", "--max-np", "2"], "--max-np 2 is less than the 3 rank(s)"),
    (["--min-np", "3", "--max-np", "2"], "--min-np 3 is more than --max-np 2"),
    (["-n", "2", "--max-restarts", "1", "--launcher", "srun"], "one process per rank"),
    (["-n", "2", "--min-np", "1", "--backend", "mpi"], "cannot shrink without ULFM"),
    (["-n", "2", "--host-discovery-script", "/nonexistent"], "not an executable file"),
])
def test_bad_elastic_options_are_refused_in_one_line(capsys, h, args, says):
    try:  # in this process: a launch of tnt costs seconds, the checks milliseconds
        code = run_command([*args, "--", h.rank_script("print_rank.py")])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and says in err, err


def test_generations_renumber_survivors_replace_and_stop_below_min_np():
    """The supervisor's bookkeeping: survivors keep their order and go on at once when they
    are --min-np; a replacement joins after them once its init() says it is ready (the
    store's ready key); fewer than --min-np ends the job naming who died and how."""
    with StoreServer("127.0.0.1", 0) as server:
        store = StoreClient(*server.address, server.key, connect_timeout=5)
        procs = [ProcessSpec(["agent"], "localhost", (r,), [{}]) for r in range(4)]
        made: list[tuple[RankSlot, dict[str, str]]] = []

        def make(slot: RankSlot, env: dict[str, str]) -> ProcessSpec:
            made.append((slot, env))
            return ProcessSpec(["agent"], slot.host, (slot.rank,), [{}])

        job = ElasticJob(ElasticLimits(min_np=2, max_np=4, max_restarts=1), procs, store, make)
        job.publish_initial()
        started, error = job.change({1: "was killed by signal SIGKILL"})
        assert error is None and [p.ranks for p in started] == [(4,)]
        gen1 = read_membership(store, 1, 1.0)  # the survivors, at once
        assert gen1.members == (0, 2, 3) and gen1.joined == ()
        assert [(d.member, d.rank) for d in gen1.departed] == [(1, 1)]
        assert made[0][1]["TNT_MEMBER_ID"] == "4" and made[0][1]["TNT_ELASTIC"] == "1"
        assert job.take_ready() == (None, None)  # not ready yet: nothing changes
        store.set(READY_KEY.format(member=4), b"1")
        joined, error = job.take_ready()
        assert error is None and joined == read_membership(store, 2, 1.0)
        assert joined.members == (0, 2, 3, 4) and joined.joined == (3,)
        started, error = job.change({0: "exited with code 1 (ValueError: x)"})  # no restart left
        assert error is None and not started
        assert read_membership(store, 3, 1.0).members == (2, 3, 4)
        started, error = job.change({3: "exited with code 3", 4: "exited with code 4"})
        assert not started and error == (
            "1 rank is left, fewer than --min-np 2: rank 1 on localhost was killed by signal "
            "SIGKILL; rank 0 on localhost exited with code 1 (ValueError: x); rank 3 on "
            "localhost exited with code 3; rank 4 on localhost exited with code 4")
        # below --min-np with a replacement starting: the survivors wait for it
        wait = ElasticJob(ElasticLimits(2, 2, 1), procs[:2], store, make)
        started, error = wait.change({0: "exited with code 1"})
        assert error is None and len(started) == 1 and wait.generation == 0
        # discovered hosts: a host that vanishes ends its ranks, new slots get new ranks
        grow = ElasticJob(ElasticLimits(1, 3, 0), procs[:2], store, make,
                          hosts={"localhost": 2})
        doomed, started = grow.grow_or_shrink({"localhost": 1, "other": 2})
        assert doomed == [1]  # up to --max-np 3 once rank 1 is gone:
        assert [(p.host, p.ranks) for p in started] == [("other", (2,)), ("other", (3,))]
        store.close()


def test_a_replacement_takes_the_cores_its_predecessor_left():
    """--bind-to core: a rank keeps its share of its host's cores for the job. A
    replacement takes the share of the rank it replaces, not the one its local rank (the
    survivors before it) names, which a survivor holds; a rank on a host first used later
    takes a share of that host's slots; a rank beyond a host's first count of ranks gets
    the whole host (unbound)."""
    with StoreServer("127.0.0.1", 0) as server:
        store = StoreClient(*server.address, server.key, connect_timeout=5)
        procs = [ProcessSpec(["agent"], "h", (r,), [{}]) for r in range(3)]
        made: list[RankSlot] = []

        def make(slot: RankSlot, env: dict[str, str]) -> ProcessSpec:
            made.append(slot)
            return ProcessSpec(["agent"], slot.host, (slot.rank,), [{}])

        job = ElasticJob(ElasticLimits(1, 6, 2), procs, store, make, hosts={"h": 3},
                         slots=tuple(RankSlot(r, "h", r, 3) for r in range(3)))
        job.change({0: "was killed by signal SIGKILL"})
        assert (made[-1].local_rank, made[-1].core_share) == (2, (0, 3))
        job.change({2: "was killed by signal SIGKILL"})
        assert made[-1].core_share == (2, 3)
        doomed, started = job.grow_or_shrink({"h": 4, "o": 2})
        assert doomed == [] and len(started) == 3
        assert [(s.host, s.core_share) for s in made[2:]] == [
            ("h", (0, 1)), ("o", (0, 2)), ("o", (1, 2))]
        store.close()


def test_a_stall_verdict_of_an_older_generation_evicts_nobody():
    """A rank that waited in generation 0 blames ranks 0 and 2 (rank 2 died, rank 0 was
    slow) after the survivors went on in generation 1: its numbers are generation 0's, and
    rank 0 of generation 1 is alive and well. Seen in the suite: the master was killed for
    it. A verdict of the current generation names its members."""
    with StoreServer("127.0.0.1", 0) as server:
        store = StoreClient(*server.address, server.key, connect_timeout=5)
        procs = [ProcessSpec(["agent"], "localhost", (r,), [{}]) for r in range(3)]

        def make(slot: RankSlot, env: dict[str, str]) -> ProcessSpec:
            return ProcessSpec(["agent"], slot.host, (slot.rank,), [{}])

        job = ElasticJob(ElasticLimits(min_np=1, max_np=3, max_restarts=0), procs, store, make)
        job.publish_initial()
        job.change({1: "was killed by signal SIGKILL"})
        assert job.generation == 1 and job.members == [0, 2]
        text = "ranks 0, 2 did not arrive at allreduce #5 within 30s (hung or too slow?)"
        store.set(NOT_ARRIVED_KEY, json.dumps({"ranks": [0, 2], "text": text, "generation": 0}).encode())
        assert job.take_hung() is None
        assert not store.check([NOT_ARRIVED_KEY])  # taken, not left for the next poll
        store.set(NOT_ARRIVED_KEY, json.dumps({"ranks": [1], "text": "rank 1 ...", "generation": 1}).encode())
        assert job.take_hung() == ([2], "rank 1 ...")  # rank 1 of generation 1 is member 2
        store.close()


def test_ranks_that_joined_a_generation_a_finished_rank_never_bound_are_ended():
    """A rank finished its script in generation 0 (it says so in the store), while a rank
    joined in generation 1: that rank waits for it in vain and is ended, without failure;
    nobody is taken in once the job is finishing, and the job is done when the rest are. A
    rank that fails after the others finished ends the job saying they finished."""
    with StoreServer("127.0.0.1", 0) as server:
        store = StoreClient(*server.address, server.key, connect_timeout=5)
        procs = [ProcessSpec(["agent"], "localhost", (r,), [{}]) for r in range(2)]

        def make(slot: RankSlot, env: dict[str, str]) -> ProcessSpec:
            return ProcessSpec(["agent"], slot.host, (slot.rank,), [{}])

        job = ElasticJob(ElasticLimits(min_np=1, max_np=4, max_restarts=0), procs, store, make,
                         hosts={"localhost": 2})
        job.publish_initial()
        _, started = job.grow_or_shrink({"localhost": 4})
        assert [p.ranks for p in started] == [(2,), (3,)]
        store.set(READY_KEY.format(member=2), b"1")
        joined, _ = job.take_ready()
        assert joined is not None and joined.members == (0, 1, 2)
        store.set(FINISHED_KEY.format(member=0), b"0")  # it never bound generation 1
        assert job.finished(0) == (False, [2])
        assert job.ended == {2} and job.members == [1]
        store.set(READY_KEY.format(member=3), b"1")
        assert job.take_ready() == (None, None)  # finishing: nobody is taken in
        store.set(FINISHED_KEY.format(member=1), b"1")
        assert job.finished(1) == (True, [])
        # a rank failing after the others finished their script: not a job that shrank
        late = ElasticJob(ElasticLimits(1, 2, 0), procs, store, make)
        assert late.finished(0) == (False, [])
        assert late.change({1: "exited with code 1 (TypeError: x)"}) == ([], (
            "no rank is still running (rank 0 on localhost finished), fewer than --min-np 1: "
            "rank 1 on localhost exited with code 1 (TypeError: x)"))
        store.close()


def test_a_job_that_cannot_lose_a_rank_restarts_every_rank_while_restarts_last():
    """A rank said the job cannot go on without any one rank (a pipelined model sets
    RESTART_ALL_KEY): tnt run restarts every rank, each restart counting one of
    --max-restarts, across the restarted job's own bookkeeping."""
    with StoreServer("127.0.0.1", 0) as server:
        store = StoreClient(*server.address, server.key, connect_timeout=5)
        procs = [ProcessSpec(["agent"], "localhost", (r,), [{}]) for r in range(2)]
        job = ElasticJob(ElasticLimits(2, 2, 1), procs, store, lambda slot, env: procs[0])
        assert job.restart_all_reason() is None  # a data-parallel job goes on or replaces
        store.set(RESTART_ALL_KEY, b"a stage is held by its ranks alone")
        assert job.restart_all_reason() == "a stage is held by its ranks alone"
        assert job.restart_all() and job.restarts == 1
        again = ElasticJob(ElasticLimits(2, 2, 1), procs, store, lambda slot, env: procs[0],
                           restarts=job.restarts)
        assert not again.restart_all()  # --max-restarts 1 is used up
        store.close()


def test_discovery_output_is_host_colon_slots():
    assert parse_hosts("a:2\n# comment\nb\n\na:1\n") == {"a": 3, "b": 1}
    with pytest.raises(ValueError, match="HOST:SLOTS"):
        parse_hosts("a:two")


# -- launches --------------------------------------------------------------------------------

def test_a_killed_rank_is_replaced_then_the_job_shrinks(run_tnt, h):
    """3 ranks, --min-np 2, --max-restarts 1: rank 1 SIGKILLs itself at step 10, the two
    others go on at once, a replacement joins once started (gets the step from rank 0);
    rank 2 dies at step 30, no restart is left, 2 ranks finish. Every sum is checked
    against the size of the generation it completed in."""
    res = run_tnt("-n", "3", "--min-np", "2", "--max-restarts", "1", "--output-on-all-devices",
                  "--", h.rank_script("elastic_loop.py"), "45", "1", "10", "2", "30", timeout=90)
    assert res.returncode == 0, res.stderr
    done = {m: (rank, size, steps) for m, (rank, size, _, steps) in _done(res.stdout).items()}
    assert done == {0: (0, 2, 45), 3: (1, 2, 45)}, res.stdout + res.stderr
    assert "rank 1 on localhost exited with code 137 (signal SIGKILL?); going on with 2 rank(s), " \
           "generation 1\ntnt run: starting rank 3 on localhost; it joins once ready" in res.stderr
    # with 3 ranks, or with 2 when rank 2 died before the replacement was ready
    assert "rank 3 on localhost joined; going on with" in res.stderr
    recovered = re.findall(r"recovered (survivor|replacement) member (\d+)", res.stdout)
    assert ("replacement", "3") in recovered and ("survivor", "0") in recovered


def test_a_job_restarted_for_a_death_names_the_rank_that_died_not_its_consequence(run_tnt, h,
                                                                                   tmp_path):
    """A job that cannot lose a rank (a pipelined model's): rank 1 fails its peer at once
    and dies 0.5 s later; rank 0's exit for that failure (code 75) comes first, but the
    restart names rank 1, and the restarted job finishes. Rank 0 takes 1.5 s to write what
    the restarted job needs before it exits: it is not stopped meanwhile."""
    res = run_tnt("-n", "2", "--max-restarts", "1", "--output-on-all-devices", "--",
                  h.rank_script("elastic_loop.py"), "20",
                  env={"ELASTIC_RESTART_ALL": "a stage is held by its ranks alone",
                       "ELASTIC_LATE_DEATH": "1:5", "ELASTIC_SURVIVOR_WRITES_S": "1.5"},
                  timeout=60)
    assert res.returncode == 0, res.stderr
    assert ("tnt run: rank 1 on localhost exited with code 137 (signal SIGKILL?); a stage is "
            "held by its ranks alone: restarting every rank (restart 1 of 1)") in res.stderr, \
        res.stderr
    assert "exited with code 75" not in res.stderr, res.stderr
    assert len(_done(res.stdout)) == 2, res.stdout
    assert (tmp_path / "wrote-0").exists(), res.stderr  # not stopped while it wrote


def test_a_hung_rank_is_evicted_and_below_min_np_the_job_ends_in_one_line(run_tnt, h):
    """Rank 1 hangs at step 5: the stall inspector names it at --timeout, tnt run kills
    it and the others go on with 2 ranks; rank 2 then dies, and 1 rank is fewer than
    --min-np 2: the job ends with the dead rank's exit code and one line naming both."""
    res = run_tnt("-n", "3", "--min-np", "2", "--timeout", "2", "--output-on-all-devices", "--",
                  h.rank_script("elastic_loop.py"), "30", "2", "15", env={"ELASTIC_HANG": "1:5"},
                  timeout=60)
    assert res.returncode == 137, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0].startswith("tnt run: rank 1 on localhost: evicted, rank 1 did not arrive "
                               "at allreduce #"), res.stderr
    assert "going on with 2 rank(s), generation 1" in lines[1]
    assert re.search(r"recovered survivor member 0 generation 1", res.stdout)
    assert lines[-1] == (
        "tnt run: 1 rank is left, fewer than --min-np 2: rank 1 on localhost was killed by "
        "signal SIGKILL; rank 2 on localhost exited with code 137 (signal SIGKILL?)")
