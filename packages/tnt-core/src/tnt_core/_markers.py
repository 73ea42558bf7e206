"""The pluggy marker pair of the ``tnt`` project.

Plugins are packages with an entry point in the ``tnt`` group::

    [project.entry-points.tnt]
    my_backend = "my_package.plugin"

whose module defines hook implementations::

    from tnt_core import hookimpl, BackendSpec

    @hookimpl
    def tnt_comm_backends():
        return [BackendSpec(name="mine", factory=MyBackend, priority=50)]
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "tnt"
ENTRY_POINT_GROUP = "tnt"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
