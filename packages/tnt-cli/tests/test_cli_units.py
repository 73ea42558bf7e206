"""Hostfile parsing, placement, rank identity under MPI/Slurm: no processes."""

from __future__ import annotations

import sys

import pytest

from tnt_cli.agent import numactl_prefix, rank_identity, startup_filter
from tnt_cli.devices import physical_cores, rank_cpus
from tnt_cli.errors import UsageError
from tnt_cli.hostfile import Host, parse_host_list, parse_hostfile
from tnt_cli.oom import OomCount
from tnt_cli.options import parse_run_args
from tnt_cli.placement import place_ranks


def test_hostfile_comments_blank_lines_and_slots():
    hosts = parse_hostfile("# cluster\nnode1\n\n  node2 slots=4   # big one\nuser@node3\n")
    assert hosts == [Host("node1"), Host("node2", 4), Host("user@node3")]


@pytest.mark.parametrize("text, message", [
    ("a\nb\na\n", "hf:3: host 'a' is listed twice (first on line 1)"),
    ("a cores=2\n", "hf:1: unknown entry 'cores=2'"),
    ("a slots=x\n", "hf:1: slots='x' must be a positive integer"),
    ("a/b\n", "hf:1: 'a/b' is not a host name"),
    ("\n# only comments\n", "hf lists no hosts"),
])
def test_hostfile_errors_name_file_and_line(text, message):
    with pytest.raises(UsageError) as err:
        parse_hostfile(text, "hf")
    assert message in str(err.value)


def test_host_list_is_a_hostfile_on_the_command_line():
    """``-H`` (horovodrun's spelling) gives the hosts the equivalent hostfile gives."""
    hosts = parse_host_list("node1:2, user@node2,[fe80::1]:3")
    assert hosts == [Host("node1", 2), Host("user@node2"), Host("[fe80::1]", 3)]
    assert hosts == parse_hostfile("node1 slots=2\nuser@node2\n[fe80::1] slots=3\n")


@pytest.mark.parametrize("text, message", [
    ("a:2,a:1", "-H 'a:1': host 'a' is listed twice; name each host once, with HOST:K"),
    ("a:0", "-H 'a:0': slots='0' must be a positive integer"),
    ("a,,b", "-H 'a,,b': empty entry"),
    ("fe80::1:2", "put an IPv6 address in brackets, e.g. [fe80::1:2]:2"),
    ("a/b:2", "'a/b' is not a host name"),
])
def test_host_list_errors_name_the_entry(text, message):
    with pytest.raises(UsageError) as err:
        parse_host_list(text)
    assert message in str(err.value)


def test_horovodrun_spelling_of_a_job():
    """``horovodrun -np 3 -H a:2,b:2 python train.py --lr 0.1`` means the same to tnt run:
    3 ranks, the first host's slots first, the command's own Python."""
    opts = parse_run_args(["-np", "3", "-H", "a:2,b:2", "python3", "train.py", "--lr", "0.1"])
    assert (opts.nranks, opts.hosts, opts.python, opts.command) == (
        3, [Host("a", 2), Host("b", 2)], ["python3"], ["train.py", "--lr", "0.1"])
    assert opts.names_hosts and opts.hostfile is None
    placement = place_ranks(opts.hosts, opts.nranks, None, 1, None)
    assert _layout(placement) == [(0, "a", 0, 2), (1, "a", 1, 2), (2, "b", 0, 1)]
    assert parse_run_args(["-np=2", "--", "train.py"]).nranks == 2
    bare = parse_run_args(["-n", "2", "--", "train.py"])
    assert (bare.python, bare.command, bare.hosts, bare.names_hosts) == (
        [sys.executable], ["train.py"], None, False)


@pytest.mark.parametrize("args, message", [
    (["-H", "a:2", "--hostfile", "hosts", "x.py"], "name the hosts once: --hostfile FILE or -H"),
    (["-H", "a:2", "-H", "b:2", "x.py"], "-H is given more than once"),
    (["-H", "a:x", "x.py"], "argument -H/--hosts: 'a:x': slots='x' must be a positive integer"),
    (["-np", "2", "python"], "missing script"),
])
def test_horovodrun_spelling_mistakes_are_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        parse_run_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def _layout(placement):
    return [(s.rank, s.host, s.local_rank, s.local_size) for s in placement.slots]


def test_placement_blocks_per_node():
    p = place_ranks([Host("a"), Host("b")], None, 2, 1, None)
    assert _layout(p) == [(0, "a", 0, 2), (1, "a", 1, 2), (2, "b", 0, 2), (3, "b", 1, 2)]


def test_placement_uses_slots_and_fills_in_order():
    p = place_ranks([Host("a", 3), Host("b", 3)], 4, None, 1, None)
    assert _layout(p) == [(0, "a", 0, 3), (1, "a", 1, 3), (2, "a", 2, 3), (3, "b", 0, 1)]


