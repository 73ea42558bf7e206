"""Every ``TNT_*`` environment variable of Tarantella-NT: name, type, default, one-line doc.

The one home of the launcher contract and of every setting (in the spirit of
OpenTelemetry-python's ``environment_variables``): readers (:class:`tnt_core.Config`, the
backends, tnt-keras) parse a variable through its declaration, the launcher writes it
through :meth:`tnt_core.Config.to_env`, and the docs' tables are generated from here, so
a name, a default or a rule cannot differ between two places. A test fails when a
``TNT_*`` name in the packages' sources is not declared here.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from .addresses import can_bind
from .errors import ConfigError

__all__ = [
    "GROUPS",
    "VARIABLES",
    "Variable",
    "bad_input",
    "env_number",
    "parse_bool",
    "read_setting",
    "variable",
]

_E = TypeVar("_E", bound=BaseException)
_hook_lock = threading.Lock()
_hook_installed = False
_BAD_INPUT = "_tnt_bad_input"  # the attribute that marks an exception as bad input


def bad_input(exc: _E) -> _E:
    """Mark ``exc`` as a mistake in the user's input (a ``TNT_*`` value, a plugin name):
    should nothing catch it, it ends the process with one line, ``module.Class: message``,
    as Python's last traceback line reads, instead of a traceback through tnt-core that
    says nothing more (all of it with ``TNT_LOG_LEVEL=DEBUG``). Returns ``exc``:
    ``raise bad_input(ConfigError(...))``.
    """
    setattr(exc, _BAD_INPUT, True)
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            _hook_installed = True
            sys.excepthook = _one_line_hook(sys.excepthook)
    return exc


def _one_line_hook(previous: Callable[[type[BaseException], BaseException, TracebackType | None],
                                      None]
                   ) -> Callable[[type[BaseException], BaseException, TracebackType | None], None]:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        debug = (logging.getLogger("tnt").isEnabledFor(logging.DEBUG)
                 or os.environ.get("TNT_LOG_LEVEL", "").strip().upper() == "DEBUG")
        if debug or not getattr(exc, _BAD_INPUT, False):
            previous(exc_type, exc, tb)
            return
        sys.stderr.write(traceback.format_exception_only(exc_type, exc)[-1])
        sys.stderr.flush()

    return hook

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(name: str, value: str) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (blank: false); anything else fails."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise bad_input(ConfigError(f"{name}={value!r} is not a boolean; use true/false (or 1/0)"))


def env_number(env: Mapping[str, str], name: str, default: Any, *, integer: bool = False,
               minimum: float | None = None, above: float | None = None,
               maximum: float | None = None, multiple_of: int | None = None,
               unit: str = "") -> Any:
    """The number in ``env[name]`` (``default`` when unset or blank), checked.

    One parser for every ``TNT_*`` number, so that a bad value always reads the same: the
    variable, its value, and what it must be.
    """
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        what = "an integer" if integer else "a number"
        raise bad_input(ConfigError(
            f"{name}={raw!r} is not {what}{f' ({unit})' if unit else ''}")) from None
    in_range = ((minimum is None or value >= minimum) and (above is None or value > above)
                and (maximum is None or value <= maximum))
    if not in_range or (multiple_of and value % multiple_of):
        raise bad_input(ConfigError(f"{name}={value} must be "
                                    f"{_rule_text(minimum, above, maximum, multiple_of)}"))
    return value


def _rule_text(minimum: float | None, above: float | None, maximum: float | None,
               multiple_of: int | None) -> str:
    """What a number must be, e.g. ``a multiple of 64 between 4096 and 67108864``."""
    if minimum is not None and maximum is not None:
        text = f"between {minimum} and {maximum}"
    else:
        text = " and ".join(f"{op} {v}" for op, v in ((">=", minimum), (">", above), ("<=", maximum))
                            if v is not None)
    if not multiple_of:
        return text
    return f"a multiple of {multiple_of}" + (
        f" {text}" if text.startswith("between") else f" and {text}" if text else "")


# -- rules about the host a rank runs on (Variable.host_check) -----------------------------


def interface_problem(name: str) -> str | None:
    """None when ``name`` is a network interface of this host, else what is wrong."""
    try:
        socket.if_nametoindex(name)
        return None
    except OSError:
        names = ", ".join(n for _, n in socket.if_nameindex())
        return f"is not a network interface of {socket.gethostname()}; it has: {names}"


def local_address_problem(host: str) -> str | None:
    """None when ``host`` resolves to an address of this host (one a socket can bind to,
    as Gloo's TCP device binds), else what is wrong."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        return (f"does not resolve on {socket.gethostname()} ({reason}); set it to an address "
                "or a name of this host, or unset it")
    if any(can_bind(str(info[4][0])) for info in infos):
        return None
    addresses = ", ".join(sorted({str(info[4][0]) for info in infos}))
    return (f"resolves to {addresses}, not an address of {socket.gethostname()}; set it to an "
            "address or a name of this host, or unset it")


