"""The mpirun launcher for real (the mpich wheel's mpiexec), ssh and srun as dry runs,
socket pinning, launcher auto-detection."""

from __future__ import annotations

import os
import re
import shlex
import stat
import sys

import pytest

from tnt_cli.launchers.mpirun import find_mpiexec

pytestmark = pytest.mark.timeout(120)

needs_mpiexec = pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install mpich)")


@needs_mpiexec
def test_mpirun_launcher_runs_a_real_collective(run_tnt, h):
    res = run_tnt("--launcher", "mpirun", "-n", "3", "--backend", "store", "--output-on-all-devices",
                  "--timeout", "60", "--", h.rank_script("allreduce.py"))
    assert res.returncode == 0, res.stderr
    sums = sorted(re.findall(r"^\[(\d)\] rank \d/3 backend store sum (\S+)", res.stdout, re.M))
    assert sums == [("0", "6"), ("1", "6"), ("2", "6")], res.stdout + res.stderr


@needs_mpiexec
def test_mpirun_launcher_environment(run_tnt, h, tmp_path):
    import json

    res = run_tnt("--launcher", "mpirun", "-n", "2", "-x", "B_VAR=1", "A_VAR=2", "--",
                  h.rank_script("env_dump.py"))
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        pairs = json.loads((tmp_path / f"env.{rank}.json").read_text())
        env = dict(pairs)
        assert (env["TNT_RANK"], env["TNT_SIZE"], env["TNT_LOCAL_RANK"], env["TNT_LOCAL_SIZE"]) == \
            (str(rank), "2", str(rank), "2")
        assert "TNT_AGENT_SPEC" not in env
        assert [k for k, _ in pairs][-2:] == ["B_VAR", "A_VAR"]


@needs_mpiexec
def test_mpirun_launcher_failing_rank(start_tnt, h, tmp_path):
    import time

    proc = start_tnt("--launcher", "mpirun", "-n", "3", "--", h.rank_script("sleeper.py"),
                     env={"TNT_TEST_FAIL_RANK": "2", "TNT_TEST_FAIL_CODE": "4"})
    pids = h.read_pids(tmp_path, 3)
    _out, err = proc.communicate(timeout=60)
    ended = time.time()
    assert proc.returncode == 4, err
    assert "rank 2 failed: exited with code 4" in err
    assert ended - float((tmp_path / "failed_at").read_text()) < 5.0
    assert h.still_alive(pids) == []


def test_ssh_dry_run_shows_each_host(run_tnt, h, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost\nnode-b.invalid slots=2\n")
    res = run_tnt("--dry-run", "--hostfile", str(hostfile), "--rendezvous-host", "10.1.2.3",
                  "--ssh-args", "-p 2222", "--no-gpu", "--", h.rank_script("marker.py"))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "launcher: ssh;" in out and "3 rank(s) on 2 host(s): localhost (1), node-b.invalid (2)" in out
    assert "[rank 0 on localhost, local rank 0 of 1]" in out
    assert "[rank 2 on node-b.invalid, local rank 1 of 2]" in out
    ssh_lines = [line for line in out.splitlines() if line.strip().startswith("start: ssh ")]
    assert len(ssh_lines) == 2
    # the user's ssh options first: ssh takes the first value of an option, so theirs win;
    # the keep-alive gives a lost host up after 3 x 15 s (the default TNT_TIMEOUT_S is long)
    assert all("-o BatchMode=yes" in line and "-p 2222 -o ServerAliveInterval=15 -o "
               "ServerAliveCountMax=2 node-b.invalid" in line for line in ssh_lines)
    assert "TNT_RENDEZVOUS='10.1.2.3:<free port picked at start>'" in out
    assert not list(tmp_path.glob("ran.*"))


def test_srun_dry_run_inside_an_allocation(run_tnt, h, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    srun = fake_bin / "srun"
    srun.write_text("#!/bin/sh\necho 'the fake srun must not run in a dry run' >&2\nexit 99\n")
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "localhost,node-b.invalid"}
    res = run_tnt("--dry-run", "--n-per-node", "2", "--rendezvous-host", "10.1.2.3", "--",
                  h.rank_script("marker.py"), env=env)
    assert res.returncode == 0, res.stderr
    assert "launcher: srun;" in res.stdout  # auto-detected
    start = next(line for line in res.stdout.splitlines() if line.strip().startswith("start:"))
    words = shlex.split(start.split("start:", 1)[1])
    assert words[0] == "TNT_AGENT_SPEC=<job" and "srun" in words
    assert {"--ntasks=4", "--ntasks-per-node=2", "--nodes=2", "--kill-on-bad-exit=1",
            "--nodelist=localhost,node-b.invalid"} <= set(words)
    assert words[-2:] == ["-m", "tnt_cli.agent"]
    assert os.path.samefile(words[-3], sys.executable)


@needs_mpiexec
def test_backend_mpi_picks_mpirun_and_passes_the_ssh_args_to_its_bootstrap(run_tnt, h):
    res = run_tnt("--dry-run", "-n", "2", "--backend", "mpi", "--", h.rank_script("marker.py"))
    if res.returncode == 2 and "unknown backend 'mpi'" in res.stderr:
        pytest.skip("tnt-comm-mpi is not installed")
    assert res.returncode == 0, res.stderr
    assert "launcher: mpirun;" in res.stdout
    hosts = ["-H", "localhost:1,node-b.invalid:1", "--rendezvous-host", "198.18.0.1"]
    res = run_tnt("--dry-run", "--backend", "mpi", *hosts, "--ssh-args", "-F cluster.conf -p 2222", "--",
                  h.rank_script("marker.py"))
    assert res.returncode == 0, res.stderr
    start = next(line for line in res.stdout.splitlines() if line.strip().startswith("start:"))
    words = shlex.split(start.split("start:", 1)[1])
    assert "HYDRA_LAUNCHER_EXTRA_ARGS=-F cluster.conf -p 2222" in words or \
        words[words.index("plm_rsh_args") + 1] == "-F cluster.conf -p 2222", start
    res = run_tnt("--dry-run", "--backend", "mpi", *hosts, "--ssh-args", "-o 'ProxyJump a b'", "--",
                  h.rank_script("marker.py"))
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert "mpiexec splits its ssh arguments at spaces" in res.stderr


def test_pin_to_socket_runs_under_numactl(run_tnt, h):
    if not any(os.access(os.path.join(d, "numactl"), os.X_OK) for d in os.environ["PATH"].split(os.pathsep)):
        pytest.skip("numactl is not installed")
    dry = run_tnt("--dry-run", "-n", "2", "--pin-to-socket", "--pin-memory-to-socket", "--",
                  h.rank_script("marker.py"))
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"run:   numactl --cpunodebind=\d+ --membind=\d+ ", dry.stdout)
    res = run_tnt("-n", "2", "--pin-to-socket", "--output-on-all-devices", "--python-interpreter", "",
                  "--", "sh", "-c", 'echo "$TNT_RANK $(cat /proc/self/status | grep -c Cpus_allowed_list)"')
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] 0 1", "[1] 1 1"]


def test_pinning_without_numactl_is_a_clear_error(run_tnt, h, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    res = run_tnt("-n", "1", "--pin-to-socket", "--", h.rank_script("marker.py"), env={"PATH": str(empty)})
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "tnt run: error: --pin-to-socket/--pin-memory-to-socket need numactl, which is not installed "
        "(apt install numactl / dnf install numactl)"]
