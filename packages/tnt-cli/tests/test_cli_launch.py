"""Real launches on this machine through the local launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(120)

CONTRACT = ("TNT_RANK", "TNT_SIZE", "TNT_LOCAL_RANK", "TNT_LOCAL_SIZE", "TNT_RENDEZVOUS",
            "TNT_RENDEZVOUS_KEY", "TNT_FUSION_THRESHOLD_KB", "TNT_LOG_LEVEL", "TNT_LOG_ALL",
            "TNT_OUTPUT_ALL", "TNT_NUM_THREADS", "TNT_TIMEOUT_S")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_rank_runs_once(run_tnt, h, n):
    res = run_tnt("-n", str(n), "--output-on-all-devices", "--", h.rank_script("print_rank.py"))
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert lines == sorted(f"[{r}] rank {r} of {n}" for r in range(n))
    assert sorted(res.stderr.splitlines()) == sorted(f"[{r}] stderr of rank {r}" for r in range(n))


def test_only_master_output_by_default(run_tnt, h):
    res = run_tnt("-n", "3", "--", h.rank_script("print_rank.py"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["rank 0 of 3"]
    assert res.stderr.splitlines() == ["stderr of rank 0"]


def test_tarantella_alias(run_tnt, h):
    res = run_tnt("-n", "2", "--output-on-all-devices", "--", h.rank_script("print_rank.py"),
                  program="tarantella", subcommand=())
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] rank 0 of 2", "[1] rank 1 of 2"]


def _env_of(tmp_path, rank):
    return json.loads((tmp_path / f"env.{rank}.json").read_text())


def test_environment_contract_and_x_order(run_tnt, h, tmp_path):
    res = run_tnt("-n", "2", "--backend", "store", "--fusion-threshold", "64", "--log-level", "info",
                  "--log-on-all-devices", "--timeout", "30",
                  "-x", "ZZ_LAST=1", "AA_FIRST=two words", "-x", "MM_MID=a=b", "-x", "TNT_LOG_LEVEL=ERROR",
                  "--", h.rank_script("env_dump.py"))
    assert res.returncode == 0, res.stderr
    cores = len(os.sched_getaffinity(0))
    keys = set()
    for rank in range(2):
        pairs = _env_of(tmp_path, rank)
        env = dict(pairs)
        for name in CONTRACT:
            assert name in env, f"rank {rank} lacks {name}"
        assert env["TNT_RANK"] == str(rank) and env["TNT_SIZE"] == "2"
        assert env["TNT_LOCAL_RANK"] == str(rank) and env["TNT_LOCAL_SIZE"] == "2"
        assert env["TNT_BACKEND"] == "store"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", env["TNT_RENDEZVOUS"])
        assert re.fullmatch(r"[0-9a-f]{32}", env["TNT_RENDEZVOUS_KEY"])
        keys.add(env["TNT_RENDEZVOUS_KEY"])
        assert env["TNT_FUSION_THRESHOLD_KB"] == "64"
        assert env["TNT_LOG_ALL"] == "true" and env["TNT_OUTPUT_ALL"] == "false"
        assert env["TNT_TIMEOUT_S"] == "30"
        assert env["TNT_NUM_THREADS"] == str(max(1, cores // 2))
        # -x comes last, in the order given, and wins over the launcher's own value
        assert env["TNT_LOG_LEVEL"] == "ERROR"
        names = [k for k, _ in pairs]
        user = [k for k in names if k in ("ZZ_LAST", "AA_FIRST", "MM_MID", "TNT_LOG_LEVEL")]
        assert user == ["ZZ_LAST", "AA_FIRST", "MM_MID", "TNT_LOG_LEVEL"]
        assert names[-4:] == user
        assert env["AA_FIRST"] == "two words" and env["MM_MID"] == "a=b"
    assert len(keys) == 1  # one job, one key
    # each rank bound to cores of its own (--bind-to core, the default), where there are two
    cpus = [json.loads((tmp_path / f"cpus.{rank}.json").read_text()) for rank in range(2)]
    if cores >= 2:
        assert cpus[0] and cpus[1] and not set(cpus[0]) & set(cpus[1]), cpus
        assert set(cpus[0]) | set(cpus[1]) <= os.sched_getaffinity(0)
    else:
        assert cpus[0] == cpus[1] == sorted(os.sched_getaffinity(0))


def test_bind_to_none_leaves_the_ranks_to_the_scheduler(run_tnt, h, tmp_path):
    assert run_tnt("-n", "2", "--bind-to", "none", "--", h.rank_script("env_dump.py")).returncode == 0
    for rank in range(2):
        cpus = json.loads((tmp_path / f"cpus.{rank}.json").read_text())
        assert cpus == sorted(os.sched_getaffinity(0))


def test_each_job_gets_a_new_key(run_tnt, h, tmp_path):
    keys = []
    for _ in range(2):
        assert run_tnt("-n", "1", "--", h.rank_script("env_dump.py")).returncode == 0
        keys.append(dict(_env_of(tmp_path, 0))["TNT_RENDEZVOUS_KEY"])
    assert keys[0] != keys[1]


def test_real_collective_through_the_store(run_tnt, h):
    res = run_tnt("-n", "3", "--backend", "store", "--output-on-all-devices", "--timeout", "60", "--",
                  h.rank_script("allreduce.py"))
    assert res.returncode == 0, res.stderr
    sums = sorted(re.findall(r"^\[(\d)\] rank \d/3 backend store sum (\S+)", res.stdout, re.M))
    assert sums == [("0", "6"), ("1", "6"), ("2", "6")], res.stdout


def test_failing_rank_sets_exit_code_and_ends_the_others(start_tnt, h, tmp_path):
    proc = start_tnt("-n", "3", "--", h.rank_script("sleeper.py"),
                     env={"TNT_TEST_FAIL_RANK": "1", "TNT_TEST_FAIL_CODE": "3"})
    pids = h.read_pids(tmp_path, 3)
    _out, err = proc.communicate(timeout=60)
    ended = time.time()
    h.wait_for(lambda: (tmp_path / "failed_at").exists(), 5, "the failure time stamp")
    failed_at = float((tmp_path / "failed_at").read_text())
    assert proc.returncode == 3, err
    assert ended - failed_at < 5.0, f"the other ranks took {ended - failed_at:.1f}s to end"
    assert h.still_alive(pids) == []
    assert "rank 1 on localhost failed: exited with code 3" in err
    # a hidden rank's stderr is shown when it fails
    assert "[1] rank 1 is failing on purpose" in err


def test_rank_killed_by_signal(run_tnt, h):
    res = run_tnt("-n", "2", "--", h.rank_script("sleeper.py"),
                  env={"TNT_TEST_FAIL_RANK": "0", "TNT_TEST_FAIL_SIGNAL": str(int(signal.SIGKILL))})
    assert res.returncode == 128 + signal.SIGKILL
    assert "rank 0 on localhost failed: exited with code 137 (signal SIGKILL?)" in res.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_leaves_no_process(start_tnt, h, tmp_path, sig):
    proc = start_tnt("-n", "3", "--", h.rank_script("sleeper.py"))
    pids = h.read_pids(tmp_path, 3)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert set(pids) <= {c.pid for c in children}
    assert len(children) >= 6  # an agent and a rank per rank
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    _gone, alive = psutil.wait_procs(children, timeout=5)
    assert alive == [], f"left behind: {alive}"
    assert f"{signal.Signals(sig).name}: ending all ranks" in err


def _maps_numpy(pid: int, timeout: float = 20.0) -> None:
    """Wait until process ``pid`` has numpy's core mapped: tnt's slow imports (tnt-core,
    numpy) run, so tnt_cli._entry, which comes before them, has taken Ctrl+C over."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                if "_multiarray_umath" in maps.read():
                    return
        except OSError:
            return
        time.sleep(0.005)


