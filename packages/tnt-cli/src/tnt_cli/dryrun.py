"""``--dry-run``: print exactly what would run on which host, and start nothing."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from .agent import SPEC_ENV, Agent, numactl_prefix
from .devices import numa_nodes
from .job import Job, Rendezvous
from .launchers.base import Launcher, ProcessSpec
from .network import is_local_host

__all__ = ["render_dry_run", "dry_run_rendezvous", "KEY_PLACEHOLDER"]

KEY_PLACEHOLDER = "<random key made at start>"


def dry_run_rendezvous(bind_host: str, port: int) -> Rendezvous:
    host = f"[{bind_host}]" if ":" in bind_host else bind_host
    return Rendezvous(f"{host}:{port or '<free port picked at start>'}", KEY_PLACEHOLDER)


def _env_words(pairs: Sequence[Sequence[str]]) -> str:
    return " ".join(f"{name}={shlex.quote(value)}" for name, value in pairs)


def _binding(spec: dict, local_rank: int | None, slots: Sequence) -> str:
    """Where the rank runs: its CPUs as its agent would bind it on this machine (the
    launching one), or the rule, for a host whose cores only its agent sees."""
    if spec.get("pin_cpu"):
        return "its socket's (numactl, above)"
    if local_rank is None:
        return "as the launcher binds them"
    if spec.get("bind") != "core":
        return "not bound (--bind-to none)"
    slot = slots[spec["rank"]]
    if not is_local_host(slot.host):
        return (f"cores of its own: run {local_rank + 1} of {slot.local_size} of {slot.host}'s "
                "cores, whole cores each")
    cpus = Agent.binding(spec, local_rank, slot.local_size)
    return ("not bound: this machine has fewer cores than ranks" if cpus is None
            else ",".join(map(str, cpus)))


def render_dry_run(job: Job, launcher: Launcher, procs: Sequence[ProcessSpec],
                   rendezvous: Rendezvous) -> str:
    o = job.options
    placement = job.placement
    hosts = placement.hosts
    lines = [
        "tnt run --dry-run: nothing was started",
        f"launcher: {launcher.name}; backend: {o.backend or 'chosen by the ranks'}; "
        f"{placement.size} rank(s) on {len(hosts)} host(s): "
        + ", ".join(f"{h} ({len(placement.on_host(h))})" for h in hosts),
        f"rendezvous store: this machine, {rendezvous.url}",
    ]
    if job.gpus is not None:
        lines.append("devices: GPUs " + ",".join(job.gpus) + " of each host, one per local rank")
    elif job.hide_gpus:
        lines.append("devices: CPU (GPUs hidden with CUDA_VISIBLE_DEVICES=-1)")
    else:
        lines.append("devices: CPU")
    for proc in procs:
        lines.append("")
        start = shlex.join(proc.argv)
        if proc.env:
            start = " ".join(f"{k}=<job description>" if k == SPEC_ENV else f"{k}={shlex.quote(v)}"
                             for k, v in proc.env.items()) + " " + start
        for spec in proc.specs:
            if spec["rank"] is None:
                lines.append(f"[ranks 0-{placement.size - 1}, placed by {proc.argv[0]}]")
                lines.append(f"  start: {start}")
                lines.append("  rank:  TNT_RANK, TNT_LOCAL_RANK, TNT_LOCAL_SIZE, TNT_NUM_THREADS "
                             "from the launcher's rank variables")
                local_rank = None
            else:
                slot = placement.slots[spec["rank"]]
                lines.append(f"[rank {slot.rank} on {slot.host}, local rank "
                             f"{slot.local_rank} of {slot.local_size}]")
                lines.append(f"  start: {start}" + ("  (job description on stdin)" if proc.stdin else ""))
                local_rank = slot.local_rank
            lines.append(f"  cwd:   {spec['cwd']}")
            lines.append(f"  env:   {_env_words(spec['env'])}")
            pin = []
            if spec["pin_cpu"] or spec["pin_memory"]:
                if local_rank is None:
                    pin = ["numactl", "<bound to socket local_rank % sockets>"]
                else:
                    pin = numactl_prefix(local_rank, spec["pin_cpu"], spec["pin_memory"], numa_nodes())
            lines.append(f"  run:   {shlex.join(pin + list(spec['argv']))}")
            lines.append(f"  cpus:  {_binding(spec, local_rank, placement.slots)}")
    return "\n".join(lines) + "\n"
