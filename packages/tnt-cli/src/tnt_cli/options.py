"""Command-line options of ``tnt run`` / ``tarantella``: parsing and validation.

Everything the user typed becomes one :class:`RunOptions`; every mistake becomes one line
on stderr and exit code 2 (argparse's convention), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from tnt_core import VARIABLES, Variable

from . import __version__
from .errors import USAGE_EXIT_CODE, UsageError
from .hostfile import Host, parse_host_list
from .settings_listing import plugin_settings_note

__all__ = ["RunOptions", "build_parser", "parse_run_args", "LAUNCHER_CHOICES", "LOG_LEVELS"]

LAUNCHER_CHOICES = ("auto", "local", "ssh", "mpirun", "srun")
LOG_LEVELS = tuple(c for c, _ in VARIABLES["TNT_LOG_LEVEL"].choices)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: a command that starts with a Python (``python train.py``, as horovodrun and mpirun take
#: it) runs with that Python, as ``--python-interpreter`` would say
_PYTHON = re.compile(r"python[0-9.]*")


@dataclass
class RunOptions:
    command: list[str]
    nranks: int | None = None
    hostfile: str | None = None
    #: ``-H``: the hosts named on the command line
    hosts: list[Host] | None = None
    per_node: int | None = None
    no_gpu: bool = False
    launcher: str = "auto"
    backend: str | None = None
    env: list[tuple[str, str]] = field(default_factory=list)
    fusion_threshold_kb: float | None = None
    log_level: str | None = None  # None: TNT_LOG_LEVEL if exported, else WARNING
    log_all: bool = False
    output_all: bool = False
    python: list[str] = field(default_factory=list)  # empty: run the command as a binary
    pin_cpu: bool = False
    pin_memory: bool = False
    #: "core": each rank of a host bound to cores of its own (devices.rank_cpus); "none"
    bind_to: str = "core"
    timeout_s: float | None = None
    rendezvous_host: str | None = None
    rendezvous_port: int = 0
    ssh_args: list[str] = field(default_factory=list)
    dry_run: bool = False
    cleanup: bool = False
    force: bool = False
    #: elastic: fewest ranks the job goes on with (None: not given)
    min_np: int | None = None
    #: elastic: most ranks the job grows to
    max_np: int | None = None
    #: elastic: dead ranks replaced, in the whole job
    max_restarts: int | None = None
    #: elastic: prints the available hosts ('HOST:SLOTS' lines), polled while the job runs
    host_discovery_script: str | None = None

    @property
    def elastic(self) -> bool:
        """Ranks may leave and join: any of the elastic options was given."""
        return any(v is not None for v in (self.min_np, self.max_np, self.max_restarts,
                                           self.host_discovery_script))

    @property
    def names_hosts(self) -> bool:
        """The user named the job's hosts (``--hostfile`` or ``-H``)."""
        return self.hostfile is not None or self.hosts is not None


def _default(var: Variable) -> str:
    """A variable's default in the help, taken from its declaration (never restated)."""
    return var.format(var.default)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``tnt run: error: ... (see tnt run --help)``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_EXIT_CODE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535, 0 picks a free one)")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _nonneg_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def _env_assignment(text: str) -> tuple[str, str]:
    """``NAME=VALUE``, or ``NAME`` alone for its value here (as ``mpirun -x NAME``)."""
    name, sep, value = text.partition("=")
    if not sep:
        if _ENV_NAME.fullmatch(name) and name in os.environ:
            return name, os.environ[name]
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=VALUE, nor a variable set here to pass on (put the script "
            "after '--', e.g. -x A=1 -- train.py)"
        )
    if not _ENV_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"{name!r} in {text!r} is not a valid variable name")
    return name, value


def _host_list(text: str) -> list[Host]:
    try:
        return parse_host_list(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("-H ")) from None


def _shell_words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} into words: {exc}") from None


