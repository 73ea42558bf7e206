"""Records its pid, then sleeps; rank $TNT_TEST_FAIL_RANK exits with $TNT_TEST_FAIL_CODE
(or kills itself with signal $TNT_TEST_FAIL_SIGNAL) once every rank has started."""
import os
import sys
import time

rank, size = int(os.environ["TNT_RANK"]), int(os.environ["TNT_SIZE"])
outdir = os.environ["TNT_TEST_DIR"]
with open(os.path.join(outdir, f"pid.{rank}.tmp"), "w") as fh:
    fh.write(str(os.getpid()))
os.replace(os.path.join(outdir, f"pid.{rank}.tmp"), os.path.join(outdir, f"pid.{rank}"))
if str(rank) == os.environ.get("TNT_TEST_FAIL_RANK"):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(outdir, f"pid.{r}")) for r in range(size)):
        time.sleep(0.05)
    print(f"rank {rank} is failing on purpose", file=sys.stderr, flush=True)
    with open(os.path.join(outdir, "failed_at"), "w") as fh:
        fh.write(repr(time.time()))
    if os.environ.get("TNT_TEST_FAIL_SIGNAL"):
        os.kill(os.getpid(), int(os.environ["TNT_TEST_FAIL_SIGNAL"]))
    sys.exit(int(os.environ.get("TNT_TEST_FAIL_CODE", "1")))
time.sleep(float(os.environ.get("TNT_TEST_SLEEP", "120")))
