"""A rank of a ``horovod.run`` job (``python -m tarantella.horovod._rank_call JOB_DIR``):
import the function where ``run`` found it, call it, pickle its result for ``run``."""

from __future__ import annotations

import functools
import importlib
import pickle
import runpy
import sys
from pathlib import Path
from typing import Any

import tnt_core


def _function(call: dict[str, Any]) -> Any:
    if call["kind"] == "path":  # the started script, its `if __name__ == "__main__"` block skipped
        script = Path(call["place"])
        sys.path.insert(0, str(script.parent))
        namespace: Any = runpy.run_path(str(script), run_name="__tnt_horovod_run__")
        return functools.reduce(lambda obj, attr: obj[attr] if isinstance(obj, dict) else getattr(obj, attr),
                                call["name"].split("."), namespace)
    return functools.reduce(getattr, call["name"].split("."), importlib.import_module(call["place"]))


def main(job: Path) -> None:
    with open(job / "call.pickle", "rb") as f:
        call = pickle.load(f)
    result = _function(call)(*call["args"], **call["kwargs"])
    rank = tnt_core.init().rank
    with open(job / f"result.rank{rank}.pickle.tmp", "wb") as f:
        pickle.dump(result, f)
    (job / f"result.rank{rank}.pickle.tmp").rename(job / f"result.rank{rank}.pickle")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
