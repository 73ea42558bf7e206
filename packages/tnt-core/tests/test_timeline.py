import json
import time

import numpy as np

from tnt_core import (
    CompletedHandle,
    Config,
    FusedAllreducer,
    LocalBackend,
    Timeline,
    plan_buckets,
    timeline_path,
)
from tnt_core.testing import fused_allreduce


def test_paths_per_rank(tmp_path):
    assert timeline_path(tmp_path / "t.json", 0) == tmp_path / "t.json"
    assert timeline_path(tmp_path / "t.json", 2) == tmp_path / "t.rank2.json"
    assert timeline_path(str(tmp_path / "r{rank}/t.json"), 3) == tmp_path / "r3/t.json"


def test_trace_file_is_chrome_trace_json(tmp_path):
    tl = Timeline(tmp_path / "t.json", rank=1)
    with tl.span("backprop", "backprop", step=0):
        time.sleep(0.01)
    tl.instant("epoch end", "marks")
    path = tl.close()
    assert path == tmp_path / "t.rank1.json"
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 1 and spans[0]["name"] == "backprop" and spans[0]["pid"] == 1
    assert spans[0]["dur"] >= 9000, "duration is in microseconds"
    lanes = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"backprop", "marks"}
    assert tl.close() == path  # idempotent


class SlowBackend(LocalBackend):
    """Completes each allreduce 20 ms after it is issued, like a network would."""

    def allreduce_async(self, buf, op="sum"):
        handle = CompletedHandle(buf)
        handle._t = time.perf_counter() + 0.02
        return handle


def test_fusion_records_each_bucket_from_issue_to_completion(tmp_path):
    tl = Timeline(tmp_path / "t.json")
    plan = plan_buckets([((4,), "float32")] * 3, 0)
    fused = FusedAllreducer(SlowBackend(), plan, timeline=tl)
    fused_allreduce(fused, [np.ones(4, np.float32)] * 3)
    spans = [e for e in tl.events if e["ph"] == "X"]
    assert [s["name"] for s in spans] == [f"allreduce bucket {i}" for i in range(3)]
    assert all(s["dur"] >= 19000 for s in spans)
    assert all(s["args"]["bytes"] == 16 for s in spans)


def test_overlap_off_defers_every_allreduce_to_finish():
    issued = []

    class Recording(LocalBackend):
        def allreduce_async(self, buf, op="sum"):
            issued.append(buf.size)
            return CompletedHandle(buf)

    plan = plan_buckets([((2,), "float32")] * 2, 0)
    fused = FusedAllreducer(Recording(), plan, overlap=False)
    fused.push(0, np.ones(2, np.float32))
    fused.push(1, np.ones(2, np.float32))
    assert issued == [], "nothing may start before finish() when overlap is off"
    out = fused.finish()
    assert issued == [2, 2] and out[1].tolist() == [1.0, 1.0]


def test_config_reads_timeline_path():
    assert Config.from_env({"TNT_TIMELINE": "/tmp/x.json"}).timeline == "/tmp/x.json"
    assert Config.from_env({}).timeline is None
    assert Config.from_env({}).overlap is True
    assert Config.from_env({"TNT_OVERLAP": "false"}).overlap is False
