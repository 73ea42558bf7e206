"""Every launch mode the README names, with real processes.

Ranks started by an MPI launcher (plain ``mpiexec``, ``mpiexec`` inside a ``tnt``-style
environment, an agent process per rank under ``mpiexec``) and ranks started independently
by ``tnt run``'s own launcher (rank 0 serves PMI to the others).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_jobs import MPIEXEC, WORKERS, mpiexec
from tnt_core.testing import launch_ranks

WORKER = str(WORKERS / "launch_worker.py")


def _reports(directory: Path) -> tuple[dict[int, dict], list[dict]]:
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in directory.glob("rank*.json")}
    errors = [json.loads(p.read_text()) for p in directory.glob("error-*.json")]
    return ranks, errors


def test_plain_mpiexec_without_any_tnt_variable(have_mpiexec, tmp_path) -> None:
    """``mpiexec -n 3 python script.py``: MPI is chosen by priority, ranks come from MPI."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    proc = subprocess.run([*mpiexec(3, cleanup=True), sys.executable, WORKER, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks, errors = _reports(tmp_path)
    assert not errors, errors
    assert sorted(ranks) == [0, 1, 2], ranks
    for rank, r in ranks.items():
        assert r["backend"] == "mpi" and r["size"] == 3 and r["allreduce_ok"], r
        assert r["local_size"] == 3 and r["local_rank"] == rank, r


def test_mpiexec_with_tnt_environment_picks_mpi_over_gloo(have_mpiexec, tmp_path) -> None:
    """TNT_SIZE/TNT_RENDEZVOUS set (Gloo would be available) but no TNT_BACKEND: MPI wins."""
    result = launch_ranks([WORKER, str(tmp_path)], 2, backend=None, timeout=120.0,
                          launcher=mpiexec(2, cleanup=True))
    assert result.ok, result.describe()
    ranks, errors = _reports(tmp_path)
    assert not errors and sorted(ranks) == [0, 1], (ranks, errors)
    assert all(r["backend"] == "mpi" and r["allreduce_ok"] for r in ranks.values()), ranks


def test_tnt_size_disagreeing_with_mpi_is_a_config_error(have_mpiexec, tmp_path) -> None:
    result = launch_ranks([WORKER, str(tmp_path)], 2, backend="mpi", timeout=120.0,
                          env={"TNT_SIZE": "3"}, launcher=mpiexec(2, cleanup=True))
    ranks, errors = _reports(tmp_path)
    assert not ranks, f"ranks started despite TNT_SIZE=3 under mpiexec -n 2: {ranks}"
    assert errors and all(e["error"] == "ConfigError" for e in errors), result.describe()
    assert "TNT_SIZE=3 but MPI started 2 ranks" in errors[0]["message"]


def test_ranks_started_by_tnt_run_form_one_mpi_job(tmp_path) -> None:
    """``tnt run``'s own launcher: one process per rank, no MPI launcher. Rank 0's PMI
    helper lets MPI_Init of every rank join one job; ranks and sizes match TNT_*."""
    result = launch_ranks([WORKER, str(tmp_path)], 3, backend="mpi", timeout=120.0,
                          env={"TNT_LOG_LEVEL": "INFO"})
    assert result.ok, result.describe()
    ranks, errors = _reports(tmp_path)
    assert not errors and sorted(ranks) == [0, 1, 2], (ranks, errors)
    for rank, r in ranks.items():
        assert r["backend"] == "mpi" and r["size"] == 3 and r["allreduce_ok"], r
        assert (r["local_rank"], r["local_size"]) == (rank, 3), r
    assert "via tnt run (PMI helper of rank 0)" in result.ranks[0].stderr, result.ranks[0].stderr


def test_mpi4py_imported_before_tnt_under_tnt_run_is_a_config_error(tmp_path) -> None:
    result = launch_ranks([WORKER, str(tmp_path), "--import-mpi4py-first"], 2, backend="mpi",
                          timeout=120.0)
    assert not result.timed_out, result.describe()
    ranks, errors = _reports(tmp_path)
    assert not ranks and len(errors) == 2, result.describe()
    for e in errors:
        assert e["error"] == "ConfigError" and "before the mpi backend started" in e["message"], e


