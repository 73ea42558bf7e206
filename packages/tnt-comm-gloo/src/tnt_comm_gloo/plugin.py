"""The ``tnt`` entry point of tnt-comm-gloo: declares the ``gloo`` backend and its
``TNT_GLOO_*`` settings.

``pyproject.toml`` registers this module::

    [project.entry-points.tnt]
    gloo = "tnt_comm_gloo.plugin"
"""

from __future__ import annotations

import functools
import importlib
import logging

from tnt_core import BackendSpec, Config, SettingsRegistry, hookimpl

from .settings import GLOO

__all__ = ["PRIORITY", "is_available", "make_backend", "native_import_error", "tnt_comm_backends",
           "tnt_register_settings"]

#: Above tnt-core's ``local`` (0) and the reference ``store`` backend (-100).
PRIORITY = 100


log = logging.getLogger("tnt.gloo")


@functools.cache
def native_import_error() -> str | None:
    """Why the native module does not load (e.g. libgloo.so.0 missing), or None."""
    try:
        importlib.import_module("tnt_comm_gloo._gloo")
    except ImportError as exc:
        return str(exc)
    return None


def is_available(config: Config) -> bool:
    """True when this backend can serve the job: several ranks, a rendezvous to meet
    through (``host:port`` or ``file:///dir``) and a native module that loads."""
    if config.size < 2 or not config.rendezvous:
        return False
    error = native_import_error()
    if error is not None:
        log.warning("tnt-comm-gloo is installed but its native module does not load (%s); "
                    "install libgloo-dev and reinstall tnt-comm-gloo", error)
        return False
    return True


def make_backend(config: Config):
    """The factory tnt-core calls once per process."""
    from .backend import GlooBackend

    return GlooBackend(config)


@hookimpl
def tnt_comm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="gloo",
            factory=make_backend,
            priority=PRIORITY,
            available=is_available,
            description=("Gloo over full-mesh TCP (allreduce through shared memory within a "
                         "host); native worker thread"),
        )
    ]


@hookimpl
def tnt_register_settings(registry: SettingsRegistry) -> None:
    registry.add(GLOO)
