"""``horovod.run``: run a function on the ranks of a new job, launched by ``tnt run``.

Horovod's examples end with ``horovod.run(main, np=..., hosts=...)`` when they are started
as a plain script rather than by ``horovodrun``. Here ``tnt run`` (tnt-cli) starts the ranks;
each rank imports the function's module again (a function of the started script: the
script itself, without running its ``if __name__ == "__main__"`` block), calls it with the
pickled arguments and pickles what it returns, so ``run`` gives Horovod's list of results
in rank order.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import NotSupportedError

__all__ = ["run"]

#: Horovod's arguments of ``run`` that only tune its own launcher: accepted, without effect
_LAUNCHER_TUNING = frozenset({
    "slots", "reset_limit", "cooldown_range", "elastic_timeout", "start_timeout", "ssh_port",
    "ssh_identity_file", "disable_cache", "output_filename", "verbose", "use_jsrun", "mpi_args",
    "network_interface", "network_interfaces", "executable",
})


def _one_of(where: str, new: str, old: str, values: dict[str, Any]) -> Any:
    """Horovod's argument ``new`` or its deprecated spelling ``old`` (not both, unless equal)."""
    a, b = values.get(new), values.get(old)
    if a is not None and b is not None and a != b:
        raise ValueError(f"{where}: {new}={a!r} and the older {old}={b!r} disagree; pass one")
    return a if a is not None else b


def _where(func: Callable[..., Any]) -> tuple[str, str]:
    """``(kind, place)`` a rank imports ``func`` from: ``("path", script)`` for a function of
    the started script, ``("module", name)`` for a function of an importable module."""
    qualname = getattr(func, "__qualname__", "")
    module = getattr(func, "__module__", None)
    nested = "<locals>" in qualname or "<lambda>" in qualname
    if not callable(func) or not qualname or nested or module is None:
        raise TypeError(
            f"horovod.run(func, ...) needs a function defined at the top level of a module or "
            f"of the script, which every rank can import again; got {func!r}"
        )
    if module == "__main__":
        script = getattr(sys.modules["__main__"], "__file__", None)
        if not script:
            raise NotSupportedError(
                "horovod.run: the function comes from an interactive session, which the ranks "
                "cannot import; put it in a script or module"
            )
        return "path", str(Path(script).resolve())
    return "module", module


def _tnt_run_command() -> list[str]:
    if importlib.util.find_spec("tnt_cli") is None:
        raise NotSupportedError(
            "horovod.run starts its ranks with `tnt run`, which is in the tnt-cli package: "
            "pip install tnt-cli (or start the script itself with `tnt run -n N -- script.py`)"
        )
    return [sys.executable, "-m", "tnt_cli", "run"]


def run(func: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
        num_proc: int | None = None, min_num_proc: int | None = None,
        max_num_proc: int | None = None, hosts: str | None = None, hostfile: str | None = None,
        host_discovery_script: str | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, env: dict[str, str] | None = None, np: int | None = None,
        min_np: int | None = None, max_np: int | None = None, **launcher: Any) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks (``hosts`` as horovodrun's ``-H``,
    or a ``hostfile`` with ``slots=``) and return each rank's result, in rank order; a failed
    rank raises ``RuntimeError`` here, as in Horovod. ``np``, ``min_np``, ``max_np`` are
    Horovod's older spellings.

    Elastic: ``min_num_proc`` starts the job with ``tnt run --min-np`` (a function under
    ``hvd.elastic.run`` goes on over the ranks that are left; the results are then those of
    the ranks at the end). ``max_num_proc`` above ``num_proc`` and ``host_discovery_script``
    ask for ranks that join, which tnt-keras refuses in one line when it is imported.
    """
    unknown = sorted(set(launcher) - _LAUNCHER_TUNING)
    if unknown:
        raise TypeError(f"horovod.run() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    if use_gloo and use_mpi:
        raise ValueError("horovod.run: use_gloo=True and use_mpi=True ask for two backends; choose one")
    given = {"num_proc": num_proc, "np": np, "min_num_proc": min_num_proc, "min_np": min_np,
             "max_num_proc": max_num_proc, "max_np": max_np}
    nprocs = _one_of("horovod.run", "num_proc", "np", given)
    nprocs = 1 if nprocs is None else nprocs
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"horovod.run: np must be a positive number of ranks, got {nprocs!r}")
    least = _one_of("horovod.run", "min_num_proc", "min_np", given)
    most = _one_of("horovod.run", "max_num_proc", "max_np", given)
    kind, place = _where(func)
    command = _tnt_run_command() + ["-n", str(nprocs)]
    if least is not None:
        command += ["--min-np", str(least)]
    if most is not None and most > nprocs:
        command += ["--max-np", str(most)]
    if host_discovery_script:
        command += ["--host-discovery-script", str(host_discovery_script)]
    if hosts:
        command += ["-H", hosts]
    if hostfile:
        command += ["--hostfile", str(hostfile)]
    if use_gloo or use_mpi:
        command += ["--backend", "gloo" if use_gloo else "mpi"]
    for name, value in (env or {}).items():
        command += ["-x", f"{name}={value}"]
    with tempfile.TemporaryDirectory(prefix="tnt-horovod-run-") as tmp:
        job = Path(tmp)
        with open(job / "call.pickle", "wb") as f:
            pickle.dump({"kind": kind, "place": place, "name": func.__qualname__,
                         "args": tuple(args), "kwargs": dict(kwargs or {})}, f)
        command += ["--", sys.executable, "-m", "tarantella.horovod._rank_call", str(job)]
        ended = subprocess.run(command, check=False)
        if ended.returncode != 0:
            raise RuntimeError(  # as Horovod's run raises it
                f"horovod.run: the job of {nprocs} rank(s) failed with exit code {ended.returncode} "
                "(the failing rank's output is above)"
            )
        results = []
        for rank in range(nprocs):
            path = job / f"result.rank{rank}.pickle"
            if least is not None and not path.exists():
                break  # an elastic job that ended with fewer ranks: theirs, in their final order
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results
