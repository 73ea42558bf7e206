"""Helpers of the tnt-keras tests (imported by the test modules; conftest puts this folder on sys.path).

Multi-rank tests run once per *launchable* backend. The rule, small and explicit:

* ``store`` (tnt-core's reference backend, never chosen unless named) is always launchable;
* any other installed backend except ``local`` is launchable when it declares itself
  available (``BackendSpec.is_available``) to a rank started the way ``tnt run`` and
  ``tnt_core.testing.launch_ranks`` start ranks — ``TNT_RANK``/``TNT_SIZE``/``TNT_RENDEZVOUS``
  set, *no* backend named. Gloo says yes. The MPI backend says yes only under ``mpiexec``/
  ``srun`` (it takes rank and size from MPI), so it is skipped here and tested by its own
  package under ``mpiexec``; should it learn tnt-run-style launch, it is picked up.

``TNT_KERAS_TEST_BACKENDS=gloo`` (comma-separated) narrows the list.

TensorFlow costs seconds per process, so each test module starts its ranks once per
(backend, number of ranks) with a worker script that does all its checks and writes results
to files; the tests compare those files.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import tnt_core
from tnt_core.testing import launch_ranks

HERE = Path(__file__).parent
WORKERS = HERE / "workers"
#: quiet TensorFlow's C++ start-up chatter in rank outputs
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONWARNINGS": "ignore"}


def launchable_backends() -> list[str]:
    """Installed backends that can serve ranks started by a launcher (see module doc)."""
    names = []
    for spec in tnt_core.list_backends():
        if spec.name == "local":
            continue
        probe = tnt_core.Config(rank=0, size=2, local_rank=0, local_size=2, backend=None,
                                rendezvous="127.0.0.1:1", rendezvous_key="probe", launched=True)
        if spec.name == "store" or spec.is_available(probe):
            names.append(spec.name)
    return names


def _selected(names: list[str]) -> list[str]:
    """``TNT_KERAS_TEST_BACKENDS=a,b`` narrows the backends (e.g. CI time); unknown names fail."""
    wanted = [n.strip() for n in os.environ.get("TNT_KERAS_TEST_BACKENDS", "").split(",") if n.strip()]
    if not wanted:
        return names
    missing = [n for n in wanted if n not in names]
    if missing:
        raise RuntimeError(f"TNT_KERAS_TEST_BACKENDS names {missing}, which cannot serve launched "
                           f"ranks here; launchable: {names}")
    return wanted


BACKENDS = _selected(launchable_backends())


def run_workers(script: str, args: list[str], nprocs: int, backend: str, *,
                timeout: float = 600, env: dict | None = None, cwd: str | None = None):
    """Start ``nprocs`` ranks of a worker script; fail the test with every rank's output."""
    backend = None if backend == "local" else backend  # a 1-rank job: the launcher's default
    result = launch_ranks([str(WORKERS / script), *args], nprocs, backend=backend, timeout=timeout,
                          tnt_timeout_s=300, env={**QUIET, **(env or {})}, cwd=cwd)
    return result.check()


