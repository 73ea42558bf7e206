"""An elastic allreduce loop: ``elastic_loop.py STEPS [KILL_MEMBER KILL_STEP]...``.

Each step every rank contributes ``(rank + 1) * (step + 1)``; the sum checks against the
size of the generation it completed in. The member named SIGKILLs itself at its step,
writing the time into ``$TNT_TEST_DIR/killed-M``;
``ELASTIC_HANG=M:S`` makes member M hang at step S instead; ``ELASTIC_FAIL_AT_START=M``
makes member M (a replacement) exit before ``tnt_core.init()``.
``ELASTIC_RESTART_ALL=REASON`` makes the job one that cannot lose a rank (as a pipelined
model does: a failed allreduce ends the rank with the peer-failure exit code), and
``ELASTIC_LATE_DEATH=M:S`` makes member M of the job's first start abort its communicator
at step S (its peers fail at once) and SIGKILL itself 0.5 s later;
``ELASTIC_SURVIVOR_WRITES_S=T`` makes a rank of such a job whose allreduce failed take T
seconds to write ``$TNT_TEST_DIR/wrote-M`` before it exits (as a pipeline's survivor writes
the step in flight). A
failed allreduce rejoins and redoes its step; a generation that only adds ranks is taken in
at a step's boundary the ranks agree on; ranks that joined get the step from rank 0.
Every rank prints its recoveries (kill to first completed allreduce in the new generation)
and a last line with its final rank, size and generation.
"""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import tnt_core

steps = int(sys.argv[1])
kills = {int(m): int(s) for m, s in zip(sys.argv[2::2], sys.argv[3::2], strict=True)}
folder = Path(os.environ["TNT_TEST_DIR"])
hang = tuple(int(v) for v in os.environ.get("ELASTIC_HANG", "-1:-1").split(":"))
started = time.time()
if os.environ.get("TNT_MEMBER_ID") == os.environ.get("ELASTIC_FAIL_AT_START", "-"):
    raise SystemExit(f"member {os.environ['TNT_MEMBER_ID']} fails before it joins")
rt = tnt_core.init()
me = rt.config.member_id
restart_all = os.environ.get("ELASTIC_RESTART_ALL")
if restart_all:
    rt.restart_all_on_failure(restart_all)
late_death = tuple(int(v) for v in os.environ.get("ELASTIC_LATE_DEATH", "-1:-1").split(":"))
if (folder / "late-death").exists():  # the restarted job: nobody dies again
    late_death = (-1, -1)
first_generation = rt.generation


def step_from_rank0(step: int) -> int:
    buf = np.array([step], dtype=np.int64)
    rt.backend.broadcast(buf, 0)
    return int(buf[0])


step = 0
if rt.membership is not None and rt.rank in rt.membership.joined:  # started for the job
    step = step_from_rank0(0)
# a replacement reports its first step; a survivor its first step after each rejoin
report = first_generation > 0
while step < steps:
    if hang == (me, step):
        (folder / f"killed-{me}").write_text(repr(time.time()))
        time.sleep(3600)  # alive but stuck: the stall inspector names it, tnt run evicts it
    if late_death == (me, step):
        (folder / "late-death").write_text(repr(time.time()))
        rt.backend.abort("member dies late on purpose")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if kills.get(me) == step:
        (folder / f"killed-{me}").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    x = np.full(4, (rt.rank + 1) * (step + 1), dtype=np.float64)
    try:
        # ranks that joined (their generation leaves this one working) are taken in at a
        # step's boundary that every rank agrees on: the newest generation any rank saw
        seen = np.array([rt.newest_seen()], dtype=np.int64)
        rt.backend.allreduce(seen, "max")
        if seen[0] > rt.generation:
            tnt_core.rejoin(timeout=30)
            report = True
            step = step_from_rank0(step)
            continue
        rt.backend.allreduce(x)
    except tnt_core.CommError as exc:
        if restart_all:
            writes = float(os.environ.get("ELASTIC_SURVIVOR_WRITES_S", "0"))
            if writes:
                time.sleep(writes)
                (folder / f"wrote-{me}").write_text(repr(time.time()))
            print(f"tnt_core.CommError: {exc}", file=sys.stderr, flush=True)
            sys.exit(tnt_core.PEER_FAILURE_EXIT_CODE)
        tnt_core.rejoin(timeout=30)
        report = True
        if rt.membership is not None and rt.membership.joined:
            step = step_from_rank0(step)
        continue  # the failed step is redone
    size = rt.size
    if not (x == (step + 1) * size * (size + 1) / 2).all():
        raise SystemExit(f"member {me}: wrong sum {x[0]} at step {step} with {size} ranks")
    killed = sorted(folder.glob("killed-*"), key=lambda p: p.stat().st_mtime)
    if report and killed:
        kill_time = float(killed[-1].read_text())
        role = "replacement" if first_generation > 0 else "survivor"
        print(f"recovered {role} member {me} generation {rt.generation} "
              f"seconds {time.time() - kill_time:.3f} start {started - kill_time:.3f}", flush=True)
    report = False
    step += 1
    time.sleep(0.01)
print(f"done member {me} rank {rt.rank} size {rt.size} generation {rt.generation} steps {step}",
      flush=True)