def test_hydra_default_cleanup_ends_the_job_when_a_rank_dies(have_mpiexec, tmp_path) -> None:
    """Without -disable-auto-cleanup Hydra SIGKILLs all ranks once one exits without
    MPI_Finalize: the job ends at once (no hang), the survivors never see the error.
    (mpiexec's own exit status is then 0 or 9 depending on timing, so it is not checked.)"""
    limit = 30.0
    result = launch_ranks(["-m", "tnt_core.testing.conformance", "--report", str(tmp_path),
                           "--dead-peer"], 3, backend="mpi", timeout=limit + 60, tnt_timeout_s=limit,
                          launcher=mpiexec(3, cleanup=True))
    assert not result.timed_out, result.describe()
    assert result.elapsed < limit, f"the job took {result.elapsed:.1f}s: Hydra did not end it"
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "dead-peer" not in report["cases"], f"rank {rank} was not ended by Hydra: {report}"


AGENT = r"""
import os, subprocess, sys
keep = sys.argv[1] == "keep"
fds = (int(os.environ["PMI_FD"]),) if keep and os.environ.get("PMI_FD") else ()
sys.exit(subprocess.call([sys.executable, *sys.argv[2:]], pass_fds=fds))
"""


@pytest.mark.parametrize("keep_pmi_fd", [True, False], ids=["fd-passed", "fd-closed"])
def test_ranks_started_through_an_agent_process(have_mpiexec, tmp_path, keep_pmi_fd) -> None:
    """``tnt run --launcher mpirun`` runs an agent per rank that starts the script as a
    child. That works when the agent passes Hydra's PMI_FD on; when it does not, the
    backend says so instead of letting MPI_Init abort with 'PMI_Init returned -1'."""
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env["TNT_BACKEND"] = "mpi"
    proc = subprocess.run([*mpiexec(2, cleanup=True), sys.executable, str(agent),
                           "keep" if keep_pmi_fd else "close", WORKER, str(out)],
                          env=env, capture_output=True, text=True, timeout=120)
    ranks, errors = _reports(out)
    if keep_pmi_fd:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert sorted(ranks) == [0, 1] and all(r["allreduce_ok"] for r in ranks.values()), ranks
    else:
        assert not ranks and len(errors) == 2, proc.stdout + proc.stderr
        for e in errors:
            assert e["error"] == "ConfigError" and "pass_fds" in e["message"], e


