"""Distributed datasets: in every step, the ranks' samples together are exactly the serial
global batch, each sample once, split as ``tnt_core.micro_batch_sizes`` says.

~20 pipeline shapes (``workers/dataset_worker.py``): map, filter, seeded and unseeded shuffle,
shuffled batches, cache/prefetch, repeat, padded and ragged batches, drop_remainder,
batched map, interleave, generator, a last batch of one sample (ranks without samples), an
unbatched dataset with ``tnt_micro_batch_size``, NumPy arrays (shuffled) and dicts of arrays.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tnt_core

pytestmark = pytest.mark.timeout(1500)  # the first test of a launch waits for it

#: pipelines whose order is random in a serial run: compared by structure only
RANDOM_ORDER = {"unseeded_shuffle", "numpy_shuffle"}


@pytest.fixture(scope="session")
def serial_batches(serial_suite) -> dict:
    return json.loads((serial_suite / "data" / "serial.json").read_text())


@pytest.fixture(scope="session")
def rank_batches(rank_suite) -> tuple[list[dict], int]:
    out, nprocs, _, planned = rank_suite
    planned.skip_unless_it_runs("data")
    return [json.loads(Path(out, "data", f"rank{r}.json").read_text()) for r in range(nprocs)], nprocs


def _expected(name: str, serial: dict, nprocs: int) -> list[list[list[int]]]:
    epochs = [[step["ids"] for step in epoch] for epoch in serial[name]]
    if name == "unbatched_micro":  # global batch = micro batch (3) x ranks
        flat = [[i for step in epoch for i in step] for epoch in epochs]
        g = 3 * nprocs
        return [[ids[k:k + g] for k in range(0, len(ids), g)] for ids in flat]
    return epochs


PIPELINES = ["plain", "tuple", "dict_features", "sample_weights", "map", "filter",
             "seeded_shuffle", "unseeded_shuffle", "shuffle_batches", "cache_shuffle_prefetch",
             "repeat_then_batch", "padded_batch", "ragged_batch", "drop_remainder", "batched_map",
             "interleave_source", "generator", "tiny_last_batch", "unbatched_micro",
             "numpy_shuffle", "numpy_dict"]


@pytest.mark.parametrize("name", PIPELINES)
def test_ranks_together_see_the_serial_batch(name, serial_batches, rank_batches):
    ranks, nprocs = rank_batches
    per_rank = [r[name] for r in ranks]
    expected = _expected(name, serial_batches, nprocs)
    for epoch, serial_steps in enumerate(expected):
        steps = [p[epoch] for p in per_rank]
        counts = {len(s) for s in steps}
        assert counts == {len(serial_steps)}, (
            f"epoch {epoch}: ranks take {sorted(len(s) for s in steps)} steps, serial {len(serial_steps)}")
        seen_in_epoch: list[int] = []
        for k, serial_ids in enumerate(serial_steps):
            parts = [s[k] for s in steps]
            b = parts[0]["b"]
            assert {p["b"] for p in parts} == {b}, f"step {k}: ranks disagree on the global batch"
            assert b == len(serial_ids), f"step {k}: global batch {b}, serial {len(serial_ids)}"
            sizes = tnt_core.micro_batch_sizes(b, nprocs, allow_empty=True)
            assert [p["n"] for p in parts] == sizes, f"step {k}: micro-batches {[p['n'] for p in parts]}"
            union = [i for p in parts for i in p["ids"]]
            assert len(union) == len(set(union)), f"step {k}: a sample on two ranks: {union}"
            if name in RANDOM_ORDER:
                seen_in_epoch += union
            else:
                assert union == serial_ids, f"epoch {epoch} step {k}: ranks {union} != serial {serial_ids}"
        if name in RANDOM_ORDER:  # same order on every rank <=> each sample exactly once
            all_ids = sorted(i for step in serial_steps for i in step)
            assert sorted(seen_in_epoch) == all_ids, f"epoch {epoch}: samples lost or repeated"
