"""``tnt run``: resolve options into a job, then dry-run it, clean up after it, or run it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from tnt_core import (
    NOT_ARRIVED_KEY,
    Config,
    ConfigError,
    StoreClient,
    StoreServer,
    TntError,
    list_backends,
    unknown_backend_hint,
)

from .agent import read_failures
from .cleanup import WAIT_S, cleanup_host, remove_orphan_segments, shm_segments
from .devices import cpu_count, visible_gpus
from .dryrun import dry_run_rendezvous, render_dry_run
from .elastic import ElasticJob, ElasticLimits, HostDiscovery, process_maker, with_env
from .errors import USAGE_EXIT_CODE, UsageError
from .hostfile import Host, read_hostfile
from .job import Job, Rendezvous, job_backend
from .launchers import Launcher, choose_launcher
from .launchers.base import ProcessSpec
from .launchers.ssh import ssh_command
from .network import is_local_host, store_bind_address
from .options import RunOptions, parse_run_args
from .placement import LOCALHOST, Placement, place_ranks
from .supervisor import Supervisor

__all__ = ["run_command", "resolve_job"]


def _command(options: RunOptions) -> list[str]:
    """Interpreter + script + arguments, checked on this machine (same paths everywhere)."""
    script = options.command[0]
    if options.python:
        if shutil.which(options.python[0]) is None:
            raise UsageError(f"--python-interpreter: {options.python[0]!r} not found")
        if not script.startswith("-") and os.path.isdir(script):
            raise UsageError(f"script {script!r} is a directory; give the Python file to run "
                             "(e.g. train.py), or -m PACKAGE to run a package's __main__")
        if not script.startswith("-") and not os.path.isfile(script):
            raise UsageError(f"script {script!r} not found (in {os.getcwd()})")
        return [*options.python, *options.command]
    if shutil.which(script) is None:
        raise UsageError(f"program {script!r} not found or not executable "
                         "(--python-interpreter '' runs SCRIPT as a program)")
    return list(options.command)


def _check_backend(name: str, size: int, local_size: int) -> None:
    """``--backend`` must name an installed backend that can serve a job of ``size`` ranks."""
    try:
        specs = list_backends()
    except TntError as exc:
        raise UsageError(f"cannot list backends: {exc}") from None
    names = [spec.name for spec in specs]
    if name not in names:
        raise UsageError(f"unknown backend {name!r}; {unknown_backend_hint(name, names)}")
    # what rank 0 will see (the address is a stand-in: the store does not exist yet)
    config = Config(rank=0, size=size, local_rank=0, local_size=local_size, backend=name,
                    rendezvous="127.0.0.1:1", rendezvous_key="-", launched=True)
    spec = specs[names.index(name)]
    if not spec.is_available(config):
        fits = [s.name for s in specs if s.is_available(config)]
        raise UsageError(f"backend {name!r} cannot run a job of {size} rank(s)"
                         + (f"; backends that can: {', '.join(fits)}" if fits else ""))


def _named_hosts(options: RunOptions) -> list[Host] | None:
    """The hosts the user named: the hostfile's, or ``-H``'s; None when neither."""
    if options.hostfile is not None:
        return read_hostfile(options.hostfile)
    return options.hosts


def resolve_job(options: RunOptions, launcher: Launcher) -> Job:
    """Hosts, devices and placement of the job ``options`` describe; warnings for the user
    go to ``Job.warnings`` (printed once all input has been checked)."""
    warnings: list[str] = []
    named = _named_hosts(options)
    if named is not None:
        hosts = named
    else:
        hint = launcher.hosts_hint()
        hosts = [Host(h) for h in hint] if hint else [Host(LOCALHOST)]
    command = _command(options)
    if (options.pin_cpu or options.pin_memory) and shutil.which("numactl") is None:
        raise UsageError("--pin-to-socket/--pin-memory-to-socket need numactl, which is not "
                         "installed (apt install numactl / dnf install numactl)")
    gpus = [] if options.no_gpu else visible_gpus()
    hide_gpus = options.no_gpu and bool(visible_gpus())
    if not gpus and not options.no_gpu and options.nranks is None and options.per_node is None \
            and all(h.slots is None for h in hosts):
        warnings.append("no GPU found: starting one CPU rank per host "
                        "(-n / --n-per-node for more, --no-gpu silences this warning)")
    placement = place_ranks(hosts, options.nranks, options.per_node,
                            default_per_node=len(gpus) or 1, gpus=gpus or None)
    if gpus and placement.max_local_size > len(gpus):
        warnings.append(f"{placement.max_local_size} ranks per host but only {len(gpus)} GPU(s): "
                        "running every rank on the CPU")
        placement = place_ranks(hosts, options.nranks, options.per_node,
                                default_per_node=len(gpus), gpus=None)
        gpus, hide_gpus = [], True
    _check_oversubscription(placement, cpu_count(), warnings)
    job = Job(options=options, placement=placement, command=command, cwd=os.getcwd(),
              gpus=gpus or None, hide_gpus=hide_gpus, agent_python=sys.executable,
              cores=cpu_count(), warnings=warnings)
    backend = job.settings().backend  # checks the exported and -x settings too
    if backend:
        _check_backend(backend, placement.size, placement.max_local_size)
    if options.elastic:
        _check_elastic(job)
    return job


def _check_elastic(job: Job) -> None:
    """An elastic job runs a backend whose communicator can be rebuilt over new members."""
    backend = job_backend(job.settings(), job.options, job.placement)
    if backend == "mpi":
        raise UsageError("elastic options (--min-np, --max-np, --max-restarts, "
                         "--host-discovery-script) need the gloo backend: an MPI communicator "
                         "cannot shrink without ULFM")
    options, n = job.options, job.placement.size
    if options.min_np is not None and options.min_np > n:
        raise UsageError(f"--min-np {options.min_np} is more than the {n} rank(s) the job "
                         "starts with")
    if options.max_np is not None and options.max_np < n:
        raise UsageError(f"--max-np {options.max_np} is less than the {n} rank(s) the job "
                         "starts with")


def elastic_limits(options: RunOptions, size: int) -> ElasticLimits:
    """``--min-np`` (default: the starting size), ``--max-np`` (default: the starting
    size), ``--max-restarts`` (default 0)."""
    return ElasticLimits(min_np=options.min_np or size, max_np=max(size, options.max_np or size),
                         max_restarts=options.max_restarts or 0)


#: ranks per CPU of this machine above which tnt run warns: a few per CPU are common in
#: tests and on laptops; beyond that steps crawl and peers time out waiting
WARN_RANKS_PER_CPU = 4
#: most ranks ``tnt run`` starts on this machine per CPU: each is a Python process with the
#: framework loaded (hundreds of MB); far more than the CPUs is a typo, not a test
MAX_RANKS_PER_CPU = 32


def _check_oversubscription(placement: Placement, cpus: int, warnings: list[str]) -> None:
    """Many more ranks on this machine than CPUs: a warning; far more: an error before any
    process starts (``-n 100000`` would otherwise start processes until memory runs out)."""
    local = sum(1 for s in placement.slots if is_local_host(s.host))
    if not local or local <= WARN_RANKS_PER_CPU * cpus:
        return
    limit = max(64, MAX_RANKS_PER_CPU * cpus)
    if local > limit:
        raise UsageError(f"{local} ranks on this machine, which has {cpus} CPU(s): at most "
                         f"{limit} are started here ({MAX_RANKS_PER_CPU} per CPU); name more "
                         "hosts (--hostfile, -H) to spread the ranks over more machines")
    warnings.append(f"{local} ranks on this machine's {cpus} CPU(s): oversubscribed, each rank "
                    f"gets a {local // cpus}th of a CPU and the job runs slower than with fewer "
                    "ranks (raise --timeout if peers time out waiting)")


def _cleanup_remote(host: str, script: str, force: bool, python: str,
                    ssh_args: list[str]) -> tuple[str, bool]:
    """``python -m tnt_cli.cleanup`` on ``host`` over ssh: its one-line report, and whether
    every rank there is gone."""
    remote = [python, "-m", "tnt_cli.cleanup", "--host", host, *(["--force"] if force else []),
              "--", script]
    try:
        out = subprocess.run(ssh_command(host, remote, ssh_args), capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=60 + WAIT_S)
    except subprocess.TimeoutExpired:
        return f"{host}: no answer within {60 + WAIT_S:g}s", False
    except OSError as exc:
        return f"{host}: cannot run ssh: {exc.strerror or exc}", False
    text = (out.stdout.strip() or out.stderr.strip() or f"ssh exited with {out.returncode}")
    return f"{host}: {text}" if out.returncode == 255 else text, out.returncode == 0


def _cleanup(options: RunOptions, launcher: Launcher) -> int:
    named = _named_hosts(options)
    if named is not None:
        hosts = [h.name for h in named]
    else:
        hosts = launcher.hosts_hint() or [LOCALHOST]
    script, all_ok = options.command[0], True
    for host in hosts:
        if is_local_host(host):
            line, ok = cleanup_host(script, options.force, host)
        else:
            line, ok = _cleanup_remote(host, script, options.force, sys.executable, options.ssh_args)
        print(line, flush=True)
        all_ok &= ok
    return 0 if all_ok else 1


def _run(options: RunOptions, prog: str) -> int:
    launcher = choose_launcher(options)
    if options.cleanup:
        return _cleanup(options, launcher)
    job = resolve_job(options, launcher)
    launcher.check(job)
    bind = store_bind_address(job.placement.hosts, options.rendezvous_host)
    for warning in job.warnings:
        print(f"{prog}: warning: {warning}", file=sys.stderr, flush=True)
    if options.dry_run:
        rendezvous = dry_run_rendezvous(bind, options.rendezvous_port)
        sys.stdout.write(render_dry_run(job, launcher, launcher.processes(job, rendezvous), rendezvous))
        return 0
    restarts = 0
    while True:
        code, restarted = _attempt(job, launcher, bind, prog, restarts)
        if not restarted:
            return code
        restarts += 1


def _attempt(job: Job, launcher: Launcher, bind: str, prog: str, restarts: int) -> tuple[int, bool]:
    """One run of every rank of the job, with a rendezvous of its own: its exit code, and
    whether every rank is to be started again (an elastic job that cannot go on without a
    rank lost one, :attr:`Supervisor.restart_all`); ``restarts``: the restarts done."""
    options = job.options
    try:
        store = StoreServer(bind, options.rendezvous_port)
    except ConfigError as exc:
        raise UsageError(f"{exc} (--rendezvous-host / --rendezvous-port)") from None
    leftovers_before = shm_segments()
    with store:
        rendezvous = Rendezvous(store.url, store.key)
        procs = launcher.processes(job, rendezvous)
        reported = any(spec["rank"] is None for proc in procs for spec in proc.specs)
        elastic, discovery = None, None
        if options.elastic:
            elastic, discovery = _elastic_job(job, launcher, rendezvous, store, procs, prog, restarts)
            limits = elastic_limits(job.options, job.placement.size)
            joins = limits.max_restarts > 0 or limits.max_np > job.placement.size \
                or discovery is not None
            resizes = limits.min_np < job.placement.size or limits.max_np > job.placement.size \
                or discovery is not None
            procs = [with_env(proc, {"TNT_ELASTIC": "1", "TNT_ELASTIC_JOINS": "1" if joins else "0",
                                     "TNT_ELASTIC_RESIZES": "1" if resizes else "0"},
                              job) for proc in procs]
        supervisor = Supervisor(procs, job.grace_s, prog=prog,
                                not_arrived=_not_arrived_reader(store), rank_reports=reported,
                                elastic=elastic)
        if reported:
            _watch_rank_failures(store, supervisor)
        if discovery is not None and elastic is not None:
            discovery.start(elastic.hosts or {}, supervisor.hosts_changed)
        try:
            code = supervisor.run()
        finally:
            if discovery is not None:
                discovery.stop()
            if elastic is not None:
                elastic.store.close()
            _sweep(leftovers_before)
        # not after Ctrl+C (the exit code it set): the user ends the job
        return code, supervisor.restart_all is not None and supervisor.exit_code is None


def _elastic_job(job: Job, launcher: Launcher, rendezvous: Rendezvous, store: StoreServer,
                 procs: list[ProcessSpec], prog: str,
                 restarts: int = 0) -> tuple[ElasticJob, HostDiscovery | None]:
    """The membership keeper of an elastic job, its generation 0 published before any
    rank starts; and the host discovery, when a script was given."""
    host, port = store.address
    client = StoreClient(host, port, store.key, connect_timeout=10.0)
    discovery, hosts = None, None
    script = job.options.host_discovery_script
    if script is not None:
        def warn(text: str) -> None:
            print(f"{prog}: warning: {text}", file=sys.stderr, flush=True)

        local_only = launcher.name == "local"
        discovery = HostDiscovery(os.path.abspath(script), warn,
                                  lambda name: not local_only or is_local_host(name))
        hosts = discovery.discover()
        if hosts is None:
            raise UsageError(f"--host-discovery-script {script}: the first run failed")
    elastic = ElasticJob(elastic_limits(job.options, job.placement.size), procs, client,
                         process_maker(job, launcher, rendezvous), hosts, job.placement.slots,
                         restarts)
    elastic.publish_initial()
    return elastic, discovery


def _sweep(before: set[str]) -> None:
    """Remove what the job's killed processes left on this machine (mpiexec's proxies may
    kill an agent before it can sweep) once nothing holds it; ranks ended by SIGKILL may
    take a moment to let go, so a few tries within a second. Nothing new: no wait."""
    for _ in range(5):
        if not shm_segments() - before:
            return
        remove_orphan_segments(before)
        time.sleep(0.2)


def _watch_rank_failures(store: StoreServer, supervisor: Supervisor) -> None:
    """Under mpirun/srun, agents report every failed rank through the store
    (agent.FAILURE_KEY): the first report may be a consequence, the cause a later one."""
    host, port = store.address

    def watch() -> None:
        try:
            client = StoreClient(host, port, store.key, connect_timeout=10.0)
            for rank, code, last in read_failures(client):
                supervisor.rank_failed(rank, code, last)
        except (TntError, OSError, ValueError):
            return  # the store closed: the job is over

    threading.Thread(target=watch, name="tnt-failure-watch", daemon=True).start()


def _not_arrived_reader(store: StoreServer) -> Callable[[], str | None]:
    """What the stall inspector of a failed wait left in the store: the ranks that did not
    arrive at the collective, as the launcher's verdict names them (None: nothing left)."""

    def read() -> str | None:
        host, port = store.address
        try:
            client = StoreClient(host, port, store.key, connect_timeout=2.0, timeout=2.0)
            try:
                if not client.check([NOT_ARRIVED_KEY]):
                    return None
                return client.get(NOT_ARRIVED_KEY).decode()
            finally:
                client.close()
        except (TntError, OSError, ValueError):
            return None

    return read


def run_command(argv: Sequence[str], prog: str = "tnt run") -> int:
    """The ``tnt run`` command; returns the exit code."""
    options = parse_run_args(argv, prog)
    try:
        return _run(options, prog)
    except (UsageError, ConfigError) as exc:  # a bad option, or a bad exported/-x TNT_* value
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
