"""tnt-core's own ``TNT_*`` environment variables, and how any variable is declared.

The one home of the launcher contract and of tnt-core's settings (in the spirit of
OpenTelemetry-python's ``environment_variables``): readers (:class:`tnt_core.Config`,
tnt-keras) parse a variable through its declaration, the launcher writes it through
:meth:`tnt_core.Config.to_env`, and the docs' tables are generated from the
declarations, so a name, a default or a rule cannot differ between two places.

A plugin declares its own variables the same way, in a :class:`SettingGroup` with a
prefix of its own (``TNT_GLOO_``), and hands the group to tnt-core through the
``tnt_register_settings`` hook (``_setting_registry`` collects them). A test
fails when a ``TNT_*`` name in the packages' sources is declared nowhere.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar

from ._addresses import can_bind
from ._errors import ConfigError, PluginError

__all__ = [
    "CORE_GROUPS",
    "GROUPS",
    "KINDS",
    "VARIABLES",
    "SettingGroup",
    "Variable",
    "bad_input",
    "directory_problem",
    "env_number",
    "interface_problem",
    "local_address_problem",
    "parse_bool",
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


#: The kinds of value a variable holds (``Variable.kind``).
KINDS = ("int", "float", "bool", "str", "choice", "list")
_NAME = re.compile(r"TNT_[A-Z0-9_]*[A-Z0-9]")
_PREFIX = re.compile(r"TNT_[A-Z0-9]+(?:_[A-Z0-9]+)*_")
_GROUP_NAME = re.compile(r"[a-z][a-z0-9_-]*")


@dataclass(frozen=True)
class Variable:
    """One ``TNT_*`` variable: how it is parsed, what it defaults to, what it means.

    ``kind`` is one of :data:`KINDS`: ``int``, ``float``, ``bool``, ``str``, ``choice`` or
    ``list`` (comma separated). A blank value counts as unset. ``default_doc`` says the
    default in words where it is computed or absent (``None``). Made by
    :meth:`SettingGroup.declare`, which sets ``group``.
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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PluginError(f"{self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == "choice") != bool(self.choices):
            raise PluginError(f"{self.name}: a 'choice' variable, and only one, lists its choices")
        if not self.doc or "\n" in self.doc:
            raise PluginError(f"{self.name}: the doc is one line saying what the variable does")

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

    @property
    def allowed(self) -> str:
        """What a value may be, in words (for listings; errors say it the same way)."""
        if self.kind in ("int", "float"):
            what = "an integer" if self.kind == "int" else "a number"
            rule = _rule_text(self.minimum, self.above, self.maximum, self.multiple_of)
            text = f"{what}, {rule}" if rule.startswith("a multiple") else f"{what} {rule}".strip()
            return text + (f" ({self.unit})" if self.unit else "")
        if self.kind == "bool":
            return "true/false" + (" or auto" if self.default is None else "")
        if self.kind == "choice":
            return self._choices_text()
        if self.kind == "list":
            return "comma-separated names"
        return "text"

    def _choices_text(self) -> str:
        words = [f"{c} ({meaning})" if meaning else c for c, meaning in self.choices]
        if any(meaning for _, meaning in self.choices):
            return ", ".join(words[:-1]) + " or " + words[-1]
        return ", ".join(words)


class SettingGroup:
    """``TNT_*`` variables listed together: one of tnt-core's own groups, or the settings of
    a plugin, whose names then all start with the group's ``prefix`` (``TNT_GLOO_``).

    A plugin makes one at import time, keeps the :class:`Variable` s that
    :meth:`declare` returns as module constants for its own code to read, and hands the
    group to tnt-core in ``tnt_register_settings`` (``registry.add(group)``), so that
    ``tnt run``, ``tnt settings`` and the docs know them too. ``name`` is what the docs'
    ``{tnt-env-table}`` and ``tnt settings NAME`` select it by; ``title`` says whose
    settings they are, e.g. "the `gloo` backend (tnt-comm-gloo)".
    """

    def __init__(self, name: str, title: str, *, prefix: str | None = None) -> None:
        if not _GROUP_NAME.fullmatch(name):
            raise PluginError(f"setting group name {name!r}: lower-case letters, digits, '-', '_'")
        if prefix is not None and not _PREFIX.fullmatch(prefix):
            raise PluginError(f"setting group {name!r}: prefix {prefix!r} must look like "
                              "'TNT_<NAME>_' (upper case, ending in '_')")
        if not title or "\n" in title:
            raise PluginError(f"setting group {name!r}: the title is one line")
        self.name, self.title, self.prefix = name, title, prefix
        self._variables: dict[str, Variable] = {}

    @property
    def variables(self) -> Mapping[str, Variable]:
        """The declared variables by name, in declaration order."""
        return MappingProxyType(self._variables)

    def declare(self, name: str, kind: str, default: Any, doc: str, **kw: Any) -> Variable:
        """Declare the variable ``name`` of this group (see :class:`Variable` for the
        arguments) and return it; :class:`tnt_core.PluginError` for a name outside the
        group's prefix or declared twice."""
        if not _NAME.fullmatch(name):
            raise PluginError(f"{name!r} is not a TNT_* variable name (TNT_, then upper case)")
        if self.prefix is not None and not (name.startswith(self.prefix)
                                            and len(name) > len(self.prefix)):
            raise PluginError(f"{name}: the variables of setting group {self.name!r} start with "
                              f"its prefix {self.prefix}")
        if name in self._variables:
            raise PluginError(f"{name} declared twice in setting group {self.name!r}")
        var = Variable(name, kind, default, doc, self.name, **kw)
        self._variables[name] = var
        return var

    def __repr__(self) -> str:
        return f"SettingGroup({self.name!r}, prefix={self.prefix!r}, {len(self._variables)} variables)"


LAUNCHER = SettingGroup("launcher", "set by the launcher (`tnt run`) on every rank")
SETTINGS = SettingGroup("settings", "settings of tnt-core and tnt-keras, passed with `-x NAME=VALUE`")
PLUGINS = SettingGroup("plugins", "which plugins tnt-core loads")
INTERNAL = SettingGroup("internal", "between tnt-cli's launcher and its agents; not for users")
#: tnt-core's own groups, in the order the docs list them (the plugins' groups go between
#: ``plugins`` and ``internal``). Their names need no prefix: a plugin's prefix may not
#: cover any of them.
CORE_GROUPS = (LAUNCHER, SETTINGS, PLUGINS, INTERNAL)
#: tnt-core's groups: name -> title.
GROUPS: dict[str, str] = {g.name: g.title for g in CORE_GROUPS}

# -- the launcher contract: per rank, then the same on every rank ------------------------
# Per-rank first, then job-wide: the order `tnt run` writes them in.

TNT_RANK = LAUNCHER.declare("TNT_RANK", "int", 0, "this process's rank; 0 is the master rank",
                            minimum=0)
TNT_LOCAL_RANK = LAUNCHER.declare("TNT_LOCAL_RANK", "int", None,
                                  "the rank among the ranks of this host",
                                  default_doc="`TNT_RANK`", minimum=0)
TNT_LOCAL_SIZE = LAUNCHER.declare("TNT_LOCAL_SIZE", "int", None, "the number of ranks on this host",
                                  default_doc="`TNT_SIZE`", minimum=1)
TNT_NUM_THREADS = LAUNCHER.declare(
    "TNT_NUM_THREADS", "int", None,
    "CPU threads per rank (TensorFlow's intra-op threads): the host's usable cores divided by "
    "its ranks, at least 1", default_doc="cores / ranks of the host", minimum=1)
TNT_SIZE = LAUNCHER.declare("TNT_SIZE", "int", 1,
                            "the number of ranks; set means a launcher started this process "
                            "(`TNT_RANK` without it is an error)", minimum=1)
TNT_BACKEND = LAUNCHER.declare(
    "TNT_BACKEND", "str", None,
    "communication backend: `gloo`, `mpi`, `local`, `store` or a plugin's name",
    default_doc="the available backend of highest priority", option="--backend")
TNT_RENDEZVOUS = LAUNCHER.declare(
    "TNT_RENDEZVOUS", "str", None,
    "`host:port` of the launcher's rendezvous store (Gloo also accepts `file:///shared/dir`)",
    default_doc="set by `tnt run`")
TNT_RENDEZVOUS_KEY = LAUNCHER.declare("TNT_RENDEZVOUS_KEY", "str", None,
                                      "the job's random secret for the rendezvous store",
                                      default_doc="set by `tnt run`")
#: Chosen by benchmarks/fusion_sweep.py (docs/performance_results.md): 2 MB was best or
#: within 8 % of the best for all three models on both backends; Tarantella's 32 KB was
#: 0.72-1.00 of the best. Each bucket costs a call from the step into Python.
TNT_FUSION_THRESHOLD_KB = LAUNCHER.declare(
    "TNT_FUSION_THRESHOLD_KB", "float", 2048,
    "tensor fusion threshold in KB, a number >= 0 (0: one bucket per tensor)",
    default_doc="`2048` (2 MB)", option="--fusion-threshold", minimum=0)
TNT_LOG_LEVEL = LAUNCHER.declare(
    "TNT_LOG_LEVEL", "choice", "WARNING", "level of the `tnt` logger",
    option="--log-level", case="upper",
    choices=tuple((c, "") for c in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")))
TNT_LOG_ALL = LAUNCHER.declare("TNT_LOG_ALL", "bool", False,
                               "log on every rank, not only errors on non-master ranks",
                               option="--log-on-all-devices")
TNT_OUTPUT_ALL = LAUNCHER.declare("TNT_OUTPUT_ALL", "bool", False,
                                  "show every rank's output, not only the master rank's",
                                  option="--output-on-all-devices")
#: Same as PyTorch's default process-group timeout: long enough for a slow first step
#: (graph tracing, a checkpoint written by the master) yet a hung peer still ends the job.
TNT_TIMEOUT_S = LAUNCHER.declare(
    "TNT_TIMEOUT_S", "float", 1800.0,
    "seconds a rank waits on a peer (collective, rendezvous) before failing with `CommError`",
    option="--timeout", above=0.0)

# -- settings -----------------------------------------------------------------------------

TNT_OVERLAP = SETTINGS.declare("TNT_OVERLAP", "bool", True,
                               "`false` starts every allreduce only after backprop ends (to "
                               "measure what overlap buys)")
TNT_NATIVE_OPS = SETTINGS.declare("TNT_NATIVE_OPS", "bool", True,
                                  "`false` reduces gradients through the Python path (one "
                                  "`tf.numpy_function` per bucket) even where the backend offers "
                                  "the native hand-off (to measure what the native path buys)")
#: Horovod's stall inspector warns after the same 60 s: longer than any healthy step of a
#: synchronous job, short enough that a hung rank is named long before TNT_TIMEOUT_S.
TNT_STALL_WARN_S = SETTINGS.declare(
    "TNT_STALL_WARN_S", "float", 60.0,
    "seconds in one collective after which the lowest waiting rank logs which ranks have not "
    "arrived and where they were last seen (epoch, step); `0` turns the stall inspector off",
    minimum=0.0)
#: Off by default: compressed gradients break serial equivalence (float16 round-off of every
#: rank's weighted gradient and of their sum); a link-bound job opts in.
TNT_GRADIENT_COMPRESSION = SETTINGS.declare(
    "TNT_GRADIENT_COMPRESSION", "choice", "none",
    "how `fit`'s dense gradients travel in the allreduce; `fp16` halves the bytes of float32 "
    "gradients, and training then differs from serial training by float16 round-off",
    case="lower", choices=(("none", "in their own dtype"),
                           ("fp16", "as float16, each rank's weighted before the cast")))
TNT_TIMELINE = SETTINGS.declare("TNT_TIMELINE", "str", None,
                                "write a Chrome-trace timeline of the training steps to this path "
                                "(one file per rank; a missing directory is created)",
                                host_check=directory_problem)
TNT_TENSORBOARD_ON_ALL_DEVICES = SETTINGS.declare(
    "TNT_TENSORBOARD_ON_ALL_DEVICES", "bool", False,
    "Keras' TensorBoard callback runs on every rank, each writing to `<log_dir>/rank_<r>`")

# -- plugins ------------------------------------------------------------------------------

TNT_PLUGINS = PLUGINS.declare("TNT_PLUGINS", "list", [],
                              "comma-separated modules to load as plugins without packaging them",
                              default_doc="unset")
TNT_DISABLE_PLUGINS = PLUGINS.declare("TNT_DISABLE_PLUGINS", "list", [],
                                      "comma-separated entry-point names of plugins not to load",
                                      default_doc="unset")
TNT_DISABLE_PLUGIN_AUTOLOAD = PLUGINS.declare(
    "TNT_DISABLE_PLUGIN_AUTOLOAD", "bool", False,
    "load no plugin from entry points (the built-in `local` backend stays)")

# -- internal -----------------------------------------------------------------------------

TNT_AGENT_SPEC = INTERNAL.declare("TNT_AGENT_SPEC", "str", None,
                                  "the job description (JSON) `tnt run` hands its agents under "
                                  "mpirun/srun")

TNT_ELASTIC = INTERNAL.declare("TNT_ELASTIC", "bool", False,
                               "the job is elastic: `tnt run` publishes membership generations "
                               "in the rendezvous store (`--min-np`, `--max-restarts`)")
TNT_ELASTIC_JOINS = INTERNAL.declare("TNT_ELASTIC_JOINS", "bool", False,
                                     "an elastic job may start processes that join it later "
                                     "(`--max-restarts`, `--max-np`, `--host-discovery-script`)")
TNT_ELASTIC_RESIZES = INTERNAL.declare("TNT_ELASTIC_RESIZES", "bool", False,
                                       "an elastic job may go on with another number of ranks "
                                       "(`--min-np` below `-n`, `--max-np` above it, or "
                                       "`--host-discovery-script`)")
TNT_MEMBER_ID = INTERNAL.declare("TNT_MEMBER_ID", "int", None,
                                 "an elastic job's name for this process, kept across "
                                 "generations", default_doc="`TNT_RANK`", minimum=0)
TNT_GENERATION = INTERNAL.declare("TNT_GENERATION", "int", 0,
                                  "the membership generation an elastic job's process joins",
                                  minimum=0)

#: tnt-core's own variables by name, in declaration order (the order the launcher writes
#: them in and the docs list them in). With every installed plugin's:
#: :func:`tnt_core.installed_settings`.
VARIABLES: dict[str, Variable] = {name: var for group in CORE_GROUPS
                                  for name, var in group.variables.items()}
