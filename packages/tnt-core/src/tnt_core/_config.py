"""The launcher environment (docs/architecture.md, "The launcher contract") read into one
validated object.

Reading the environment in one place means a typo in a variable fails at start-up with a
message naming the variable, instead of deep inside a backend. Every variable is declared
(name, type, default) in ``_settings``; this module reads and writes them
through those declarations.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace

from . import _settings as S
from ._errors import ConfigError

__all__ = ["Config", "DEFAULT_FUSION_THRESHOLD_KB", "DEFAULT_TIMEOUT_S"]

#: 2 MB: see ``_settings.TNT_FUSION_THRESHOLD_KB`` for why.
DEFAULT_FUSION_THRESHOLD_KB = S.TNT_FUSION_THRESHOLD_KB.default
#: see ``_settings.TNT_TIMEOUT_S`` for why.
DEFAULT_TIMEOUT_S = S.TNT_TIMEOUT_S.default
_LOG_LEVELS = tuple(c for c, _ in S.TNT_LOG_LEVEL.choices)

#: Config field -> the variable it is read from and written to.
_FIELD_VARIABLES: dict[str, S.Variable] = {
    "rank": S.TNT_RANK,
    "size": S.TNT_SIZE,
    "local_rank": S.TNT_LOCAL_RANK,
    "local_size": S.TNT_LOCAL_SIZE,
    "backend": S.TNT_BACKEND,
    "rendezvous": S.TNT_RENDEZVOUS,
    "rendezvous_key": S.TNT_RENDEZVOUS_KEY,
    "fusion_threshold_kb": S.TNT_FUSION_THRESHOLD_KB,
    "log_level": S.TNT_LOG_LEVEL,
    "log_all": S.TNT_LOG_ALL,
    "output_all": S.TNT_OUTPUT_ALL,
    "num_threads": S.TNT_NUM_THREADS,
    "timeout_s": S.TNT_TIMEOUT_S,
    "stall_warn_s": S.TNT_STALL_WARN_S,
    "timeline": S.TNT_TIMELINE,
    "overlap": S.TNT_OVERLAP,
    "native_ops": S.TNT_NATIVE_OPS,
    "tensorboard_on_all_devices": S.TNT_TENSORBOARD_ON_ALL_DEVICES,
    "elastic": S.TNT_ELASTIC,
    "elastic_joins": S.TNT_ELASTIC_JOINS,
    "elastic_resizes": S.TNT_ELASTIC_RESIZES,
    "member_id": S.TNT_MEMBER_ID,
    "generation": S.TNT_GENERATION,
}
_VARIABLE_FIELDS = {var.name: name for name, var in _FIELD_VARIABLES.items()}


@dataclass(frozen=True)
class Config:
    """Everything a rank learns from its launcher. Defaults describe a plain
    ``python script.py`` run: one rank, no rendezvous."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    backend: str | None = None
    rendezvous: str | None = None
    rendezvous_key: str | None = None
    fusion_threshold_kb: float = DEFAULT_FUSION_THRESHOLD_KB
    log_level: str = "WARNING"
    log_all: bool = False
    output_all: bool = False
    num_threads: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: TNT_STALL_WARN_S: seconds in one collective before the stall inspector reports (0: off)
    stall_warn_s: float = S.TNT_STALL_WARN_S.default
    #: TNT_TIMELINE: write a Chrome-trace timeline of the training steps to this path
    timeline: str | None = None
    #: TNT_OVERLAP=false: start allreduces only after backprop (to measure what overlap buys)
    overlap: bool = True
    #: TNT_NATIVE_OPS=false: gradients through the Python path even with a native backend
    native_ops: bool = True
    #: TNT_TENSORBOARD_ON_ALL_DEVICES: Keras' TensorBoard callback on every rank
    tensorboard_on_all_devices: bool = False
    #: TNT_ELASTIC: ranks may come and go; the membership lives in the rendezvous store
    elastic: bool = False
    #: TNT_ELASTIC_JOINS: processes started later may join the elastic job
    elastic_joins: bool = False
    #: TNT_ELASTIC_RESIZES: the elastic job may go on with another number of ranks
    elastic_resizes: bool = False
    #: TNT_MEMBER_ID: this process's name in an elastic job, kept when its rank changes
    #: (None: its first rank)
    member_id: int | None = None
    #: TNT_GENERATION: the elastic job's membership generation this config describes
    generation: int = 0
    #: True when TNT_SIZE was set, i.e. a launcher started this process.
    launched: bool = False

    @property
    def fusion_threshold_bytes(self) -> int:
        return int(self.fusion_threshold_kb * 1024)

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def with_overrides(self, **changes: object) -> Config:
        """A copy with some fields changed (e.g. rank/size taken from MPI)."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        cfg = replace(self, **changes)  # type: ignore[arg-type]
        cfg.validate()
        return cfg

    def rendezvous_address(self) -> tuple[str, int]:
        """``(host, port)`` of a TCP rendezvous store; clear error for anything else."""
        if not self.rendezvous:
            raise ConfigError(
                "TNT_RENDEZVOUS is not set: a multi-rank job needs the launcher's "
                "rendezvous store; start the script with `tnt run -n N -- script.py`"
            )
        host, sep, port = self.rendezvous.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"TNT_RENDEZVOUS={self.rendezvous!r} is not HOST:PORT "
                "(or file:///shared/path for a file store)"
            )
        return host.strip("[]"), int(port)

    def validate(self) -> None:
        if self.size < 1:
            raise ConfigError(f"TNT_SIZE={self.size} must be >= 1")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"TNT_RANK={self.rank} must be in [0, TNT_SIZE={self.size})")
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise ConfigError(
                f"TNT_LOCAL_RANK={self.local_rank} must be in [0, TNT_LOCAL_SIZE={self.local_size})"
            )
        if self.local_size > self.size:
            raise ConfigError(
                f"TNT_LOCAL_SIZE={self.local_size} is larger than TNT_SIZE={self.size}"
            )
        if self.log_level not in _LOG_LEVELS:
            raise ConfigError(
                f"TNT_LOG_LEVEL={self.log_level!r} is not one of {', '.join(_LOG_LEVELS)}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Read and validate the ``TNT_*`` variables (declared in ``_settings``)."""
        env = os.environ if environ is None else environ
        size = S.TNT_SIZE.read(env)
        if S.TNT_RANK.is_set(env) and not S.TNT_SIZE.is_set(env):
            raise ConfigError(
                "TNT_RANK is set but TNT_SIZE is not; both come from the launcher "
                "(`tnt run`), set both or neither"
            )
        launched = S.TNT_SIZE.is_set(env)
        rank = S.TNT_RANK.read(env)
        local_size = S.TNT_LOCAL_SIZE.read(env)
        local_rank = S.TNT_LOCAL_RANK.read(env)
        if local_size is None:  # one node: every rank is local
            local_size, local_rank = size, rank if local_rank is None else local_rank
        local_rank = 0 if local_rank is None else local_rank
        values = {name: var.read(env) for name, var in _FIELD_VARIABLES.items()}
        values.update(rank=rank, size=size, local_rank=local_rank, local_size=local_size)
        cfg = cls(**values, launched=launched)
        cfg.validate()
        return cfg

    def to_env(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """The ``TNT_*`` variables that make :meth:`from_env` give back this config.

        What a launcher writes for its ranks. ``names`` picks variables (in declaration
        order either way); by default the launcher contract (group ``launcher``). Fields
        without a value (``None``) are left out.
        """
        wanted = ([n for n, v in S.VARIABLES.items() if v.group == "launcher"]
                  if names is None else list(names))
        unknown = [n for n in wanted if n not in _VARIABLE_FIELDS]
        if unknown:
            raise ConfigError(f"not a Config variable: {', '.join(unknown)}")
        env: dict[str, str] = {}
        for name in S.VARIABLES:
            if name in wanted:
                value = getattr(self, _VARIABLE_FIELDS[name])
                if value is not None:
                    env[name] = S.VARIABLES[name].format(value)
        return env
