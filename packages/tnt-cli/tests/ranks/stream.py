"""Prints a line, then waits (at most 30 s) for the test to create $TNT_TEST_DIR/go:
the test can only create it if the line reached it while this rank still runs."""
import os
import sys
import time

print("first line", flush=True)
go = os.path.join(os.environ["TNT_TEST_DIR"], "go")
deadline = time.monotonic() + 30
while not os.path.exists(go):
    if time.monotonic() > deadline:
        print("nobody saw the first line in time", file=sys.stderr)
        sys.exit(5)
    time.sleep(0.05)
print("second line", flush=True)
