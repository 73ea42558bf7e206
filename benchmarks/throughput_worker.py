"""One process of a throughput measurement: trains a benchmark model and reports samples/s.

Modes:
  keras  a plain Keras 3 process (the serial reference)
  tnt    one rank of a Tarantella-NT job (start it with `tnt run`)
  mwms   one worker of tf.distribute.MultiWorkerMirroredStrategy; needs legacy tf-keras
         (TF_USE_LEGACY_KERAS=1) and TF_CONFIG, set by benchmarks/scaling.py

Every mode uses 1 intra-op thread unless --threads says otherwise (and every CPU unless
--cpus says otherwise: TensorFlow still runs independent ops and the input pipeline on
other threads, so a single process with 1 intra-op thread uses more than one core), trains
--warmup steps
untimed, then --steps timed steps, and writes a JSON line to --out (rank 0 / chief only). Beside
samples/s it reports this process's CPU time per timed step (every thread, user + system) and
the 1-minute load average when it ended: on a shared machine, other work lengthens the wall
time of a step much more than its CPU time, so the two together tell a slow step from a
starved one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("keras", "tnt", "mwms"), required=True)
    p.add_argument("--model", default="mlp")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-overlap", action="store_true", help="tnt: all allreduces after backprop")
    p.add_argument("--comm-free", action="store_true",
                   help="tnt, diagnostic only: every gradient allreduce is a no-op (the ranks do "
                        "not average their gradients), to measure the throughput without "
                        "communication: the bound that faster collectives could approach; on "
                        "the Python gradient path (TNT_NATIVE_OPS=false), whose collectives "
                        "the no-op replaces")
    p.add_argument("--cpus", type=int, default=0,
                   help="run on this many CPUs only (the first ones this process may use); 0: all")
    p.add_argument("--pin", type=int, default=-1,
                   help="hold the process to this one CPU (independent comm-free ranks)")
    p.add_argument("--pin-local-rank", action="store_true",
                   help="tnt: hold each rank to the CPU of its local rank (TNT_LOCAL_RANK)")
    p.add_argument("--jit", action="store_true",
                   help="keras, tnt: compile with jit_compile=True (XLA; tnt compiles the step's "
                        "body and update, the collectives run between them)")
    p.add_argument("--update-as-ops", action="store_true",
                   help="compile with jit_compile=False: a tnt.Model's optimizer update as "
                        "TensorFlow ops, not compiled with XLA (what jit_compile='auto' does "
                        "without a GPU); plain Keras runs the same either way there")
    p.add_argument("--priority", type=int, default=None,
                   help="run at this nice value in a scheduling group of its own (root for a "
                        "negative one): see set_priority")
    p.add_argument("--count-frames", action="store_true",
                   help="count Python frames entered per timed step, on every thread (slow)")
    p.add_argument("--lockstep", type=Path, default=None,
                   help="a file that --lockstep-of independent processes share: each waits at "
                        "the end of every step until all have ended it (see Lockstep)")
    p.add_argument("--lockstep-of", type=int, default=0, help="the processes of --lockstep")
    p.add_argument("--lockstep-index", type=int, default=0, help="this process among them")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def set_priority(nice: int) -> None:
    """This process (and the threads it starts later) at ``nice``, in a session of its own.

    Why a session: with the kernel's autogroup scheduling on
    (``/proc/sys/kernel/sched_autogroup_enabled``), every session is one scheduling group
    and a nice value only ranks the threads of its own group; the group's weight against
    the other sessions' is the nice value in ``/proc/self/autogroup``. ``tnt run`` starts
    each rank in a session of its own, so a priority given to the benchmark's parent would
    hold for plain Keras and not for the ranks: each process sets its own."""
    if os.getsid(0) != os.getpid():
        os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup in this kernel: the nice value is the whole priority
        pass
    os.setpriority(os.PRIO_PROCESS, 0, nice)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class StepTimer:
    """Records the wall time and the process's CPU time at the end of every training batch."""

    def __init__(self):
        self.times = []
        self.cpu = []

    def callback(self, keras):
        timer = self

        class _Cb(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                timer.times.append(time.perf_counter())
                timer.cpu.append(_cpu_seconds())

        return _Cb()


class Lockstep:
    """Independent processes that wait for each other at the end of every step, with no data.

    Why: the ranks of a synchronous job wait for the slowest of them at every step (its
    gradients are summed before any rank updates), so the step takes the longest of the
    ranks' step times, and every rank's jitter (the VM's, the other processes') becomes
    everybody's. The comm-free bound runs the same step with no collective *and* no wait;
    this runs it with the wait alone: what synchronisation costs before a byte is moved.

    A counter per process in a shared file (its own cache line); a process publishes its
    step count and polls the others', yielding its CPU between looks (each process is held
    to a CPU of its own, so the wait costs no other process any time)."""

    def __init__(self, path: Path, size: int, index: int, timeout: float = 60.0) -> None:
        import mmap

        self.size, self.index, self.timeout, self.step = size, index, timeout, 0
        with open(path, "a+b") as f:
            if os.fstat(f.fileno()).st_size < 64 * size:
                f.truncate(64 * size)
            self.map = mmap.mmap(f.fileno(), 64 * size)
        self.counters = memoryview(self.map).cast("q")  # one int64 per 64-byte line: [8 * i]

    def wait(self) -> None:
        self.step += 1
        self.counters[8 * self.index] = self.step
        deadline = time.monotonic() + self.timeout
        for i in range(self.size):
            while self.counters[8 * i] < self.step:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"lockstep: process {i} did not end step {self.step} "
                                       f"within {self.timeout:g} s")
                os.sched_yield()

    def callback(self, keras):
        lockstep = self

        class _Cb(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                lockstep.wait()

        return _Cb()


class FrameCounter:
    """Python frames entered per step, on every thread (sys.setprofile, threading.setprofile)
    from the end of the warm-up to the end of training; Keras' own loop included, so compare
    paths, not absolute counts."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.calls, self.steps, self.on = warmup, 0, 0, False

    def _profile(self, frame, event, arg):
        if event == "call":
            self.calls += 1

    def callback(self, keras):
        import sys
        import threading

        counter = self

        class _Cb(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 == counter.warmup:
                    counter.on = True
                    threading.setprofile(counter._profile)
                    sys.setprofile(counter._profile)
                    counter.trace_numpy_functions()
                elif counter.on:
                    counter.steps += 1

            def on_train_end(self, logs=None):
                sys.setprofile(None)
                threading.setprofile(None)

        return _Cb()

    def trace_numpy_functions(self) -> None:
        """tf.numpy_function bodies run on TensorFlow's own threads, which neither profile
        hook reaches (Python 3.11 has no setprofile for every thread): profile each call
        on the thread that runs it (TensorFlow's registry of py_funcs: a diagnostic-only
        use of a private name)."""
        import sys

        from tensorflow.python.ops import script_ops

        original = script_ops.FuncRegistry.__call__
        counter = self

        def traced(registry, *args, **kwargs):
            if not counter.on:
                return original(registry, *args, **kwargs)
            sys.setprofile(counter._profile)
            try:
                return original(registry, *args, **kwargs)
            finally:
                sys.setprofile(None)

        script_ops.FuncRegistry.__call__ = traced

    def per_step(self) -> float:
        return self.calls / max(self.steps, 1)


def main() -> int:
    args = parse()
    if args.priority is not None:
        set_priority(args.priority)
    if args.cpus:  # before TensorFlow starts its thread pools
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, allowed[:args.cpus])
    if args.pin_local_rank:
        args.pin = int(os.environ.get("TNT_LOCAL_RANK", "0")) % len(os.sched_getaffinity(0))
    if args.pin >= 0:
        os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[args.pin]])
    if args.mode == "mwms":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(max(args.threads, 2))
    import models

    steps = args.warmup + args.steps
    workers, rank, is_chief = 1, 0, True
    if args.mode == "mwms":
        import tf_keras as keras

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        workers = strategy.num_replicas_in_sync
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        is_chief = rank == 0
        with strategy.scope():
            model = models.compile_for_benchmark(models.build(args.model, keras), keras)
    else:
        import keras

        model = models.build(args.model, keras)
        if args.mode == "tnt":
            if args.no_overlap:
                os.environ["TNT_OVERLAP"] = "0"
            if args.comm_free:  # the native ops call the backend's C table, which the no-op
                os.environ["TNT_NATIVE_OPS"] = "false"  # below cannot replace: Python path
            import tarantella as tnt

            workers, rank = tnt.get_size(), tnt.get_rank()
            is_chief = tnt.is_master_rank()
            model = tnt.Model(model)
            if args.comm_free:
                import tnt_core

                backend = tnt_core.init().backend  # the runtime tnt.Model started
                backend.allreduce_async = lambda buf, op="sum": tnt_core.CompletedHandle(buf)
        models.compile_for_benchmark(
            model, keras, jit_compile=True if args.jit else False if args.update_as_ops else "auto")

    global_batch = args.micro_batch * workers
    x, y = models.synthetic_data(args.model, global_batch * steps)
    timer = StepTimer()
    frames = FrameCounter(args.warmup) if args.count_frames else None
    if args.mode == "mwms":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat()
        model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer.callback(keras)])
    else:
        lockstep = ([Lockstep(args.lockstep, args.lockstep_of, args.lockstep_index).callback(keras)]
                    if args.lockstep else [])  # before the timer: a step ends when all have
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=lockstep + [timer.callback(keras)]
                  + ([frames.callback(keras)] if frames else []))
    timed = timer.times[args.warmup - 1:]
    seconds = timed[-1] - timed[0]
    cpu_seconds = timer.cpu[-1] - timer.cpu[args.warmup - 1]
    result = {
        "mode": args.mode, "model": args.model, "workers": workers, "micro_batch": args.micro_batch,
        "global_batch": global_batch, "steps": len(timed) - 1, "seconds": seconds,
        "samples_per_s": global_batch * (len(timed) - 1) / seconds,
        "overlap": not args.no_overlap, "comm_free": args.comm_free, "jit": args.jit,
        "update_as_ops": args.update_as_ops,
        "params": int(model.count_params()), "cpus": len(os.sched_getaffinity(0)),
        "cpu_ms_per_step": 1e3 * cpu_seconds / (len(timed) - 1), "load": os.getloadavg()[0],
    }
    if frames is not None:
        result["frames_per_step"] = frames.per_step()
    if is_chief:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