_DESCRIPTION = """\
Start SCRIPT as a distributed Tarantella-NT job: N ranks on this machine or on the hosts
of a hostfile (or -H). tnt run hosts the job's rendezvous store, gives every rank its TNT_*
environment, streams the master rank's output, and ends every rank when one fails or on
Ctrl+C. The exit code is the first failing rank's exit code (0 when all succeed).
"""

_EPILOG = """\
examples:
  tnt run -n 4 -- train.py --batch_size=64       4 ranks on this machine
  tnt run --hostfile hosts --n-per-node 2 -- train.py
  tnt run -np 4 -H node1:2,node2:2 python train.py   horovodrun's spelling
  tnt run -n 2 -x DATASET=/scratch/data -- train.py
  tnt run --dry-run --hostfile hosts -- train.py  show what would run where
  tnt run --hostfile hosts --cleanup -- train.py  end leftover ranks of train.py

settings: -x NAME=VALUE wins over an option (--timeout, ...), which wins over a TNT_*
variable exported in this shell, which wins over the default.

hostfile: one host name per line, 'HOST slots=K' allowed, '#' starts a comment; names must
be unique. -H HOST:K,HOST:K names the same hosts on the command line. Remote ranks need
passwordless ssh and the same paths (script, virtualenv) on every host.

A command that starts with a Python ('python train.py', as horovodrun takes it) runs as
given, with that Python on every host; a bare SCRIPT runs with the Python running tnt.
"""


