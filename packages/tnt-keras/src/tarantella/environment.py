"""Process set-up done once, when ``tarantella`` is imported (before TensorFlow starts).

* GPU ranks: each rank sees one GPU (``local_rank % local GPUs``) with memory growth on, so
  N ranks on one node share the node's GPUs instead of all allocating GPU 0.
* CPU ranks: TensorFlow's intra-op thread pool gets ``TNT_NUM_THREADS`` threads, else
  ``cores / ranks on this node``, so N ranks do not oversubscribe the cores; a rank that
  may use one CPU gets two inter-op threads (:func:`_set_inter_op_threads`). A user's own
  choice (``TF_NUM_INTRAOP_THREADS``, ``TF_NUM_INTEROP_THREADS`` or ``tf.config.threading``
  calls) is kept.
* A fixed global TensorFlow seed when the user has set none, so that an unseeded
  ``Dataset.shuffle`` gives every rank the same order (the Tarantella behaviour: "when no
  seed is given, a fixed default seed is used"). The value is TensorFlow's own
  ``DEFAULT_GRAPH_SEED``: with no global seed, TensorFlow pairs an op seed (``shuffle(seed=3)``)
  with exactly that value, so ops the user seeded get the same random streams as in a serial
  run without tarantella; only unseeded ops change (from random to fixed).

All of this must happen before TensorFlow creates its runtime context; the README says
"import tarantella before running TensorFlow code", as the Tarantella manual does.
"""

from __future__ import annotations

import os
import warnings

import tensorflow as tf

import tnt_core

from .errors import NotSupportedError
from .reporting.log import logger
from .reporting.user_frames import user_stacklevel

__all__ = ["DEFAULT_SHUFFLE_SEED", "configure_process", "intra_op_threads_for", "refuse_in_elastic_job"]

#: The global TensorFlow seed set when the user has none: TensorFlow's DEFAULT_GRAPH_SEED
#: (what ``tf.compat.v1.random.get_seed`` pairs an op seed with when there is no global
#: seed), see the module docstring.
DEFAULT_SHUFFLE_SEED = 87654321


def intra_op_threads_for(num_threads: int | None, local_size: int, cpu_count: int | None) -> int:
    """Intra-op threads of one CPU rank: ``TNT_NUM_THREADS`` or cores / local ranks (>= 1)."""
    if num_threads:
        return num_threads
    return max(1, (cpu_count or 1) // max(1, local_size))


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _place_on_gpu(runtime: tnt_core.Runtime) -> bool:
    """Make exactly one GPU visible to this rank; True when this rank uses a GPU."""
    try:
        gpus = tf.config.list_physical_devices("GPU")
    except Exception:  # noqa: BLE001 (a broken driver must not stop CPU training)
        return False
    if not gpus:
        return False
    gpu = gpus[runtime.local_rank % len(gpus)]
    try:
        tf.config.set_visible_devices([gpu], "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError as exc:  # TensorFlow already started: too late to choose
        warnings.warn(
            f"tarantella could not assign GPU {gpu.name} to rank {runtime.rank} ({exc}); "
            "import tarantella before running any TensorFlow code",
            stacklevel=user_stacklevel(),
        )
    if len(gpus) < runtime.local_size:
        logger.warning("%d ranks on this node share %d GPU(s)", runtime.local_size, len(gpus))
    return True


def _set_cpu_threads(runtime: tnt_core.Runtime) -> None:
    num_threads = runtime.config.num_threads
    if os.environ.get("TF_NUM_INTRAOP_THREADS"):
        return  # the user's choice
    if tf.config.threading.get_intra_op_parallelism_threads() != 0:
        return  # set by the user through tf.config before importing tarantella
    if runtime.local_size == 1 and not num_threads:
        return  # one rank per node: TensorFlow's default (all cores) is right
    threads = intra_op_threads_for(num_threads, runtime.local_size, _cpu_count())
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:
        if num_threads:  # asked for explicitly: say why it did not happen
            warnings.warn(
                f"TNT_NUM_THREADS={num_threads} could not be applied because "
                "TensorFlow already started; import tarantella before running TensorFlow code",
                stacklevel=user_stacklevel(),
            )


def _set_inter_op_threads() -> None:
    """Two inter-op threads for a rank that may use one CPU (``tnt run`` binds each rank of
    a host with two cores to one of them), unless the user chose a number.

    Why: TensorFlow sizes its inter-op pool by the CPUs the process may use, and a rank's
    waits for a peer (a pipeline stage's receive, the wait for the gradients' allreduce)
    are kernels that hold the thread they run on; with one thread the rank's other ops
    wait behind them instead of running. A 2-stage pipeline, each rank bound to a CPU:
    7 % slower with one thread than with two (docs/performance.md, "Each rank on cores of
    its own")."""
    if os.environ.get("TF_NUM_INTEROP_THREADS") or _cpu_count() >= 2:
        return
    if tf.config.threading.get_inter_op_parallelism_threads() != 0:
        return  # set by the user through tf.config before importing tarantella
    try:
        tf.config.threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:  # TensorFlow already started: its pool stays as it is
        pass


def _set_default_seed() -> None:
    """``DEFAULT_SHUFFLE_SEED`` as the global seed unless the user set another. TensorFlow has
    no public getter of the global seed; ``get_seed`` with an op seed returns it, or
    DEFAULT_GRAPH_SEED without one, and draws nothing from the op-seed sequence (without an
    op seed it would). A user's seed equal to the default is set again: the same seed."""
    global_seed, _ = tf.compat.v1.random.get_seed(0)
    if global_seed == DEFAULT_SHUFFLE_SEED:
        tf.random.set_seed(DEFAULT_SHUFFLE_SEED)


def refuse_in_elastic_job(what: str) -> None:
    """What an elastic job cannot go on with after a rank left is refused before it starts."""
    runtime = tnt_core.init()
    if getattr(runtime, "membership", None) is not None:
        raise NotSupportedError(
            f"{what} cannot go on when ranks leave an elastic job (tnt run --min-np): only "
            "the data-parallel tnt.Model's fit, evaluate and predict, and a loop with "
            "hvd.DistributedGradientTape under hvd.elastic.run (tarantella.horovod), can; "
            "run without the elastic options")


def configure_process(runtime: tnt_core.Runtime) -> None:
    """Device placement, CPU threads and the default seed for this rank. Local rank and
    size come from the started runtime (under mpiexec, MPI knows them, not the environment);
    starting it runs no TensorFlow."""
    if not _place_on_gpu(runtime):
        _set_cpu_threads(runtime)
        _set_inter_op_threads()
    _set_default_seed()
