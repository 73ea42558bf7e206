"""``horovod.run`` (``import tarantella.horovod as horovod``): Horovod's examples call it when
started as a plain script; its ranks are a ``tnt run`` job and it returns their results.
Horovod's module paths, with ``horovod`` renamed ``tarantella.horovod``, are tarantella's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tarantella.horovod as horovod

SCRIPT = textwrap.dedent("""
    import sys
    import tarantella.horovod as horovod
    import tarantella.horovod.keras as hvd


    def main(scale, offset=0):
        hvd.init()
        return hvd.rank() * scale + offset, hvd.size()


    if __name__ == "__main__":
        print("RESULTS", horovod.run(main, args=(10,), kwargs={"offset": 1}, np=2, hosts="localhost:2",
                                     use_gloo=True))
    else:
        print("imported as", __name__)
""")


@pytest.mark.timeout(240)
def test_run_calls_a_function_of_the_script_on_each_rank_and_returns_the_results_in_rank_order(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULTS [(1, 2), (11, 2)]" in done.stdout
    assert "imported as __tnt_horovod_run__" in done.stdout  # the script's main block ran once


def _top_level() -> None:
    pass


@pytest.mark.parametrize("call, message", [
    (lambda: horovod.run(lambda: 0, np=2), "needs a function defined at the top level"),
    (lambda: horovod.run(_top_level, np=0), "np must be a positive number of ranks, got 0"),
    (lambda: horovod.run(_top_level, np=2, use_gloo=True, use_mpi=True), "ask for two backends"),
    (lambda: horovod.run(_top_level, np=2, use_spark=True), "unexpected keyword argument(s) 'use_spark'"),
    (lambda: horovod.run(_top_level, num_proc=2, np=3), "num_proc=2 and the older np=3 disagree"),
], ids=["lambda", "np=0", "two-backends", "unknown-argument", "num_proc-and-np"])
def test_run_refuses_what_it_cannot_launch(call, message):
    with pytest.raises((TypeError, ValueError)) as err:
        call()
    assert message in str(err.value)


def test_horovods_module_paths_renamed_are_tarantellas():
    """Moving a script is one rename: ``horovod.tensorflow[.keras[.callbacks|.elastic]]``
    becomes ``tarantella.horovod.tensorflow[...]``, the same objects as
    ``tarantella.horovod[.keras]``."""
    import importlib

    import tarantella.horovod.keras as keras_api

    for path, same_as in (("tarantella.horovod.tensorflow", horovod),
                          ("tarantella.horovod.tensorflow.keras", keras_api),
                          ("tarantella.horovod.tensorflow.keras.callbacks", horovod.callbacks),
                          ("tarantella.horovod.tensorflow.elastic", horovod.elastic),
                          ("tarantella.horovod.tensorflow.keras.elastic", keras_api.elastic)):
        module = importlib.import_module(path)
        names = [n for n in module.__all__ if n not in ("callbacks", "elastic")]
        assert names, path
        for name in names:
            assert getattr(module, name) is getattr(same_as, name), f"{path}.{name}"
