"""Which ranks form a pipeline, and which hold the replicas of a stage.

Why this layout: rank ``r`` is stage ``r % P`` of pipeline (replica) ``r // P``, so a
pipeline's stages are consecutive ranks and talk point-to-point in a group of their own
(``pipe``); with several pipelines (``ParallelStrategy.ALL``) each stage's replicas sum
their gradients in a group of their own (``replicas``), as DATA's ranks do.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm import Channel

__all__ = ["PipelineGroups", "pipeline_groups"]


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's place: ``stage`` of pipeline ``replica`` (of ``num_replicas``), the
    channel of its pipeline (``pipe``: stage ``p`` is its rank ``p``; the job's with one
    pipeline) and that of its stage's replicas (None with one pipeline)."""

    stage: int
    replica: int
    num_replicas: int
    pipe: Channel
    replicas: Channel | None


def pipeline_groups(world: Channel, rank: int, size: int, stages: int) -> PipelineGroups:
    """Split the job's channel (``size`` ranks) into pipelines of ``stages`` stages and the
    stages' replica groups. A collective: every rank takes part in making every group."""
    num_replicas = size // stages
    pipe: Channel = world
    replicas: Channel | None = None
    if num_replicas > 1:
        for r in range(num_replicas):
            group = world.split([r * stages + s for s in range(stages)], name="pipe")
            if group is not None:
                pipe = group
        for stage in range(stages):
            group = world.split([r * stages + stage for r in range(num_replicas)],
                                name="replicas")
            if group is not None:
                replicas = group
    return PipelineGroups(rank % stages, rank // stages, num_replicas, pipe, replicas)