def build_parser(prog: str = "tnt run") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=_DESCRIPTION, epilog=_EPILOG + plugin_settings_note(),
                allow_abbrev=False,
                usage=f"{prog} [options] -- SCRIPT [ARGS...]",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("where ranks run")
    where.add_argument("-n", "-np", "--np", dest="nranks", type=_positive_int, metavar="N",
                       help="number of ranks (default: the hosts' slots, else one per GPU of each "
                            "host, or one CPU rank per host when there is no GPU)")
    where.add_argument("--hostfile", metavar="FILE",
                       help="run on the hosts listed in FILE, a line 'HOST' or 'HOST slots=K' "
                            "(default: this machine only)")
    where.add_argument("-H", "--hosts", dest="hosts", type=_host_list, action="append",
                       metavar="HOST[:K],...",
                       help="run on these hosts, K ranks on each (horovodrun's -H: like a "
                            "hostfile of 'HOST slots=K' lines)")
    where.add_argument("--n-per-node", "--npernode", "--devices-per-node", dest="per_node",
                       type=_positive_int, metavar="K",
                       help="ranks per host (overrides the hosts' slots: 'slots=' of the "
                            "hostfile, ':K' of -H)")
    where.add_argument("--no-gpu", action="store_true",
                       help="run on CPUs even when GPUs are present (hides them from the ranks)")
    where.add_argument("--launcher", choices=LAUNCHER_CHOICES, default="auto",
                       help="how ranks are started: local processes, ssh to each host, or an "
                            "existing launcher (mpirun, srun). auto: srun inside a multi-node "
                            "Slurm allocation, mpirun for --backend mpi, ssh with a hostfile or "
                            "-H, else local")
    where.add_argument("--ssh-args", type=_shell_words, default=[], metavar="ARGS",
                       help="extra arguments for ssh, e.g. \"-p 2222 -i ~/.ssh/cluster\"")
    where.add_argument("--rendezvous-host", metavar="ADDR",
                       help="address of this machine the other hosts reach the rendezvous "
                            "store at (default: 127.0.0.1 on one node, else the address "
                            "routing to the first remote host)")
    where.add_argument("--rendezvous-port", type=_port, default=0, metavar="PORT",
                       help="TCP port of the rendezvous store (default: a free one)")

    rank = p.add_argument_group("what each rank gets")
    rank.add_argument("--backend", metavar="NAME",
                      help="communication backend (an installed tnt plugin: gloo, mpi, ...; "
                           "default: the ranks pick the best available one)")
    rank.add_argument("-x", "--env", dest="env", action="extend", nargs="+",
                      type=_env_assignment, default=[], metavar="NAME=VALUE",
                      help="set an environment variable on every rank (repeatable, order kept); "
                           "NAME alone passes on its value here")
    rank.add_argument("--fusion-threshold", dest="fusion_threshold_kb", type=_nonneg_float,
                      metavar="KB", help="tensor fusion threshold in KB (TNT_FUSION_THRESHOLD_KB; "
                           f"default {_default(VARIABLES['TNT_FUSION_THRESHOLD_KB'])})")
    rank.add_argument("--log-level", type=_log_level,
                      metavar="{" + ",".join(LOG_LEVELS) + "}",
                      help="log level of the ranks (TNT_LOG_LEVEL; default "
                           f"{_default(VARIABLES['TNT_LOG_LEVEL'])}); DEBUG also shows "
                           "TensorFlow's start-up lines")
    rank.add_argument("--log-on-all-devices", dest="log_all", action="store_true",
                      help="log on every rank, not only on the master rank")
    rank.add_argument("--output-on-all-devices", dest="output_all", action="store_true",
                      help="show the output of every rank, each line prefixed with [rank] "
                           "(default: only the master rank's)")
    rank.add_argument("--python-interpreter", dest="python", type=_shell_words, metavar="CMD",
                      help="interpreter that runs SCRIPT, may include arguments (default: the "
                           "Python running tnt); an empty string runs SCRIPT as a program")
    rank.add_argument("--bind-to", dest="bind_to", choices=("core", "none"), default=None,
                      help="core (the default): bind the ranks of a host to cores of their own, "
                           "the host's cores shared evenly (whole cores; not when a host has "
                           "fewer cores than ranks); none: leave them to the scheduler")
    rank.add_argument("--pin-to-socket", dest="pin_cpu", action="store_true",
                      help="bind each rank of a host to its own socket (NUMA node) with numactl")
    rank.add_argument("--pin-memory-to-socket", dest="pin_memory", action="store_true",
                      help="allocate each rank's memory only on its socket (numactl --membind)")
    rank.add_argument("--timeout", dest="timeout_s", type=_positive_float, metavar="SECONDS",
                      help="seconds a rank waits for a peer (collective, rendezvous) before "
                           f"failing (TNT_TIMEOUT_S; default {_default(VARIABLES['TNT_TIMEOUT_S'])})")

    elastic = p.add_argument_group(
        "elastic jobs (a rank that dies does not end the job; gloo backend, local or ssh ranks)")
    elastic.add_argument("--min-np", dest="min_np", type=_positive_int, metavar="M",
                         help="train with at least M ranks, waiting for replacements that "
                              "start up; fewer end the job (default: -n)")
    elastic.add_argument("--max-np", dest="max_np", type=_positive_int, metavar="N",
                         help="grow to at most N ranks when hosts appear (default: -n)")
    elastic.add_argument("--max-restarts", dest="max_restarts", type=_nonneg_int, metavar="R",
                         help="start a replacement for a rank that died, up to R times in the "
                              "job (default 0)")
    elastic.add_argument("--host-discovery-script", dest="host_discovery_script", metavar="PATH",
                         help="a program printing the available hosts, one 'HOST:SLOTS' a "
                              "line; polled while the job runs: ranks of a host that vanishes "
                              "are ended, new slots get new ranks (up to --max-np)")

    ctl = p.add_argument_group("control")
    ctl.add_argument("--dry-run", action="store_true",
                     help="print what would run on which host, start nothing")
    ctl.add_argument("--cleanup", action="store_true",
                     help="end leftover ranks of SCRIPT on every host instead of starting it")
    ctl.add_argument("--force", action="store_true",
                     help="with --cleanup: kill (SIGKILL) instead of asking ranks to stop")
    ctl.add_argument("--version", action="version", version=f"%(prog)s (tnt-cli) {__version__}")
    p.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def parse_run_args(argv: Sequence[str], prog: str = "tnt run") -> RunOptions:
    """Parse ``argv`` (options, ``--``, script and its arguments) into :class:`RunOptions`.

    Exits with code 2 and one line on stderr for bad input, like argparse.
    """
    argv = list(argv)
    parser = build_parser(prog)
    if "--" in argv:
        cut = argv.index("--")
        ns = parser.parse_args(argv[:cut])
        if ns.command:
            parser.error(f"unexpected {ns.command[0]!r} before '--'; the script and its "
                         "arguments go after '--'")
        ns.command = argv[cut + 1:]
    else:
        ns = parser.parse_args(argv)
    try:
        return _validate(ns)
    except UsageError as exc:
        parser.error(str(exc))
        raise  # unreachable: error() exits


