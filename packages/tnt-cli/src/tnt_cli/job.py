"""A resolved job: what runs, where, with which environment. Launchers only read it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from tnt_core import VARIABLES, Config, ConfigError, installed_settings

from .agent import SPEC_VERSION
from .devices import threads_per_rank
from .network import is_local_host
from .options import RunOptions
from .placement import Placement, RankSlot

__all__ = ["Job", "Rendezvous", "FORWARDED_VARIABLES", "JOB_VARIABLES", "RANK_VARIABLES",
           "TERMINATE_GRACE_S", "check_host_settings", "job_backend", "job_settings"]

#: seconds between SIGTERM and SIGKILL when ranks are ended
TERMINATE_GRACE_S = 3.0
#: launcher variables remote ranks get too, so they find the same software
FORWARDED_VARIABLES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
#: the launcher contract's variables that differ between ranks (tnt_core.VARIABLES)
RANK_VARIABLES = ("TNT_RANK", "TNT_LOCAL_RANK", "TNT_LOCAL_SIZE", "TNT_NUM_THREADS")
#: the launcher contract's variables equal on every rank
JOB_VARIABLES = tuple(name for name, var in VARIABLES.items()
                      if var.group == "launcher" and name not in RANK_VARIABLES)
#: the variables that make the job what it is: set by tnt run, never by -x (a wrong value
#: would make the ranks wait for peers that never come, or for another job's store)
LAUNCHER_OWNED = {
    "TNT_RANK": "each rank gets its own",
    "TNT_LOCAL_RANK": "each rank gets its own",
    "TNT_LOCAL_SIZE": "from the placement: --n-per-node, the hostfile's slots",
    "TNT_SIZE": "the number of ranks: -n",
    "TNT_RENDEZVOUS": "the store tnt run hosts: --rendezvous-host, --rendezvous-port",
    "TNT_RENDEZVOUS_KEY": "a fresh random key for every job",
}
#: job-wide settings a user may export in the launcher's shell instead of giving an option
EXPORTABLE_VARIABLES = ("TNT_BACKEND", "TNT_FUSION_THRESHOLD_KB", "TNT_LOG_LEVEL",
                        "TNT_LOG_ALL", "TNT_OUTPUT_ALL", "TNT_TIMEOUT_S")


def job_settings(options: RunOptions, size: int, environ: Mapping[str, str]) -> Config:
    """The job-wide settings of the ranks: ``-x NAME=VALUE``, else ``tnt run``'s options,
    else what the user exported in this shell, else the defaults (tnt_core.VARIABLES).

    ``-x`` wins because it is written last (as with mpirun). An exported or ``-x`` value
    that is malformed fails here with a :class:`ConfigError` naming the variable, rather
    than being replaced by a default without a word. Every variable declared, tnt-core's
    and those of the installed plugins (``tnt_register_settings``), is checked against its
    declaration; a ``-x`` name with a plugin's prefix that the plugin does not declare too.
    """
    installed = installed_settings()
    declared = installed.variables
    exported = {name: environ[name] for name in EXPORTABLE_VARIABLES if name in environ}
    try:
        cfg = Config.from_env(exported)
        for name, var in declared.items():  # the ranks inherit the rest: check it here too
            if name in environ and name not in LAUNCHER_OWNED:
                var.read({name: environ[name]})
    except ConfigError as exc:
        raise ConfigError(f"{exc} (exported in the shell that runs tnt run)") from None
    changes: dict[str, object] = {"size": size}
    if options.backend:
        changes["backend"] = options.backend
    if options.fusion_threshold_kb is not None:
        changes["fusion_threshold_kb"] = options.fusion_threshold_kb
    if options.log_level is not None:
        changes["log_level"] = options.log_level
    if options.log_all:
        changes["log_all"] = True
    if options.output_all:
        changes["output_all"] = True
    if options.timeout_s is not None:
        changes["timeout_s"] = options.timeout_s
    explicit: dict[str, str] = {}
    for name, value in options.env:
        if name in LAUNCHER_OWNED:
            raise ConfigError(f"-x {name}=...: tnt run sets {name} itself ({LAUNCHER_OWNED[name]}); "
                              "drop it from -x")
        if name in declared or installed.group_of(name):
            try:
                installed.variable(name).read({name: value})
            except ConfigError as exc:
                raise ConfigError(f"{exc} (-x {name}=...)") from None
            if name in EXPORTABLE_VARIABLES:
                explicit[name] = value
    if explicit:
        given = Config.from_env(explicit)
        changes.update({field: getattr(given, field) for field in _FIELDS_OF if
                        _FIELDS_OF[field] in explicit})
    return cfg.with_overrides(**changes)


#: groups of variables that apply whatever the backend; any other group is a plugin's
#: (``gloo``, ``mpi``) and applies only when the job runs the backend of that name
_GENERAL_GROUPS = ("launcher", "settings", "plugins")


def check_host_settings(cfg: Config, options: RunOptions, placement: Placement,
                        environ: Mapping[str, str]) -> None:
    """The rules of ``TNT_*`` values about a host (``Variable.host_check``: an interface
    that exists, a name of this host, a directory that can be written), checked for the
    ranks ``tnt run`` starts on its own host, which see the exported values and ``-x``'s.
    Those of a backend's group only when the job runs that backend. Remote ranks check
    theirs themselves, as they start (one line naming the variable)."""
    if not any(is_local_host(host) for host in placement.hosts):
        return
    declared = installed_settings().variables
    values = {name: environ[name] for name in declared if name in environ}
    values.update((name, value) for name, value in options.env if name in declared)
    backend: list[str | None] = []  # resolved on first need
    for name, value in values.items():
        var = declared[name]
        if var.host_check is None or name in LAUNCHER_OWNED or not value.strip():
            continue
        if var.group not in _GENERAL_GROUPS:
            if not backend:
                backend.append(job_backend(cfg, options, placement))
            if backend[0] != var.group:
                continue
        try:
            var.check_host(value.strip())
        except ConfigError as exc:
            given = f"-x {name}=..." if any(n == name for n, _ in options.env) else (
                "exported in the shell that runs tnt run")
            raise ConfigError(f"{exc} ({given})") from None


def job_backend(cfg: Config, options: RunOptions, placement: Placement) -> str | None:
    """The backend the ranks will run: the one named, else the one they will choose when
    tnt run starts them itself (None when unknown, e.g. under mpirun or srun, where MPI's
    presence changes their choice)."""
    if cfg.backend:
        return cfg.backend
    if options.launcher in ("mpirun", "srun"):
        return None
    from tnt_core import TntError, list_backends

    probe = Config(rank=0, size=placement.size, local_rank=0, local_size=placement.max_local_size,
                   rendezvous="127.0.0.1:1", rendezvous_key="-", launched=True)
    try:
        return next((spec.name for spec in list_backends() if spec.is_available(probe)), None)
    except TntError:
        return None  # the ranks will say why


#: Config field of each exportable variable
_FIELDS_OF = {"backend": "TNT_BACKEND", "fusion_threshold_kb": "TNT_FUSION_THRESHOLD_KB",
              "log_level": "TNT_LOG_LEVEL", "log_all": "TNT_LOG_ALL",
              "output_all": "TNT_OUTPUT_ALL", "timeout_s": "TNT_TIMEOUT_S"}


@dataclass(frozen=True)
class Rendezvous:
    """``TNT_RENDEZVOUS`` and ``TNT_RENDEZVOUS_KEY`` (placeholders in a dry run)."""

    url: str
    key: str


@dataclass
class Job:
    options: RunOptions
    placement: Placement
    #: interpreter + script + arguments
    command: list[str]
    cwd: str
    #: GPU ids of a node when ranks use GPUs, else None
    gpus: list[str] | None
    #: set CUDA_VISIBLE_DEVICES=-1 (CPU run on a machine with GPUs)
    hide_gpus: bool
    #: the Python that runs the agent on every host (same path everywhere)
    agent_python: str
    cores: int
    grace_s: float = TERMINATE_GRACE_S
    #: said to the user before the job starts
    warnings: list[str] = field(default_factory=list)
    _host_checked: bool = field(default=False, init=False, repr=False, compare=False)

    # -- the launcher contract (docs/architecture.md) ------------------------------------
    def settings(self, environ: Mapping[str, str] | None = None) -> Config:
        """The job-wide settings the ranks get: see :func:`job_settings`; the first call
        also checks the values' rules about this host (:func:`check_host_settings`)."""
        env = os.environ if environ is None else environ
        cfg = job_settings(self.options, self.placement.size, env)
        if not self._host_checked:
            check_host_settings(cfg, self.options, self.placement, env)
            self._host_checked = True
        return cfg

    def common_env(self, rendezvous: Rendezvous) -> list[tuple[str, str]]:
        """Variables equal on every rank, in a fixed order."""
        cfg = self.settings().with_overrides(rendezvous=rendezvous.url,
                                             rendezvous_key=rendezvous.key)
        env = list(cfg.to_env(JOB_VARIABLES).items())
        env.append(("PYTHONUNBUFFERED", "1"))  # stream output line by line
        return env

    def rank_env(self, slot: RankSlot, rendezvous: Rendezvous) -> list[tuple[str, str]]:
        """Every variable of one rank, the user's ``-x`` last and in their order."""
        cfg = Config(rank=slot.rank, size=self.placement.size, local_rank=slot.local_rank,
                     local_size=slot.local_size,
                     num_threads=threads_per_rank(slot.local_size, self.cores))
        env = list(cfg.to_env(RANK_VARIABLES).items())
        if self.hide_gpus:
            env.append(("CUDA_VISIBLE_DEVICES", "-1"))
        elif slot.gpu is not None:
            env.append(("CUDA_VISIBLE_DEVICES", slot.gpu))
        return env + self.common_env(rendezvous) + list(self.options.env)

    def forwarded_env(self) -> list[tuple[str, str]]:
        return [(name, os.environ[name]) for name in FORWARDED_VARIABLES if name in os.environ]

    # -- agent job descriptions -------------------------------------------------------
    def agent_spec(self, slot: RankSlot | None, rendezvous: Rendezvous, *, remote: bool) -> dict:
        """The agent's job description (JSON) for ``slot``.

        ``argv`` command of the rank · ``cwd`` · ``env`` ordered ``[name, value]`` pairs ·
        ``rank`` (None: taken from mpirun/srun variables at run time) · ``size`` · ``host``
        · ``output_all`` · ``pin_cpu`` / ``pin_memory`` · ``bind``: ``"core"`` binds a rank
        whose local rank is known to cores of its own (``devices.rank_cpus``) · ``share``:
        ``[share, shares]`` of the host's cores it is bound to (``RankSlot.core_share``;
        None: by the local rank of mpirun/srun) · ``gpus`` GPU
        ids of a node, mapped by local rank when the rank is known only at run time ·
        ``hide_gpus`` · ``grace_s`` · ``status`` (optional, set by the ssh launcher): the
        agent writes its status lines (``agent.STATUS_PREFIX``).
        """
        base = self.forwarded_env() if remote else []
        if slot is None:
            env = base + self.common_env(rendezvous) + list(self.options.env)
        else:
            env = base + self.rank_env(slot, rendezvous)
        return {
            "version": SPEC_VERSION,
            "argv": list(self.command),
            "cwd": self.cwd,
            "env": [list(p) for p in env],
            "rank": None if slot is None else slot.rank,
            "size": self.placement.size,
            "host": None if slot is None else slot.host,
            "output_all": self.settings().output_all,
            "pin_cpu": self.options.pin_cpu,
            "pin_memory": self.options.pin_memory,
            "bind": self.options.bind_to,
            "share": None if slot is None else list(slot.core_share),
            "gpus": self.gpus,
            "hide_gpus": self.hide_gpus,
            "grace_s": self.grace_s,
        }

    @staticmethod
    def encode(spec: dict) -> str:
        return json.dumps(spec, separators=(",", ":"))

    def agent_command(self) -> list[str]:
        return [self.agent_python, "-m", "tnt_cli.agent"]