def run_serial(script: str, args: list[str], *, timeout: float = 600, cwd: str | None = None):
    """Run a worker script as one plain process (no launcher environment)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("TNT_")}
    env.update(QUIET)
    proc = subprocess.run([sys.executable, str(WORKERS / script), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"serial worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


@dataclass(frozen=True)
class SuiteLaunch:
    """One launch of ``workers/suite_worker.py``: ``nprocs`` ranks on ``backend`` (None: no
    backend here can serve it). Every launch runs the workers that compare with the serial
    run; ``also`` names the ones without a serial part that it runs too."""

    backend: str | None
    nprocs: int
    also: tuple[str, ...] = ()
    #: the parts of ``suite_worker`` it runs (every one: empty)
    parts: tuple[str, ...] = ()
    #: the fidelity cases it runs (every one: empty), those where its path differs from the
    #: other launches'
    fidelity_cases: tuple[str, ...] = ()

    def runs(self, part: str) -> bool:
        return not self.parts or part in self.parts

    def skip_unless_it_runs(self, part: str) -> None:
        """Skip the calling test when this launch leaves ``part`` to the others."""
        if not self.runs(part):
            pytest.skip(f"the {self.id} launch runs {', '.join(self.parts)} of suite_worker's parts "
                        "(tnt_keras_helpers.SUITE_LAUNCHES)")

    def runs_case(self, case: str) -> bool:
        return self.runs("fidelity") and (not self.fidelity_cases or case in self.fidelity_cases)

    @property
    def id(self) -> str:
        return f"{self.backend or 'nobackend'}-{self.nprocs}rank{'s' if self.nprocs > 1 else ''}"


_NATIVE_BACKENDS = [b for b in BACKENDS if b != "store"]
#: The launches of ``workers/suite_worker.py`` (conftest's ``rank_suite``), one per thing a
#: launch shows that the others cannot; 2 ranks on gloo or 3 on store would show nothing
#: more (the backends' own conformance suites run every size), for another TensorFlow
#: start-up per rank.
#: 1 rank, on the backend a launcher picks for it (``local``): ``tnt.Model`` with no
#: collectives at all: the data pipeline with no sharding, training, and the fidelity cases
#: whose data or layers take a path of their own; the callbacks' and files' checks
#: (``features``) show nothing on one rank, where the only rank is the master.
ONE_RANK = SuiteLaunch("local", 1, parts=("data", "train", "fidelity"),
                       fidelity_cases=("dense3d_dataset", "generator", "pydataset",
                                       "unknown_cardinality", "mixed_precision", "synchronized_bn"))
#: 3 ranks on the first launchable backend other than ``store`` (gloo): the native gradient
#: path; 3 ranks divide none of the global batches, and with a global batch of one, two
#: ranks hold no sample.
NATIVE_PATH = SuiteLaunch(_NATIVE_BACKENDS[0] if _NATIVE_BACKENDS else None, 3,
                          also=("channel", "small_batches", "collectives"))
#: 2 ranks on ``store``, tnt-core's reference backend (``launch_ranks`` registers it in the
#: ranks it starts): no native hand-off, so the Python gradient path: training, XLA (2-rank
#: launches only), and the fidelity cases whose gradients take it differently (loss
#: scaling, two optimizers, a user's step, batch-wise calls, sparse and synchronized
#: layers). The data pipeline, the data cases and the callbacks' files do not touch the
#: gradient path: the 3-rank launch runs them. Also the logs wrapped callbacks receive,
#: against plain Keras in the ranks' own processes (2 ranks: each shard differs from the
#: global batch); and an elastic job's agreement of two ranks.
PYTHON_PATH = SuiteLaunch("store", 2, also=("channel", "callback_logs", "collectives",
                                            "elastic_agree"),
                          parts=("train", "fidelity", "xla"),
                          fidelity_cases=("custom_training", "two_optimizers", "on_batch",
                                          "mixed_precision", "synchronized_bn",
                                          "position_embedding", "two_outputs"))
SUITE_LAUNCHES = (ONE_RANK, NATIVE_PATH, PYTHON_PATH)

#: test_pipeline_model's launches (conftest's ``pipelined_model_runs``): layout -> (stages,
#: strategy, ranks)
PIPELINE_LAYOUTS = {"3-stages": (3, "pipelining", 3), "2-stages-x-2-pipelines": (2, "all", 4)}
#: the layout whose serial run also makes the sparse cases' reference (the same for every
#: layout: their model is cut automatically)
PIPELINE_SPARSE_REFERENCE = "3-stages"
#: the layout that runs the routing cases (dict inputs, the graphs, bucketed batches)
PIPELINE_ROUTING = "3-stages"
#: the backend users run (gloo, which has point-to-point); tnt-core's reference backend else
PIPELINE_BACKEND = "gloo" if "gloo" in BACKENDS else "store"


def launch_params(launches: Sequence[SuiteLaunch]) -> list:
    """pytest parameters of ``launches``, each with its id; a clear skip for a launch no
    backend here can serve."""
    return [pytest.param(launch, id=launch.id, marks=[] if launch.backend else pytest.mark.skip(
        reason="no installed backend but store can serve launched ranks")) for launch in launches]


class EchoPeerBackend(tnt_core.CommBackend):
    """Rank 0 of 2 whose peer agrees and adds nothing (every collective returns this rank's
    own values), and which has no point-to-point: for tests of what a rank sends, in one
    process."""

    name = "collectives-only"
    rank, size, local_rank, local_size = 0, 2, 0, 2

    def allreduce_async(self, buf, op="sum"):
        return tnt_core.CompletedHandle(buf)

    def broadcast(self, buf, root=0):
        return buf

    def allgather(self, buf):
        return np.stack([buf, buf])

    def barrier(self):
        pass

    def close(self):
        pass
