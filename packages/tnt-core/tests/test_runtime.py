import pytest

import tnt_core
from tnt_core import ConfigError, PluginError


def test_plain_process_runs_on_the_local_backend(clean_runtime):
    rt = tnt_core.init()
    assert rt.backend.name == "local"
    assert (tnt_core.get_rank(), tnt_core.get_size(), tnt_core.get_master_rank()) == (0, 1, 0)
    assert tnt_core.is_master_rank() and tnt_core.is_initialized()
    assert tnt_core.init() is rt, "init is idempotent"


def test_unknown_backend_lists_installed_ones(clean_runtime):
    clean_runtime.setenv("TNT_BACKEND", "nccl9")
    with pytest.raises(PluginError) as err:
        tnt_core.init()
    msg = str(err.value)
    assert "unknown backend 'nccl9'" in msg and "local" in msg and "pip install tnt-comm-nccl9" in msg


def test_a_backend_name_in_other_case_or_misspelt_says_which_was_meant(clean_runtime):
    installed = ["mpi", "gloo", "local"]
    for typed in ("Gloo", "GLOO", "glo", "gloo2"):
        assert tnt_core.unknown_backend_hint(typed, installed) == (
            "did you mean gloo? installed: mpi, gloo, local"), typed
    assert tnt_core.unknown_backend_hint("nccl", installed) == (
        "installed: mpi, gloo, local. Install the package that provides it, e.g. "
        "pip install tnt-comm-nccl")
    clean_runtime.setenv("TNT_BACKEND", "Local")
    with pytest.raises(PluginError, match=r"^unknown backend 'Local' \(TNT_BACKEND / --backend\); "
                                          r"did you mean local\? installed: "):
        tnt_core.init()


def test_multi_rank_job_without_a_backend_says_what_to_install(clean_runtime):
    clean_runtime.setenv("TNT_RANK", "0")
    clean_runtime.setenv("TNT_SIZE", "2")
    clean_runtime.setenv("TNT_RENDEZVOUS", "127.0.0.1:1")  # started by a launcher
    clean_runtime.setenv("TNT_DISABLE_PLUGIN_AUTOLOAD", "1")
    expected = r"no communication backend can run a job of 2 ranks.*tnt-comm-gloo"
    with pytest.raises(PluginError, match=expected):
        tnt_core.init()


def test_multi_rank_size_without_a_launcher_says_to_use_tnt_run(clean_runtime):
    """``TNT_SIZE=2 python train.py``: every backend declines for want of a rendezvous store;
    the message said to install tnt-comm-gloo, although it was installed."""
    clean_runtime.setenv("TNT_RANK", "0")
    clean_runtime.setenv("TNT_SIZE", "2")
    clean_runtime.setattr("sys.argv", ["train.py"])
    with pytest.raises(PluginError) as err:
        tnt_core.init()
    assert str(err.value) == (
        "TNT_SIZE=2 asks for a job of 2 ranks, but this process was not started by a launcher "
        "(no rendezvous store: TNT_RENDEZVOUS is not set); start it with "
        "`tnt run -n 2 -- train.py`")


def test_named_backend_that_cannot_serve_the_job(clean_runtime):
    clean_runtime.setenv("TNT_RANK", "0")
    clean_runtime.setenv("TNT_SIZE", "2")
    with pytest.raises(PluginError, match="'local' is installed but cannot serve this job"):
        tnt_core.init(backend="local")


def test_a_backend_that_needs_tnt_run_under_mpiexec_says_so(clean_runtime):
    """``mpiexec -n 2 python script.py`` with TNT_BACKEND=store (or gloo): no TNT_SIZE, no
    rendezvous. The message said "cannot serve this job (rank 0 of 1)"."""
    clean_runtime.setenv("PMI_RANK", "1")
    clean_runtime.setenv("PMI_SIZE", "2")
    with pytest.raises(PluginError, match=r"backend 'store' needs `tnt run` to start the job; "
                                          r"this process was started by an MPI launcher \(hydra\)"):
        tnt_core.init(backend="store")


def test_cannot_switch_backend_in_a_running_process(clean_runtime):
    tnt_core.init()
    with pytest.raises(ConfigError, match="already runs backend 'local'"):
        tnt_core.init(backend="store")


def test_shutdown_then_init_starts_again(clean_runtime):
    first = tnt_core.init()
    tnt_core.shutdown()
    assert not tnt_core.is_initialized() and first.stopped
    assert tnt_core.init() is not first


def test_bad_environment_fails_at_init_with_the_variable(clean_runtime):
    clean_runtime.setenv("TNT_SIZE", "two")
    with pytest.raises(ConfigError, match="TNT_SIZE='two'"):
        tnt_core.get_rank()


def test_local_backend_collectives():
    import numpy as np

    b = tnt_core.LocalBackend()
    buf = np.arange(4, dtype=np.float32)
    assert b.allreduce(buf, "max") is buf and buf.tolist() == [0, 1, 2, 3]
    assert b.allgather(buf).shape == (1, 4)
    with pytest.raises(ValueError, match="root 1"):
        b.broadcast(buf, root=1)
    with pytest.raises(ConfigError, match="pip install tnt-comm-gloo"):
        tnt_core.LocalBackend(tnt_core.Config(rank=0, size=2))
    b.close()
    b.close()


def test_public_names_are_exported():
    for name in tnt_core.__all__:
        assert hasattr(tnt_core, name), name
