"""The process's view of the job: rank, size and the chosen backend.

One :class:`Runtime` per process, made by :func:`tnt_core.init` (``_lifecycle``) and handed
to the ``tnt_runtime_*`` hooks; it knows nothing of how its backend was chosen.
"""

from __future__ import annotations

import pluggy

from ._backend import BackendSpec, CommBackend
from ._config import Config
from ._stall_inspector import StallInspector

__all__ = ["Runtime", "MASTER_RANK"]

#: the rank that writes checkpoints and prints progress
MASTER_RANK = 0


class Runtime:
    """The process's view of the job: rank, size and the chosen backend."""

    def __init__(self, config: Config, backend: CommBackend, spec: BackendSpec,
                 plugin_manager: pluggy.PluginManager) -> None:
        self.config = config
        #: the job's communicator; in a multi-rank job a :class:`~tnt_core.WatchedBackend`
        #: around the plugin's backend (its ``inner``), which counts collectives for the
        #: stall inspector
        self.backend = backend
        self.backend_spec = spec
        self.plugin_manager = plugin_manager
        self.stall_inspector: StallInspector | None = None
        self._stopped = False

    # ranks come from the backend: under mpiexec MPI knows them, not the environment
    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def size(self) -> int:
        return self.backend.size

    @property
    def local_rank(self) -> int:
        return self.backend.local_rank

    @property
    def local_size(self) -> int:
        return self.backend.local_size

    @property
    def master_rank(self) -> int:
        return MASTER_RANK

    @property
    def is_master(self) -> bool:
        return self.rank == MASTER_RANK

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        """Run ``tnt_runtime_stopping`` hooks, then close the backend. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.plugin_manager.hook.tnt_runtime_stopping(runtime=self)
        finally:
            if self.stall_inspector is not None:
                self.stall_inspector.stop()
            self.backend.close()

    def __repr__(self) -> str:
        return f"<Runtime rank {self.rank}/{self.size} backend {self.backend.name!r}>"