def test_the_tnt_run_cli_with_its_own_launcher(tmp_path) -> None:
    """The real ``tnt run -n 2 --backend mpi --launcher local`` (tnt-cli), when installed.

    tnt-cli ends a finished rank by killing its process group: rank 0's PMI helper must
    survive that until the other ranks have finalised MPI (it once did not, and rank 1
    died with SIGSEGV in MPI_Finalize)."""
    tnt = Path(sys.executable).parent / "tnt"
    if not tnt.exists():
        pytest.skip("tnt-cli is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        out.mkdir()
        proc = subprocess.run([str(tnt), "run", "-n", "2", "--backend", "mpi", "--launcher", "local",
                               "--", WORKER, str(out)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ranks, errors = _reports(out)
        assert not errors and sorted(ranks) == [0, 1], (ranks, errors)
        assert all(r["allreduce_ok"] and r["backend"] == "mpi" for r in ranks.values()), ranks


RAISES = r"""
import numpy as np, tnt_core
runtime = tnt_core.init()
buf = np.ones(4)
runtime.backend.allreduce(buf)
if runtime.rank == 1:
    raise ValueError("boom on rank 1")
for _ in range(100):
    runtime.backend.allreduce(buf)  # rank 0 waits here for rank 1, which has gone
"""


def test_an_exception_on_one_rank_ends_the_job_at_once(tmp_path) -> None:
    """A rank that raises must not wait in MPI_Finalize for peers that wait for it in a
    collective (before: the job hung for TNT_TIMEOUT_S). ``tnt run``'s own launcher."""
    tnt = Path(sys.executable).parent / "tnt"
    if not tnt.exists():
        pytest.skip("tnt-cli is not installed")
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env["TNT_TIMEOUT_S"] = "120"  # a hang would show as a run of 2 minutes
    mark = f"{tmp_path.name}-{os.getpid()}"
    env["TNT_TEST_JOB_MARK"] = mark  # every process of the job inherits it
    import time

    start = time.monotonic()
    shm_before = _mpich_segments()
    proc = subprocess.run([str(tnt), "run", "-n", "2", "--backend", "mpi", "--launcher", "local",
                           "--", str(script)], env=env, capture_output=True, text=True, timeout=110)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert elapsed < 30, f"the job took {elapsed:.1f}s to end:\n{proc.stderr[-3000:]}"
    assert "ValueError: boom on rank 1" in proc.stderr, proc.stderr[-3000:]
    assert "rank 1" in proc.stderr.strip().splitlines()[-1], proc.stderr[-3000:]
    # the failing ranks skip MPI_Finalize, which removes MPICH's segments; they unlink them
    assert _mpich_segments() - shm_before == set()
    # rank 0's PMI helper ends with the job: tnt run SIGTERMs rank 0, whose exit hook then
    # cannot end it (it outlived the job by 30 s)
    deadline = time.monotonic() + 3.0
    while _job_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _job_processes(mark), _job_processes(mark)


def _job_processes(mark: str) -> list[str]:
    """Command lines of the live processes whose environment has TNT_TEST_JOB_MARK=mark."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if (proc.info["status"] != psutil.STATUS_ZOMBIE
                    and proc.environ().get("TNT_TEST_JOB_MARK") == mark):
                found.append(" ".join(proc.info["cmdline"] or []))
        except (psutil.Error, OSError):
            continue
    return found


def _mpich_segments() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("mpich_shm_*")} if shm.is_dir() else set()


def test_an_exception_on_one_rank_ends_an_mpiexec_job_at_once(have_mpiexec, tmp_path) -> None:
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    shm_before = _mpich_segments()
    result = launch_ranks([str(script)], 2, backend="mpi", timeout=110, tnt_timeout_s=120,
                          launcher=mpiexec(2, cleanup=True))
    assert not result.timed_out, result.describe()
    assert result.elapsed < 30, f"the job took {result.elapsed:.1f}s: {result.describe()}"
    assert _mpich_segments() - shm_before == set()


LOOPS = r"""
import time, numpy as np, tnt_core
runtime = tnt_core.init()
print("started", flush=True)
while True:
    runtime.backend.allreduce(np.ones(4))
    time.sleep(0.01)
"""


@pytest.mark.parametrize("launcher", ["local", "mpirun"])
def test_ctrl_c_leaves_no_mpich_segments(tmp_path, launcher) -> None:
    """Ctrl+C ends the ranks with SIGTERM, which ends Python without MPI_Finalize, where
    MPICH removes its /dev/shm segments; the agents remove what nobody maps any more."""
    import signal
    import time

    tnt = Path(sys.executable).parent / "tnt"
    if not tnt.exists():
        pytest.skip("tnt-cli is not installed")
    if launcher == "mpirun" and not os.access(MPIEXEC, os.X_OK):
        pytest.skip("no mpiexec")
    script = tmp_path / "loops.py"
    script.write_text(LOOPS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    shm_before = _mpich_segments()
    proc = subprocess.Popen([str(tnt), "run", "-n", "2", "--backend", "mpi", "--launcher", launcher,
                             "--", str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "started\n"
        time.sleep(1.0)  # both ranks are in MPI, their segments mapped
        assert _mpich_segments() - shm_before, "the job made no segment: nothing is tested"
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert _mpich_segments() - shm_before == set()
