"""Writes its whole environment, in order, as JSON to $TNT_TEST_DIR/env.<rank>.json, and the
CPUs it may run on to $TNT_TEST_DIR/cpus.<rank>.json."""
import json
import os

for name, value in (("env", list(os.environ.items())), ("cpus", sorted(os.sched_getaffinity(0)))):
    path = os.path.join(os.environ["TNT_TEST_DIR"], f"{name}.{os.environ['TNT_RANK']}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(value, fh)
    os.replace(path + ".tmp", path)