@pytest.mark.parametrize("when", ["while it imports", "as it starts the ranks"])
def test_ctrl_c_while_tnt_starts_exits_quietly(start_tnt, h, tmp_path, when):
    """Ctrl+C (twice) before the supervisor handles it (while the imports run), or as it
    starts: exit 130 and no KeyboardInterrupt traceback (there was one from wherever Python
    was). Only the interpreter's own start, before tnt_cli._entry runs, stays Python's: the
    first case waits for the imports that follow it (a loaded machine may take more than
    0.3 s to get there)."""
    proc = start_tnt("-n", "2", "--", h.rank_script("sleeper.py"))
    _maps_numpy(proc.pid)
    if when == "as it starts the ranks":
        time.sleep(0.7)
    for _ in range(2):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.1)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    time.sleep(0.5)  # a rank that had started would have written its pid by now
    started = [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text().strip()]
    assert h.still_alive(started) == []


def test_killed_launcher_takes_its_ranks_along(start_tnt, h, tmp_path):
    proc = start_tnt("-n", "2", "--", h.rank_script("sleeper.py"))
    pids = h.read_pids(tmp_path, 2)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()  # no chance to clean up: the agents see their stdin close
    proc.wait(timeout=10)
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert alive == [] and h.still_alive(pids) == []


def test_output_is_streamed_line_by_line(start_tnt, h, tmp_path):
    proc = start_tnt("-n", "2", "--", h.rank_script("stream.py"))
    assert proc.stdout.readline() == "first line\n"  # arrives while the rank still runs
    (tmp_path / "go").touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == "second line\n"