def test_placement_spreads_n_without_capacity():
    p = place_ranks([Host("a"), Host("b")], 3, None, 1, None)
    assert _layout(p) == [(0, "a", 0, 2), (1, "a", 1, 2), (2, "b", 0, 1)]
    assert p.hosts == ["a", "b"]


def test_placement_assigns_gpus_by_local_rank():
    p = place_ranks([Host("a"), Host("b")], None, None, 2, ["4", "7"])
    assert [(s.host, s.gpu) for s in p.slots] == [("a", "4"), ("a", "7"), ("b", "4"), ("b", "7")]


def test_placement_too_many_ranks():
    with pytest.raises(UsageError, match="-n 5 asks for more ranks than the hosts offer \\(4: a=2, b=2\\)"):
        place_ranks([Host("a"), Host("b")], 5, 2, 1, None)


def test_rank_identity_from_launchers():
    assert rank_identity({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1",
                          "MPI_LOCALNRANKS": "2"}) == (3, 4, 1, 2)
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert rank_identity(ompi) == (5, 8, 1, 4)
    slurm = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
             "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}
    assert rank_identity(slurm) == (4, 5, 0, 1)
    assert rank_identity({**slurm, "SLURM_STEP_ID": "batch"}) is None, "a batch script is no rank"
    assert rank_identity({"PMI_RANK": "3", "PMI_SIZE": "4"}) is None, "local rank unknown"
    assert rank_identity({}) is None


def test_numactl_prefix():
    assert numactl_prefix(3, True, False, 2) == ["numactl", "--cpunodebind=1", "--preferred=1"]
    assert numactl_prefix(2, True, True, 2) == ["numactl", "--cpunodebind=0", "--membind=0"]
    assert numactl_prefix(1, False, True, 4) == ["numactl", "--membind=1"]
    assert numactl_prefix(0, False, False, 2) == []


def _fake_topology(root, cpus):
    """A sysfs CPU tree: ``cpus`` maps a CPU to (socket, core)."""
    for cpu, (package, core) in cpus.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "die_id").write_text("0\n")
    return str(root)