def directory_problem(path: str) -> str | None:
    """None when the directory of the file ``path`` exists and is writable, or can be
    created; else what is wrong. (``{rank}`` in ``path`` counts as rank 0.)"""
    parent = Path(path.replace("{rank}", "0")).parent
    existing = parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be written: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == parent:
            return f"cannot be written: the directory {parent} is not writable"
        return f"cannot be written: {parent} cannot be created, {existing} is not writable"
    return None


#: The groups variables are declared in, in the order the docs list them.
GROUPS: dict[str, str] = {
    "launcher": "set by the launcher (`tnt run`) on every rank",
    "settings": "settings of tnt-core and tnt-keras, passed with `-x NAME=VALUE`",
    "plugins": "which plugins tnt-core loads",
    "gloo": "the `gloo` backend (tnt-comm-gloo)",
    "mpi": "the `mpi` backend (tnt-comm-mpi)",
    "internal": "between tnt-cli's launcher and its agents; not for users",
}


@dataclass(frozen=True)
class Variable:
    """One ``TNT_*`` variable: how it is parsed, what it defaults to, what it means.

    ``kind`` is ``int``, ``float``, ``bool``, ``str``, ``choice`` or ``list`` (comma
    separated). A blank value counts as unset. ``default_doc`` says the default in words
    where it is computed or absent (``None``).
    """

    name: str
    kind: str
    default: Any
    doc: str
    group: str
    default_doc: str | None = None
    #: the ``tnt run`` option that sets it, if any
    option: str | None = None
    #: for ``choice``: the allowed values, each with what it means ("" for nothing)
    choices: tuple[tuple[str, str], ...] = ()
    #: ``choice`` values are compared in this case: "upper", "lower" or "" (as given)
    case: str = ""
    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    #: ``int``: the value must be a multiple of this
    multiple_of: int | None = None
    unit: str = ""
    #: a rule about the host that uses the value (an interface that exists there, a name that
    #: resolves to it): the value -> what is wrong, or None. Not part of :meth:`read`, which
    #: may run on another host (``tnt run``); :meth:`check_host` applies it, on the ranks
    #: and in ``tnt run`` for the ranks it starts on its own host.
    host_check: Callable[[str], str | None] | None = field(default=None, compare=False,
                                                           repr=False)

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value as exported, stripped; None when unset or blank."""
        env = os.environ if environ is None else environ
        value = (env.get(self.name) or "").strip()
        return value or None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.raw(environ) is not None

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value (the default when unset); :class:`ConfigError` naming the
        variable when the value is malformed."""
        env = os.environ if environ is None else environ
        raw = self.raw(env)
        if raw is None:
            return list(self.default) if self.kind == "list" else self.default  # a fresh list
        if self.kind in ("int", "float"):
            return env_number(env, self.name, self.default, integer=self.kind == "int",
                              minimum=self.minimum, above=self.above, maximum=self.maximum,
                              multiple_of=self.multiple_of, unit=self.unit)
        if self.kind == "bool":
            if self.default is None and raw.lower() == "auto":
                return None  # tri-state: decided at run time
            return parse_bool(self.name, raw)
        if self.kind == "choice":
            value = raw.upper() if self.case == "upper" else raw.lower() if self.case == "lower" else raw
            allowed = [c for c, _ in self.choices]
            if value not in allowed:
                raise bad_input(ConfigError(
                    f"{self.name}={value!r} is not one of {self._choices_text()}"))
            return value
        if self.kind == "list":
            return [item.strip() for item in raw.split(",") if item.strip()]
        return raw

    def check_host(self, value: str) -> None:
        """:class:`ConfigError` naming the variable when ``value`` breaks :attr:`host_check`
        on this host."""
        problem = self.host_check(value) if self.host_check is not None else None
        if problem:
            raise bad_input(ConfigError(f"{self.name}={value!r} {problem}"))

    def format(self, value: Any) -> str:
        """``value`` as it is written into the environment (what :meth:`read` reads back)."""
        if self.kind == "bool":
            return "true" if value else "false"
        if self.kind == "float":
            return f"{value:g}"
        if self.kind == "list":
            return ",".join(value)
        return str(value)

    @property
    def default_text(self) -> str:
        """The default as the docs state it."""
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return "unset"
        return f"`{self.format(self.default)}`"

    def _choices_text(self) -> str:
        words = [f"{c} ({meaning})" if meaning else c for c, meaning in self.choices]
        if any(meaning for _, meaning in self.choices):
            return ", ".join(words[:-1]) + " or " + words[-1]
        return ", ".join(words)


