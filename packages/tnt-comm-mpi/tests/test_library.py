"""MPI start-up and exit policy, in single-rank (singleton MPI) subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TNT_", "PMI_", "OMPI_", "PMIX_", "SLURM_"))}
    env["TNT_BACKEND"] = "mpi"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_healthy_exit_finalizes_mpi() -> None:
    proc = _run("""
        import atexit, tnt_core
        import mpi4py
        b = tnt_core.init().backend
        assert mpi4py.rc.finalize is False, "tnt-comm-mpi must own MPI_Finalize"
        from mpi4py import MPI
        def report():  # registered first, so it runs after the backend's exit hook
            print("finalized", MPI.Is_finalized(), flush=True)
        import tnt_comm_mpi.library as lib
        atexit.unregister(lib._at_exit)
        atexit.register(report)
        atexit.register(lib._at_exit)
        b.barrier()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "finalized True" in proc.stdout, proc.stdout + proc.stderr


def test_after_a_failure_exit_skips_finalize_and_does_not_hang() -> None:
    proc = _run("""
        import tnt_core, tnt_comm_mpi.library as lib
        b = tnt_core.init().backend
        lib.mark_failed()  # as after a CommError: MPI_Finalize would wait for a dead rank
        print("leaving", flush=True)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "leaving" in proc.stdout


def test_program_that_imported_mpi4py_first_exits_1_after_a_failure() -> None:
    proc = _run("""
        from mpi4py import MPI  # mpi4py now finalizes at exit, after every atexit hook
        import tnt_core, tnt_comm_mpi.library as lib
        b = tnt_core.init().backend
        lib.mark_failed()
    """)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "exiting without MPI_Finalize" in proc.stderr


@pytest.mark.parametrize("level", ["funneled", "single"])
def test_thread_level_below_serialized_is_a_config_error(level) -> None:
    proc = _run(f"""
        import mpi4py
        mpi4py.rc.thread_level = {level!r}
        from mpi4py import MPI
        import tnt_core
        try:
            tnt_core.init()
        except tnt_core.ConfigError as exc:
            print("ConfigError:", exc)
    """)
    assert "ConfigError:" in proc.stdout and "MPI_THREAD_SERIALIZED" in proc.stdout, (
        proc.stdout + proc.stderr)


def test_a_second_runtime_in_the_same_process_reuses_mpi() -> None:
    proc = _run("""
        import numpy as np, tnt_core
        for round_ in range(3):
            b = tnt_core.init().backend
            buf = np.ones(3, np.float32)
            b.allreduce(buf)
            tnt_core.shutdown()
            print("round", round_, b.name, buf.tolist(), flush=True)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("mpi [1.0, 1.0, 1.0]") == 3, proc.stdout + proc.stderr