def test_python_interpreter_empty_runs_a_program(run_tnt):
    res = run_tnt("-n", "2", "--output-on-all-devices", "--python-interpreter", "", "--",
                  "sh", "-c", 'echo "$TNT_RANK/$TNT_SIZE"')
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] 0/2", "[1] 1/2"]


def test_horovodrun_spelling_runs_the_named_python_on_the_named_hosts(run_tnt, h, tmp_path):
    """``tnt run -np 2 -H localhost:2 python SCRIPT``, as a horovodrun line reads."""
    import sys

    res = run_tnt("-np", "2", "-H", "localhost:2", "--output-on-all-devices", sys.executable,
                  h.rank_script("print_rank.py"))
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] rank 0 of 2", "[1] rank 1 of 2"]


def test_python_interpreter_with_arguments(run_tnt, h, tmp_path):
    import sys

    res = run_tnt("-n", "1", "--python-interpreter", f"{sys.executable} -X utf8", "--",
                  h.rank_script("print_rank.py"))
    assert res.returncode == 0, res.stderr
    assert res.stdout == "rank 0 of 1\n"


def test_no_gpu_hides_devices(run_tnt, h, tmp_path):
    res = run_tnt("-n", "1", "--no-gpu", "--", h.rank_script("env_dump.py"),
                  env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert res.returncode == 0, res.stderr
    assert dict(_env_of(tmp_path, 0))["CUDA_VISIBLE_DEVICES"] == "-1"


def test_one_rank_per_visible_gpu(run_tnt, h, tmp_path):
    res = run_tnt("--", h.rank_script("env_dump.py"), env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert res.returncode == 0, res.stderr
    assert [dict(_env_of(tmp_path, r))["CUDA_VISIBLE_DEVICES"] for r in range(2)] == ["3", "5"]


def test_more_ranks_than_gpus_runs_on_cpu_with_warning(run_tnt, h, tmp_path):
    res = run_tnt("-n", "2", "--", h.rank_script("env_dump.py"), env={"CUDA_VISIBLE_DEVICES": "0"})
    assert res.returncode == 0, res.stderr
    assert "2 ranks per host but only 1 GPU(s)" in res.stderr
    assert dict(_env_of(tmp_path, 1))["CUDA_VISIBLE_DEVICES"] == "-1"


def test_no_gpu_default_is_one_cpu_rank_with_warning(run_tnt, h, tmp_path):
    res = run_tnt("--", h.rank_script("print_rank.py"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr
    assert res.stdout == "rank 0 of 1\n"
    assert "warning: no GPU found: starting one CPU rank" in res.stderr


def test_dry_run_starts_nothing(run_tnt, h, tmp_path):
    res = run_tnt("--dry-run", "-n", "2", "-x", "B_VAR=2", "A_VAR=1", "--", h.rank_script("marker.py"),
                  "--flag")
    assert res.returncode == 0, res.stderr
    time.sleep(0.5)
    assert not list(tmp_path.glob("ran.*"))
    out = res.stdout
    assert "nothing was started" in out
    assert "[rank 0 on localhost, local rank 0 of 2]" in out
    assert "[rank 1 on localhost, local rank 1 of 2]" in out
    assert out.count(f"{h.rank_script('marker.py')} --flag") == 2
    assert re.search(r"TNT_RANK=1 .*TNT_RENDEZVOUS_KEY='<random key made at start>'.* B_VAR=2 A_VAR=1", out)


def test_x_name_alone_passes_on_the_launchers_value(run_tnt, h, tmp_path):
    # mpirun's -x NAME: the value NAME has where tnt run is typed, in the order given
    res = run_tnt("--dry-run", "-n", "2", "-x", "TNT_TEST_FROM_HERE", "A_VAR=1", "--",
                  h.rank_script("marker.py"), env={"TNT_TEST_FROM_HERE": "it is here"})
    assert res.returncode == 0, res.stderr
    assert re.search(r"TNT_RANK=1 .*TNT_TEST_FROM_HERE='it is here' A_VAR=1", res.stdout), res.stdout
    unset = run_tnt("--dry-run", "-n", "2", "-x", "TNT_TEST_NOT_SET_ANYWHERE", "--",
                    h.rank_script("marker.py"))
    assert unset.returncode != 0
    assert "'TNT_TEST_NOT_SET_ANYWHERE' is not NAME=VALUE, nor a variable set here" in unset.stderr


def test_cleanup_ends_leftover_ranks(start_tnt, run_tnt, h, tmp_path):
    script = tmp_path / f"leftover_{os.getpid()}.py"
    script.write_text((h.RANKS / "sleeper.py").read_text())
    proc = start_tnt("-n", "2", "--", str(script))
    pids = h.read_pids(tmp_path, 2)
    res = run_tnt("--cleanup", "--", script.name, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "ended 2 rank(s)" in res.stdout
    assert h.still_alive(pids) == []
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    again = run_tnt("--cleanup", "--force", "--", script.name, timeout=60)
    assert again.returncode == 0 and "no ranks of" in again.stdout


def test_version_and_help(run_tnt):
    version = run_tnt("--version", subcommand=())
    assert version.returncode == 0 and re.match(r"tnt \(tnt-cli\) \S+", version.stdout)
    top = run_tnt("--help", subcommand=())
    assert top.returncode == 0 and "run " in top.stdout and "tnt run --help" in top.stdout
    run_help = run_tnt("--help")
    assert run_help.returncode == 0
    for option in ("-n N, -np N, --np N", "-H HOST[:K],..., --hosts", "--hostfile", "--n-per-node",
                   "--npernode", "--devices-per-node", "-x NAME=VALUE",
                   "--output-on-all-devices", "--dry-run", "--cleanup", "--pin-to-socket",
                   "--python-interpreter", "--launcher", "--backend", "--timeout"):
        assert option in run_help.stdout, option
    assert run_tnt("--version").stdout.startswith("tnt run (tnt-cli)")


def test_tensorflows_start_up_lines_stay_out_of_the_output(run_tnt, tmp_path):
    """TensorFlow writes INFO lines of its C++ log at start-up whatever TF_CPP_MIN_LOG_LEVEL
    says (and, without an NVIDIA driver, a failed cuInit at level E): 7 lines before the
    job's own in ``make run``. One rank of a script that starts TensorFlow shows its own
    lines only."""
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed")
    script = tmp_path / "tiny_tf.py"
    script.write_text("import tensorflow as tf\n"
                      "print('sum', float(tf.reduce_sum(tf.constant([1.0, 2.0]))), flush=True)\n")
    res = run_tnt("-n", "1", "--", str(script), timeout=180)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "sum 3.0\n"
    assert res.stderr == "", res.stderr


def test_a_niced_tnt_run_keeps_its_ranks_niced_in_their_own_sessions(h, tmp_path):
    """``nice tnt run``: each rank runs in a session of its own (setsid), which with autogroup
    scheduling is a scheduling group weighed at nice 0 unless given the launcher's value."""
    script = tmp_path / "priority.py"
    script.write_text("import os\n"
                      "group = open('/proc/self/autogroup').read().split()[-1] "
                      "if os.path.exists('/proc/self/autogroup') else 'none'\n"
                      "print(os.getsid(0) == os.getpid(), os.getpriority(os.PRIO_PROCESS, 0), group)\n")
    res = subprocess.run(["nice", "-n", "7", *h.tnt_executable(), "run", "-n", "2",
                          "--output-on-all-devices", "--", str(script)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    group = "7" if os.path.exists("/proc/self/autogroup") else "none"
    assert sorted(res.stdout.splitlines()) == [f"[{r}] True 7 {group}" for r in range(2)]


@pytest.fixture
def memory_cgroup(tmp_path):
    """A cgroup with a 512 MiB memory limit (v1's memory controller, or v2 where it is
    delegated), removed at teardown; skips where this process cannot make one (not root)."""
    v1 = Path("/sys/fs/cgroup/memory")
    base = v1 if v1.is_dir() else Path("/sys/fs/cgroup")
    group = base / f"tnt-test-oom-{os.getpid()}"
    try:
        group.mkdir()
        (group / ("memory.limit_in_bytes" if base == v1 else "memory.max")).write_text(str(2**29))
    except OSError as exc:
        if group.is_dir():
            group.rmdir()
        pytest.skip(f"cannot make a memory-limited cgroup here: {exc}")
    yield group
    for _ in range(50):  # its processes are gone once tnt run returned; the kernel lags
        try:
            group.rmdir()
            break
        except OSError:
            time.sleep(0.1)


def test_a_rank_the_oom_killer_ends_is_named_so(h, tmp_path, memory_cgroup):
    """A rank the kernel's out-of-memory killer ends (here: at the job's cgroup memory
    limit, as under Slurm or in a container) dies of SIGKILL without a word; tnt run says
    that memory ran out and what to change, not only "signal SIGKILL?"."""
    res = subprocess.run(["sh", "-c", f'echo $$ > {memory_cgroup / "cgroup.procs"} && exec "$@"',
                          "sh", *h.tnt_executable(), "run", "-n", "2", "--",
                          h.rank_script("memory_hog.py")],
                         capture_output=True, text=True, timeout=90, cwd=tmp_path,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 137, res.stderr
    verdict = res.stderr.strip().splitlines()[-1]
    assert verdict.startswith("tnt run: rank 1 on localhost failed: exited with code 137"), res.stderr
    assert "out-of-memory killer ended this rank" in verdict and "fewer ranks per host" in verdict