def _validate(ns: argparse.Namespace) -> RunOptions:
    command = list(ns.command or [])
    python = [sys.executable] if ns.python is None else ns.python
    if ns.python is None and command and _PYTHON.fullmatch(os.path.basename(command[0])):
        python, command = command[:1], command[1:]  # `python train.py`: it names its Python
    if not command:
        raise UsageError("missing script: put it after '--', e.g. tnt run -n 2 -- train.py")
    if ns.force and not ns.cleanup:
        raise UsageError("--force only goes with --cleanup")
    if ns.cleanup and ns.dry_run:
        raise UsageError("--cleanup and --dry-run cannot be combined")
    if ns.hostfile is not None and ns.hosts is not None:
        raise UsageError("name the hosts once: --hostfile FILE or -H HOST:K,..., not both")
    if ns.hosts is not None and len(ns.hosts) > 1:
        raise UsageError("-H is given more than once; name every host in one -H HOST:K,HOST:K")
    _check_elastic(ns)
    if ns.bind_to == "core" and ns.pin_cpu:
        raise UsageError("--bind-to core and --pin-to-socket both bind the ranks: give one")
    return RunOptions(
        command=command, nranks=ns.nranks, hostfile=ns.hostfile,
        hosts=None if ns.hosts is None else ns.hosts[0], per_node=ns.per_node,
        no_gpu=ns.no_gpu, launcher=ns.launcher, backend=ns.backend, env=list(ns.env),
        fusion_threshold_kb=ns.fusion_threshold_kb, log_level=ns.log_level, log_all=ns.log_all,
        output_all=ns.output_all, python=python, pin_cpu=ns.pin_cpu, pin_memory=ns.pin_memory,
        bind_to=ns.bind_to or ("none" if ns.pin_cpu else "core"),
        timeout_s=ns.timeout_s, rendezvous_host=ns.rendezvous_host,
        rendezvous_port=ns.rendezvous_port, ssh_args=ns.ssh_args, dry_run=ns.dry_run,
        cleanup=ns.cleanup, force=ns.force, min_np=ns.min_np, max_np=ns.max_np,
        max_restarts=ns.max_restarts, host_discovery_script=ns.host_discovery_script,
    )


def _check_elastic(ns: argparse.Namespace) -> None:
    """The elastic options agree with each other and with ``-n``."""
    n, lo, hi = ns.nranks, ns.min_np, ns.max_np
    if lo is not None and n is not None and lo > n:
        raise UsageError(f"--min-np {lo} is more than the {n} rank(s) the job starts with (-n)")
    if hi is not None and n is not None and hi < n:
        raise UsageError(f"--max-np {hi} is less than the {n} rank(s) the job starts with (-n)")
    if lo is not None and hi is not None and lo > hi:
        raise UsageError(f"--min-np {lo} is more than --max-np {hi}")
    script = ns.host_discovery_script
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise UsageError(f"--host-discovery-script {script!r} is not an executable file "
                         "(chmod +x it; it prints one 'HOST:SLOTS' a line)")
    elastic = any(v is not None for v in (lo, hi, ns.max_restarts, script))
    if elastic and ns.launcher in ("mpirun", "srun"):
        raise UsageError(f"elastic options need one process per rank (--launcher local or "
                         f"ssh); --launcher {ns.launcher} starts them all at once")
    if elastic and ns.cleanup:
        raise UsageError("--cleanup takes no elastic option")
