"""Writes its whole environment, in order, as JSON to $TNT_TEST_DIR/env.<rank>.json."""
import json
import os

path = os.path.join(os.environ["TNT_TEST_DIR"], f"env.{os.environ['TNT_RANK']}.json")
with open(path + ".tmp", "w") as fh:
    json.dump(list(os.environ.items()), fh)
os.replace(path + ".tmp", path)
