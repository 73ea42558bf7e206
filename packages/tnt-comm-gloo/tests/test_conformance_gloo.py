"""tnt-core's backend conformance suite against the gloo backend, with real processes.

With the default algorithm choice the runs cover every allreduce path: 2 ranks use
recursive doubling and the ring, 3 ranks bcube and the ring, 4 ranks all three. The
second class forces Gloo's ring onto the small buffers too.
"""

from typing import ClassVar

from tnt_core.testing.suite import BackendConformance


class TestGlooConformance(BackendConformance):
    backend = "gloo"
    nprocs = (2, 3, 4)


class TestGlooConformanceRingOnly(BackendConformance):
    backend = "gloo"
    nprocs = (3,)
    extra_env: ClassVar[dict[str, str]] = {"TNT_GLOO_ALGORITHM": "ring"}