def test_ranks_are_bound_to_whole_cores_of_their_own(tmp_path):
    # 2 sockets x 2 cores x 2 threads, numbered as Linux numbers SMT siblings: cpu n and
    # n + 4 share a core; core ids repeat on the second socket
    sysfs = _fake_topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1),
                                      4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)})
    every = list(range(8))
    assert physical_cores(every, sysfs) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [rank_cpus(r, 2, every, sysfs) for r in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [rank_cpus(r, 4, every, sysfs) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # uneven: the first ranks get the extra core; the ranks never share one
    assert [rank_cpus(r, 3, every, sysfs) for r in range(3)] == [[0, 1, 4, 5], [2, 6], [3, 7]]
    # within the CPUs this process may use (a cpuset), siblings outside it left out
    assert rank_cpus(1, 2, [0, 1, 2, 4], sysfs) == [2]
    # fewer cores than ranks: not bound (siblings are not cores)
    assert rank_cpus(0, 5, every, sysfs) is None
    # no topology in sysfs: every CPU is a core
    assert rank_cpus(1, 2, [0, 1, 2, 3], str(tmp_path / "none")) == [2, 3]


def _fake_proc(tmp_path, cgroup: str, vmstat: int | None = 2):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    if vmstat is not None:
        (proc / "vmstat").write_text(f"pgfault 10\noom_kill {vmstat}\n")
    return proc


def test_the_oom_killers_count_is_read_where_the_rank_runs(tmp_path):
    """The agent's OomCount: cgroup v2's memory.events of the rank's cgroup (also under a
    hybrid mount's unified/), else cgroup v1's memory.oom_control, else the machine's
    /proc/vmstat; a count that grew since the rank started means the OOM killer ran."""
    root = tmp_path / "cg"
    job = root / "unified" / "slurm" / "job_7"  # a hybrid host: v2 at unified/
    job.mkdir(parents=True)
    (job / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    count = OomCount(_fake_proc(tmp_path, "0::/slurm/job_7\n"), root)
    assert not count.grew()
    (job / "memory.events").write_text("oom 2\noom_kill 2\n")
    assert count.grew()
    # cgroup v1's memory controller
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "c").mkdir(parents=True)
    (v1 / "memory" / "docker" / "c" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    count = OomCount(_fake_proc(tmp_path / "b", "4:memory:/docker/c\n0::/\n"), v1)
    (v1 / "memory" / "docker" / "c" / "memory.oom_control").write_text("oom_kill 1\n")
    assert count.grew()
    # neither: the machine's count; nothing readable: never claimed
    proc = _fake_proc(tmp_path / "c", "0::/\n", vmstat=2)
    count = OomCount(proc, tmp_path / "none")
    assert not count.grew()
    (proc / "vmstat").write_text("oom_kill 3\n")
    assert count.grew()
    assert not OomCount(_fake_proc(tmp_path / "d", "garbage\n", vmstat=None), tmp_path).grew()


def test_bind_to_defaults_to_core_and_gives_way_to_socket_pinning(capsys):
    assert parse_run_args(["-n", "2", "--", "t.py"]).bind_to == "core"
    assert parse_run_args(["-n", "2", "--bind-to", "none", "--", "t.py"]).bind_to == "none"
    assert parse_run_args(["-n", "2", "--pin-to-socket", "--", "t.py"]).bind_to == "none"
    with pytest.raises(SystemExit) as exit_:
        parse_run_args(["-n", "2", "--bind-to", "core", "--pin-to-socket", "--", "t.py"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--bind-to core and --pin-to-socket" in err, err


def test_the_store_listens_where_the_route_to_the_first_remote_host_leaves():
    from tnt_cli.network import route_source_address, store_bind_address

    assert route_source_address("127.0.0.1") == "127.0.0.1"
    assert store_bind_address(["localhost", "127.0.0.1"], None) == "127.0.0.1"
    assert store_bind_address(["nodeX"], "10.0.0.1") == "10.0.0.1"
    with pytest.raises(UsageError, match=r"cannot resolve host 'no-such-host\.invalid'"):
        route_source_address("no-such-host.invalid")


def test_orphan_segments_are_removed_and_held_ones_kept(tmp_path):
    """What an agent does after its rank was killed: remove the MPI library's segments
    that appeared since it started and that no live process maps or holds open."""
    from tnt_cli.cleanup import remove_orphan_segments, shm_segments

    old = tmp_path / "mpich_shm_old_0"
    old.write_bytes(b"x")
    patterns = (str(tmp_path / "mpich_shm_*"),)
    before = shm_segments(patterns)
    orphan, held, other = (tmp_path / "mpich_shm_dead_0", tmp_path / "mpich_shm_live_0",
                           tmp_path / "not_mpich")
    for path in (orphan, held, other):
        path.write_bytes(b"x")
    with open(held, "rb"):  # a live process (this one) still holds it
        removed = remove_orphan_segments(before, patterns)
    assert removed == [str(orphan)]
    assert old.exists() and held.exists() and other.exists() and not orphan.exists()


#: lines TensorFlow 2.21 wrote at start-up of a CPU rank (TF_CPP_MIN_LOG_LEVEL=2), as seen
STARTUP_LINES = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    b"I0000 00:00:1795887790.089851   12909 port.cc:153] oneDNN custom operations are on. You may "
    b"see slightly different numerical results due to floating-point round-off errors from "
    b"different computation orders. To turn them off, set the environment variable "
    b"`TF_ENABLE_ONEDNN_OPTS=0`.\n",
    b"I0000 00:00:1795887790.096094   12909 cudart_stub.cc:31] Could not find cuda drivers on your "
    b"machine, GPU will not be used.\n",
    b"I0000 00:00:1795887767.871974   12305 cpu_feature_guard.cc:227] This TensorFlow binary is "
    b"optimized to use available CPU instructions in performance-critical operations.\n",
    b"To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other "
    b"operations, rebuild TensorFlow with the appropriate compiler flags.\n",
]
NO_CUDA = (b"E0000 00:00:1795887795.327956   12909 cuda_platform.cc:52] failed call to cuInit: "
           b"INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n")
#: lines that must get through: the job's own, Python's warnings, TensorFlow's warnings/errors
KEPT = [b"Epoch 1/2\n", b"/x/train.py:3: UserWarning: shuffle\n",
        b"W0000 00:00:1795888449.798205    4218 util.cc:163] Not handling type DT_DOUBLE\n",
        b"E0000 00:00:1795888449.798205    4218 bfc_allocator.cc:1] Out of memory\n",
        b"I0 love my model] really\n"]


def test_startup_filter_drops_tensorflows_start_up_lines_only():
    chatter = startup_filter({}, has_gpu=False)
    assert chatter is not None
    assert [line for line in STARTUP_LINES + [NO_CUDA] if not chatter(line)] == []
    assert [line for line in KEPT if chatter(line)] == []
    on_gpu = startup_filter({}, has_gpu=True)
    assert on_gpu is not None and not on_gpu(NO_CUDA), "a GPU rank's failed cuInit is an error"
    # asked for: everything
    assert startup_filter({"TNT_LOG_LEVEL": "DEBUG"}, has_gpu=False) is None
    assert startup_filter({"TF_CPP_MIN_LOG_LEVEL": "0"}, has_gpu=False) is None
    assert startup_filter({"TF_CPP_MIN_LOG_LEVEL": "2"}, has_gpu=False) is not None
