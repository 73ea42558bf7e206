"""One channel for every collective (``tarantella.comm``): the steps users trace reach a
communicator only through it, and a new communicator bound to a trained model takes over
without changing a bit of the result.

``workers/channel_worker.py`` runs in the suite's two multi-rank launches (3 ranks on gloo:
the native path; 2 on ``store``: the Python path); these tests read its reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tnt_keras_helpers import NATIVE_PATH, PYTHON_PATH, launch_params

pytestmark = pytest.mark.timeout(300)

SRC = Path(__file__).resolve().parents[1] / "src" / "tarantella"
#: the steps the worker traces; each must have traced at least one graph
KINDS = ["fit", "evaluate", "predict", "custom loop", "horovod", "pipelined stage step"]


@pytest.fixture(scope="session", params=launch_params([NATIVE_PATH, PYTHON_PATH]))
def reports(request, suite_runs) -> list[dict]:
    out, nprocs, _ = suite_runs.get(request.param)
    return [json.loads((out / "channel" / f"rank{r}.json").read_text()) for r in range(nprocs)]


@pytest.mark.timeout(1500)  # the first test of a launch waits for it
def test_every_collective_of_a_traced_step_is_the_channels(reports):
    for rank, report in enumerate(reports):
        assert sorted(report["traced"]) == sorted(KINDS)
        for kind, graphs in report["traced"].items():
            assert graphs, f"rank {rank}: no graph traced for {kind}"
            for on_channel, in_graph in graphs:
                assert in_graph, f"rank {rank}, {kind}: a graph without any collective"
                assert on_channel == in_graph, (
                    f"rank {rank}, {kind}: ops reaching a communicator outside the channel: "
                    f"{sorted(set(in_graph) - set(on_channel))}; counted but not in the graph: "
                    f"{sorted(set(on_channel) - set(in_graph))}")


def test_a_new_communicator_bound_to_a_trained_model_changes_nothing(reports):
    for report in reports:
        rebind = report["rebind"]
        assert rebind["generation"] == 4  # three new communicators, then the job's again
        steady, rebound = rebind["losses"]
        assert rebound == steady and len(steady) == 3
        assert rebind["same_weights"]


def test_the_native_or_python_choice_is_made_in_one_module():
    """``grep`` finds the choice (the op library's availability) in the channel alone."""
    found = subprocess.run(["grep", "-rlE", r"native_ops\.(p2p_)?(unavailable_reason|point_to_point)",
                            str(SRC)],
                           capture_output=True, text=True, check=False).stdout.split()
    users = sorted(Path(f).relative_to(SRC).as_posix() for f in found)
    assert users == ["comm/channel.py"], users


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