#: Every declared variable by name, in declaration order (the order the launcher writes
#: them in and the docs list them in).
VARIABLES: dict[str, Variable] = {}


def _declare(name: str, kind: str, default: Any, doc: str, group: str, **kw: Any) -> Variable:
    var = Variable(name, kind, default, doc, group, **kw)
    if name in VARIABLES:
        raise ValueError(f"{name} declared twice")
    VARIABLES[name] = var
    return var


def variable(name: str) -> Variable:
    """The declaration of ``name``; :class:`ConfigError` for an undeclared name."""
    try:
        return VARIABLES[name]
    except KeyError:
        raise ConfigError(f"{name} is not a Tarantella-NT variable") from None


def read_setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of the variable ``name`` in ``environ`` (default: ``os.environ``).

    How packages outside tnt-core read a setting, e.g.
    ``read_setting("TNT_TENSORBOARD_ON_ALL_DEVICES")`` is a bool.
    """
    return variable(name).read(environ)


# -- the launcher contract: per rank, then the same on every rank ------------------------
# Per-rank first, then job-wide: the order `tnt run` writes them in.

TNT_RANK = _declare("TNT_RANK", "int", 0, "this process's rank; 0 is the master rank",
                    "launcher", minimum=0)
TNT_LOCAL_RANK = _declare("TNT_LOCAL_RANK", "int", None, "the rank among the ranks of this host",
                          "launcher", default_doc="`TNT_RANK`", minimum=0)
TNT_LOCAL_SIZE = _declare("TNT_LOCAL_SIZE", "int", None, "the number of ranks on this host",
                          "launcher", default_doc="`TNT_SIZE`", minimum=1)
TNT_NUM_THREADS = _declare(
    "TNT_NUM_THREADS", "int", None,
    "CPU threads per rank (TensorFlow's intra-op threads): the host's usable cores divided by "
    "its ranks, at least 1", "launcher", default_doc="cores / ranks of the host", minimum=1)
TNT_SIZE = _declare("TNT_SIZE", "int", 1,
                    "the number of ranks; set means a launcher started this process "
                    "(`TNT_RANK` without it is an error)", "launcher", minimum=1)
TNT_BACKEND = _declare(
    "TNT_BACKEND", "str", None,
    "communication backend: `gloo`, `mpi`, `local`, `store` or a plugin's name",
    "launcher", default_doc="the available backend of highest priority", option="--backend")
TNT_RENDEZVOUS = _declare(
    "TNT_RENDEZVOUS", "str", None,
    "`host:port` of the launcher's rendezvous store (Gloo also accepts `file:///shared/dir`)",
    "launcher", default_doc="set by `tnt run`")
TNT_RENDEZVOUS_KEY = _declare("TNT_RENDEZVOUS_KEY", "str", None,
                              "the job's random secret for the rendezvous store", "launcher",
                              default_doc="set by `tnt run`")
#: Chosen by benchmarks/fusion_sweep.py (docs/performance_results.md): 2 MB was best or
#: within 8 % of the best for all three models on both backends; Tarantella's 32 KB was
#: 0.72-1.00 of the best. Each bucket costs a call from the step into Python.
TNT_FUSION_THRESHOLD_KB = _declare(
    "TNT_FUSION_THRESHOLD_KB", "float", 2048,
    "tensor fusion threshold in KB, a number >= 0 (0: one bucket per tensor)", "launcher",
    default_doc="`2048` (2 MB)", option="--fusion-threshold", minimum=0)
TNT_LOG_LEVEL = _declare(
    "TNT_LOG_LEVEL", "choice", "WARNING", "level of the `tnt` logger", "launcher",
    option="--log-level", case="upper",
    choices=tuple((c, "") for c in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")))
TNT_LOG_ALL = _declare("TNT_LOG_ALL", "bool", False,
                       "log on every rank, not only errors on non-master ranks", "launcher",
                       option="--log-on-all-devices")
TNT_OUTPUT_ALL = _declare("TNT_OUTPUT_ALL", "bool", False,
                          "show every rank's output, not only the master rank's", "launcher",
                          option="--output-on-all-devices")
#: Same as PyTorch's default process-group timeout: long enough for a slow first step
#: (graph tracing, a checkpoint written by the master) yet a hung peer still ends the job.
TNT_TIMEOUT_S = _declare(
    "TNT_TIMEOUT_S", "float", 1800.0,
    "seconds a rank waits on a peer (collective, rendezvous) before failing with `CommError`",
    "launcher", option="--timeout", above=0.0)

# -- settings -----------------------------------------------------------------------------

TNT_OVERLAP = _declare("TNT_OVERLAP", "bool", True,
                       "`false` starts every allreduce only after backprop ends (to measure "
                       "what overlap buys)", "settings")
TNT_NATIVE_OPS = _declare("TNT_NATIVE_OPS", "bool", True,
                          "`false` reduces gradients through the Python path (one "
                          "`tf.numpy_function` per bucket) even where the backend offers the "
                          "native hand-off (to measure what the native path buys)", "settings")
#: Horovod's stall inspector warns after the same 60 s: longer than any healthy step of a
#: synchronous job, short enough that a hung rank is named long before TNT_TIMEOUT_S.
TNT_STALL_WARN_S = _declare(
    "TNT_STALL_WARN_S", "float", 60.0,
    "seconds in one collective after which the lowest waiting rank logs which ranks have not "
    "arrived and where they were last seen (epoch, step); `0` turns the stall inspector off",
    "settings", minimum=0.0)

TNT_TIMELINE = _declare("TNT_TIMELINE", "str", None,
                        "write a Chrome-trace timeline of the training steps to this path "
                        "(one file per rank; a missing directory is created)", "settings",
                        host_check=directory_problem)
TNT_TENSORBOARD_ON_ALL_DEVICES = _declare(
    "TNT_TENSORBOARD_ON_ALL_DEVICES", "bool", False,
    "Keras' TensorBoard callback runs on every rank, each writing to `<log_dir>/rank_<r>`",
    "settings")

# -- plugins ------------------------------------------------------------------------------

TNT_PLUGINS = _declare("TNT_PLUGINS", "list", [],
                       "comma-separated modules to load as plugins without packaging them",
                       "plugins", default_doc="unset")
TNT_DISABLE_PLUGINS = _declare("TNT_DISABLE_PLUGINS", "list", [],
                               "comma-separated entry-point names of plugins not to load",
                               "plugins", default_doc="unset")
TNT_DISABLE_PLUGIN_AUTOLOAD = _declare(
    "TNT_DISABLE_PLUGIN_AUTOLOAD", "bool", False,
    "load no plugin from entry points (the built-in `local` backend stays)",
    "plugins")

# -- the gloo backend ---------------------------------------------------------------------

TNT_GLOO_IFACE = _declare("TNT_GLOO_IFACE", "str", None,
                          "network interface to listen on (e.g. `eth0`); wins over the host name",
                          "gloo", host_check=interface_problem)
TNT_GLOO_HOSTNAME = _declare(
    "TNT_GLOO_HOSTNAME", "str", None, "address or host name to listen on", "gloo",
    default_doc="loopback on one node, else the host name (or the route to the rendezvous host)",
    host_check=local_address_problem)
TNT_GLOO_ALGORITHM = _declare(
    "TNT_GLOO_ALGORITHM", "choice", "auto",
    "the allreduce algorithm: `auto`, `ring`, `bcube` or `doubling` (power-of-two ranks)",
    "gloo", case="lower", choices=tuple((c, "") for c in ("auto", "ring", "bcube", "doubling")))
#: measured on 2 ranks over loopback (tnt-comm-gloo's README)
TNT_GLOO_BCUBE_MAX_BYTES = _declare(
    "TNT_GLOO_BCUBE_MAX_BYTES", "int", 1 << 20,
    "with `auto`, buffers up to this size are small (bcube or doubling); larger take the ring",
    "gloo", minimum=0, unit="bytes")
#: recursive doubling sends log2(p) whole buffers, against bcube's two
TNT_GLOO_DOUBLING_MAX_BYTES = _declare(
    "TNT_GLOO_DOUBLING_MAX_BYTES", "int", 64 << 10,
    "with `auto` on more than 2 ranks (a power of two), doubling up to this size, then bcube",
    "gloo", minimum=0, unit="bytes")
TNT_GLOO_SHM = _declare(
    "TNT_GLOO_SHM", "choice", "auto",
    "allreduce through shared memory when every rank is on one host", "gloo", case="lower",
    choices=(("auto", "shared memory when every rank is on this host"), ("0", "always TCP"),
             ("1", "shared memory, else fail")))
#: two slots per rank, so 4 ranks keep 8 MiB in /dev/shm (Docker's default is 64 MiB)
TNT_GLOO_SHM_CHUNK_BYTES = _declare(
    "TNT_GLOO_SHM_CHUNK_BYTES", "int", 1 << 20,
    "bytes per shared-memory slot (two per rank), a multiple of 64 in [4096, 64 MiB]; the "
    "same on every rank", "gloo", minimum=4096, maximum=64 << 20, multiple_of=64, unit="bytes")
TNT_GLOO_SHM_SPIN_US = _declare(
    "TNT_GLOO_SHM_SPIN_US", "int", None,
    "µs a waiting rank spins (yielding every few µs) before sleeping on a futex", "gloo",
    default_doc="`50` (the native default)", minimum=0, maximum=1_000_000, unit="µs")
TNT_GLOO_SHM_HOST_ID = _declare(
    "TNT_GLOO_SHM_HOST_ID", "str", None,
    "this rank's host identity, e.g. for containers on one host sharing `/dev/shm`", "gloo",
    default_doc="host name + boot id")
TNT_GLOO_CUDART = _declare(
    "TNT_GLOO_CUDART", "str", None,
    "path of libcudart for staging GPU buffers (read by the native module)", "gloo",
    default_doc="`libcudart.so` and its versioned names")

# -- the mpi backend ----------------------------------------------------------------------

TNT_MPI_SPIN_US = _declare("TNT_MPI_SPIN_US", "float", 200.0,
                           "minimum spin phase of the request poller, µs", "mpi", minimum=0)
TNT_MPI_MAX_SPIN_MS = _declare(
    "TNT_MPI_MAX_SPIN_MS", "float", 1.0,
    "longest spin phase while nobody waits for the result, ms", "mpi", minimum=0)
TNT_MPI_MAX_WAITED_SPIN_MS = _declare(
    "TNT_MPI_MAX_WAITED_SPIN_MS", "float", 50.0,
    "longest spin phase while a caller is blocked on the result, ms", "mpi", minimum=0)
TNT_MPI_MAX_SLEEP_US = _declare(
    "TNT_MPI_MAX_SLEEP_US", "float", 1000.0,
    "longest sleep between two tests once spinning stopped, µs", "mpi", minimum=0)
TNT_MPI_CUDA_AWARE = _declare(
    "TNT_MPI_CUDA_AWARE", "bool", None,
    "`1`/`0` overrides the check whether the MPI library takes CUDA buffers", "mpi",
    default_doc="`auto`")

# -- internal -----------------------------------------------------------------------------

TNT_AGENT_SPEC = _declare("TNT_AGENT_SPEC", "str", None,
                          "the job description (JSON) `tnt run` hands its agents under "
                          "mpirun/srun", "internal")
