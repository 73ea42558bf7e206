"""The launchers, by ``--launcher`` name, and the choice ``--launcher auto`` makes.

Auto-detection asks each launcher in :data:`AUTO_ORDER` whether it fits; the first that
says yes wins (local always does).
"""

from __future__ import annotations

from ..options import RunOptions
from .base import Launcher, ProcessSpec
from .local import LocalLauncher
from .mpirun import MpirunLauncher
from .srun import SrunLauncher
from .ssh import SshLauncher

__all__ = ["LAUNCHERS", "AUTO_ORDER", "Launcher", "ProcessSpec", "choose_launcher"]

LAUNCHERS: dict[str, type[Launcher]] = {
    cls.name: cls for cls in (LocalLauncher, SshLauncher, MpirunLauncher, SrunLauncher)
}
#: srun inside a multi-node allocation, mpirun for the MPI backend, ssh with named hosts
AUTO_ORDER: tuple[type[Launcher], ...] = (SrunLauncher, MpirunLauncher, SshLauncher, LocalLauncher)


def choose_launcher(options: RunOptions) -> Launcher:
    """The launcher named by ``--launcher``, or the first of :data:`AUTO_ORDER` that fits."""
    if options.launcher != "auto":
        return LAUNCHERS[options.launcher]()
    for cls in AUTO_ORDER:
        if cls.detect(options):
            return cls()
    raise AssertionError("LocalLauncher.detect always fits")
