"""The launcher environment (DESIGN.md, "Launcher contract") read into one validated object.

Reading the environment in one place means a typo in a variable fails at start-up with a
message naming the variable, instead of deep inside a backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import ConfigError

__all__ = ["Config", "DEFAULT_FUSION_THRESHOLD_KB", "DEFAULT_TIMEOUT_S", "env_number", "parse_bool"]

#: Chosen by benchmarks/fusion_sweep.py (docs/performance_results.md): 2 MB was best or
#: within 8 % of the best for all three models on both backends; Tarantella's 32 KB was
#: 0.72-1.00 of the best. Each bucket costs a call from the step into Python.
DEFAULT_FUSION_THRESHOLD_KB = 2048
#: Same as PyTorch's default process-group timeout: long enough for a slow first step
#: (graph tracing, a checkpoint written by the master) yet a hung peer still ends the job.
DEFAULT_TIMEOUT_S = 1800.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use true/false (or 1/0)")


def env_number(env: Mapping[str, str], name: str, default: Any, *, integer: bool = False,
               minimum: float | None = None, above: float | None = None,
               maximum: float | None = None, unit: str = "") -> Any:
    """The number in ``env[name]`` (``default`` when unset or blank), checked.

    One parser for every ``TNT_*`` number, of tnt-core and of the backends, so that a bad
    value always reads the same: the variable, its value, and what it must be.
    """
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{name}={raw!r} is not {what}{f' ({unit})' if unit else ''}") from None
    if maximum is not None and minimum is not None and not minimum <= value <= maximum:
        raise ConfigError(f"{name}={value} must be between {minimum} and {maximum}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    if above is not None and not value > above:
        raise ConfigError(f"{name}={value} must be > {above}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}={value} must be <= {maximum}")
    return value


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
    #: TNT_TIMELINE: write a Chrome-trace timeline of the training steps to this path
    timeline: str | None = None
    #: TNT_OVERLAP=false: start allreduces only after backprop (to measure what overlap buys)
    overlap: bool = True
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
        """Read and validate the ``TNT_*`` variables."""
        env = os.environ if environ is None else environ
        size = env_number(env, "TNT_SIZE", None, integer=True, minimum=1)
        rank = env_number(env, "TNT_RANK", None, integer=True, minimum=0)
        if rank is not None and size is None:
            raise ConfigError(
                "TNT_RANK is set but TNT_SIZE is not; both come from the launcher "
                "(`tnt run`), set both or neither"
            )
        launched = size is not None
        size = size or 1
        rank = rank or 0
        local_size = env_number(env, "TNT_LOCAL_SIZE", None, integer=True, minimum=1)
        local_rank = env_number(env, "TNT_LOCAL_RANK", None, integer=True, minimum=0)
        if local_size is None:  # one node: every rank is local
            local_size, local_rank = size, rank if local_rank is None else local_rank
        local_rank = 0 if local_rank is None else local_rank
        level = env.get("TNT_LOG_LEVEL", "WARNING").strip().upper() or "WARNING"
        cfg = cls(
            rank=rank,
            size=size,
            local_rank=local_rank,
            local_size=local_size,
            backend=(env.get("TNT_BACKEND") or "").strip() or None,
            rendezvous=(env.get("TNT_RENDEZVOUS") or "").strip() or None,
            rendezvous_key=env.get("TNT_RENDEZVOUS_KEY") or None,
            fusion_threshold_kb=env_number(
                env, "TNT_FUSION_THRESHOLD_KB", DEFAULT_FUSION_THRESHOLD_KB, minimum=0
            ),
            log_level=level,
            log_all=parse_bool("TNT_LOG_ALL", env.get("TNT_LOG_ALL", "")),
            output_all=parse_bool("TNT_OUTPUT_ALL", env.get("TNT_OUTPUT_ALL", "")),
            num_threads=env_number(env, "TNT_NUM_THREADS", None, integer=True, minimum=1),
            timeout_s=env_number(env, "TNT_TIMEOUT_S", DEFAULT_TIMEOUT_S, above=0.0),
            timeline=(env.get("TNT_TIMELINE") or "").strip() or None,
            overlap=parse_bool("TNT_OVERLAP", env.get("TNT_OVERLAP", "true")),
            launched=launched,
        )
        cfg.validate()
        return cfg
