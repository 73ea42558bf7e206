"""Pipeline schedules as lists of actions (``tarantella.pipeline.schedule``), without TensorFlow: the
generators make every pass once in orders the neighbours share, the dry run times them
(the bubble of 1F1B and GPipe is ``(P - 1) / (M + P - 1)``, messages take time, a separate
weight-gradient pass fills the bubble), and broken schedules are caught: a deadlock, a
wait for a stage that has finished, micro-batches received in another order than sent, a
message never received, a pass before its inputs. A stage step refuses a broken schedule
when it is traced, before any message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tarantella.pipeline import schedule
from tarantella.pipeline.schedule import (
    Action,
    Costs,
    Deadlock,
    Op,
    ScheduleError,
    build,
    dry_run,
    parse,
    with_messages,
)

GRID = [(2, 4), (3, 3), (4, 2), (3, 1), (4, 8), (2, 1)]


def _lists(*stages: str) -> list[list[Action]]:
    return [parse(text) for text in stages]


def test_the_module_runs_without_tensorflow():
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules")
    subprocess.run([sys.executable, "-c", code, schedule.__file__], check=True, timeout=60)


def test_actions_print_and_parse_alike():
    text = "RECV_F0<0 F0 SEND_F0>2 RECV_B0<2 B0 W0 SEND_B0>0"
    assert " ".join(map(str, parse(text))) == text
    assert parse("F12")[0] == Action(Op.FORWARD, 12)
    for bad in ("F", "SEND_F0", "F0>1", "RECV_B0>1", "X0"):
        with pytest.raises(ValueError):
            parse(bad)


@pytest.mark.parametrize("name", list(schedule.SCHEDULES))
def test_training_schedules_make_every_pass_once_and_their_messages_match(name):
    for stages, count in GRID:
        every = build(name, stages, count)
        result = dry_run(every)  # raises on any mismatch, lost message or deadlock
        for p, actions in enumerate(every):
            passes = sorted((a.op.value, a.micro_batch) for a in actions if a.op.is_compute)
            made = "FBW" if name.startswith("zb-") else "FB"
            assert passes == sorted((op, k) for op in made for k in range(count))
            sends = [a for a in actions if a.op.is_send]
            assert len(sends) == count * ((p < stages - 1) + (p > 0))
        # held activations: 1F1B at most P - p, ZB-H1 at most P (1F1B's first stage), GPipe
        # and ZB-fused all of them
        expected = [min(stages - p, count) if name == "1f1b" else min(stages, count)
                    if name == "zb-h1" else count for p in range(stages)]
        assert list(result.peak_in_flight) == expected


def test_one_f_one_b_for_two_stages_and_three_micro_batches():
    every = build("1f1b", 2, 3)
    assert " ".join(map(str, every[0])) == \
        "F0 SEND_F0>1 F1 SEND_F1>1 RECV_B0<1 B0 F2 SEND_F2>1 RECV_B1<1 B1 RECV_B2<1 B2"
    assert " ".join(map(str, every[1])) == \
        "RECV_F0<0 F0 B0 SEND_B0>0 RECV_F1<0 F1 B1 SEND_B1>0 RECV_F2<0 F2 B2 SEND_B2>0"


@pytest.mark.parametrize("name", list(schedule.SCHEDULES))
def test_the_bubble_of_equal_stages_is_p_minus_1_over_m_plus_p_minus_1(name):
    for stages, count in GRID:
        result = dry_run(build(name, stages, count), Costs(forward=1.0, backward=2.0))
        assert result.step_time == (count + stages - 1) * 3.0
        assert result.busy == tuple([count * 3.0] * stages)
        assert result.bubble == pytest.approx((stages - 1) / (count + stages - 1), abs=1e-12)


def test_message_time_and_uneven_stages_are_in_the_step():
    # GPipe, 2 stages, 2 micro-batches, 0.5 per message (traced by hand):
    # stage 0 F0 0-1 F1 1-2; stage 1 F0 1.5-2.5 F1 2.5-3.5 B1 3.5-4.5 B0 4.5-5.5;
    # stage 0 B1 5-6 B0 6-7
    result = dry_run(build("gpipe", 2, 2), Costs(forward=1, backward=1, message=0.5))
    assert result.step_time == 7.0 and result.busy == (4.0, 4.0)
    assert result.bubble == pytest.approx(1 - 8 / 14)
    assert [(str(s.action), s.start, s.end) for s in result.spans[0] if s.action.op.is_compute] == \
        [("F0", 0, 1), ("F1", 1, 2), ("B1", 5, 6), ("B0", 6, 7)]
    # the slower stage sets the pace: with stage 1 twice as slow, 1F1B's step is its work
    # plus stage 0's first forward pass and last backward pass
    slow = dry_run(build("1f1b", 2, 4), Costs(forward=[1, 2], backward=[1, 2]))
    assert slow.step_time == 1 + 4 * 4 + 1
    assert slow.stage_bubble(1) == pytest.approx(2 / 18)


def test_a_separate_weight_pass_fills_the_bubble_and_holds_activations_until_it_runs():
    costs = Costs(forward=1, backward=1, weight=1)
    full = dry_run(build("1f1b", 2, 2), costs)  # B computes both gradients: 2 per pass
    assert full.step_time == 3 * 3
    split = dry_run(with_messages([parse("F0 F1 B0 B1 W0 W1"), parse("F0 B0 F1 B1 W0 W1")]), costs)
    assert split.step_time == 8 and split.bubble < full.bubble
    assert split.busy == full.busy == (6.0, 6.0)
    one = dry_run([parse("F0 F1 B0 B1 W0 W1")], costs)
    assert one.peak_in_flight == (2,)  # micro-batch 0 is held until W0, after B1


def test_zero_bubble_h1_defers_each_weight_pass_by_its_stage_and_cuts_the_bubble_to_a_third():
    every = build("zb-h1", 2, 3)
    assert " ".join(map(str, every[0])) == \
        "F0 SEND_F0>1 F1 SEND_F1>1 RECV_B0<1 B0 W0 F2 SEND_F2>1 RECV_B1<1 B1 W1 RECV_B2<1 B2 W2"
    assert " ".join(map(str, every[1])) == \
        "RECV_F0<0 F0 B0 SEND_B0>0 RECV_F1<0 F1 B1 SEND_B1>0 W0 RECV_F2<0 F2 B2 SEND_B2>0 W1 W2"
    costs = Costs(forward=1, backward=1, weight=1)
    for stages, count in [*GRID, (5, 16), (4, 4)]:
        zb, one = dry_run(build("zb-h1", stages, count), costs), dry_run(build("1f1b", stages, count), costs)
        assert zb.busy == one.busy == tuple([count * 3.0] * stages)
        assert zb.step_time < one.step_time or stages == 1
        if count >= stages:  # the paper's bubble: P - 1 passes, 1F1B's: 3 (P - 1)
            assert zb.step_time == 3 * count + stages - 1
            assert one.step_time == 3 * count + 3 * (stages - 1)
    # uneven measured passes: the dry run times any schedule with them
    measured = Costs(forward=[2.0, 2.2], backward=[0.0, 2.1], weight=[4.1, 2.0])
    assert dry_run(build("zb-h1", 2, 4), measured).bubble < \
        dry_run(build("1f1b", 2, 4), measured).bubble


def test_a_last_stage_that_joins_its_weight_passes_keeps_its_messages_and_holds_every_micro_batch():
    """``weights_last``: ZB-H1's last stage with every W after its last B (what the stage
    runs when joining them holds less: ``StageStep._defers_weights``); the messages keep
    their order, so the dry run of the pipeline still matches, and the stage holds all M
    micro-batches until their W."""
    every = build("zb-h1", 2, 4)
    every[1] = schedule.weights_last(every[1])
    assert " ".join(map(str, every[1])) == ("RECV_F0<0 F0 B0 SEND_B0>0 RECV_F1<0 F1 B1 SEND_B1>0 "
                                            "RECV_F2<0 F2 B2 SEND_B2>0 RECV_F3<0 F3 B3 SEND_B3>0 W0 W1 W2 W3")
    run = dry_run(every, Costs(forward=1, backward=1, weight=1))
    assert run.peak_in_flight == (2, 4)


def test_zero_bubble_fused_puts_weight_passes_together_where_no_stage_waits_for_them():
    """The last stages run every W after their last B (one fused pass), the first stage,
    whose B are empty, all its forward passes first and its W in two runs: the first half's
    as soon as their gradients are in, the rest at the end."""
    every = schedule.zero_bubble_fused(2, 4)
    assert " ".join(map(str, every[0])) == "F0 F1 F2 F3 B0 B1 W0 W1 B2 B3 W2 W3"
    assert " ".join(map(str, every[1])) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3"
    middle = schedule.zero_bubble_fused(3, 3)[1]
    assert " ".join(map(str, middle)) == "F0 F1 B0 F2 B1 B2 W0 W1 W2"
    assert " ".join(map(str, schedule.zero_bubble_fused(2, 3)[0])) == "F0 F1 F2 B0 B1 W0 W1 B2 W2"
    # the first stage's B cost nothing and a fused W less than its parts: the dry run with
    # the benchmark's measured passes (ms) has the last stage never wait after its first F
    measured = Costs(forward=[4.6, 5.0], backward=[0.0, 3.4], weight=[7.0, 5.2])
    fused = dry_run(build("zb-fused", 2, 4), measured)
    last = [s for s in fused.spans[1] if s.action.op is Op.RECV_F]
    assert [s.end - s.start for s in last[1:]] == [0.0, 0.0, 0.0]


def test_evaluation_is_the_forward_passes_in_order():
    every = build("forward", 3, 2)
    assert " ".join(map(str, every[1])) == "RECV_F0<0 F0 SEND_F0>2 RECV_F1<0 F1 SEND_F1>2"
    assert dry_run(every).peak_in_flight == (0, 0, 0)


def test_stages_that_wait_on_each_other_are_a_deadlock_naming_them():
    # stage 0 waits for gradients before it sends the activations they come from
    with pytest.raises(Deadlock) as caught:
        dry_run(_lists("F0 RECV_B0<1 SEND_F0>1 B0", "RECV_F0<0 F0 B0 SEND_B0>0"))
    assert caught.value.cycle == [0, 1]
    assert caught.value.waits == {0: Action(Op.RECV_B, 0, 1), 1: Action(Op.RECV_F, 0, 0)}
    assert "stages 0 -> 1 -> 0 wait on each other" in str(caught.value)
    assert "stage 0 waits in RECV_B0<1 for stage 1; stage 1 waits in RECV_F0<0 for stage 0" \
        in str(caught.value)
    # three stages in a circle: each first waits for the one before it
    with pytest.raises(Deadlock, match=r"stages 0 -> 2 -> 1 -> 0 wait on each other") as caught:
        dry_run(_lists("RECV_F0<2 F0 SEND_F0>1 B0", "RECV_F0<0 F0 SEND_F0>2 B0",
                       "RECV_F0<1 F0 SEND_F0>0 B0"))
    assert caught.value.cycle == [0, 2, 1]


def test_a_wait_for_a_stage_that_has_finished_is_a_deadlock_naming_it():
    with pytest.raises(Deadlock, match=r"stage 1 waits in RECV_B0<0 for stage 0; stage 0 has "
                                       r"run all its actions without sending it") as caught:
        dry_run(_lists("F0 SEND_F0>1 B0", "RECV_F0<0 F0 RECV_B0<0 B0"))
    assert caught.value.cycle == []


def test_micro_batches_received_in_another_order_than_sent_are_caught():
    with pytest.raises(ScheduleError, match=r"stage 1's RECV_F1<0 would receive micro-batch 0: "
                                            r"stage 0 sends its activations in the order 0 1, "
                                            r"stage 1 receives them in the order 1 0"):
        dry_run(_lists("F0 SEND_F0>1 F1 SEND_F1>1 RECV_B0<1 B0 RECV_B1<1 B1",
                       "RECV_F1<0 F1 RECV_F0<0 F0 B0 SEND_B0>0 B1 SEND_B1>0"))


def test_a_message_nobody_receives_is_caught():
    with pytest.raises(ScheduleError, match=r"stage 1 sends gradients that stage 0 never "
                                            r"receives \(SEND_B0>0\)"):
        dry_run(_lists("F0 SEND_F0>1 B0", "RECV_F0<0 F0 B0 SEND_B0>0"))


@pytest.mark.parametrize("stages, problem", [
    (("F0 B0", "F0 RECV_F0<0 B0"), "stage 1: F0 comes before RECV_F0<0"),
    (("B0 F0",), "stage 0: B0 comes before F0"),
    (("F0 F1 B1",), "stage 0: B0 is missing"),
    (("F0 W0 B0",), "stage 0: W0 comes before B0"),
    (("F0 SEND_F0>1 B0",), "stage 0: SEND_F0>1: peer 1 is not another stage of 1"),
    (("F0 B0 F0",), "stage 0: F0 appears twice"),
    (("SEND_F0>1 F0 B0", "RECV_F0<0 F0 B0"), "stage 0: SEND_F0>1 comes before F0"),
])
def test_a_pass_out_of_order_on_its_own_stage_is_refused_naming_it(stages, problem):
    with pytest.raises(ScheduleError, match=problem.replace("(", r"\(")):
        dry_run(_lists(*stages))


def test_unknown_schedule_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"schedule='zb': one of 1f1b, zb-h1, zb-fused, gpipe"):
        build("zb", 2, 4)



def test_a_stage_step_refuses_a_broken_schedule_when_traced_before_any_message(monkeypatch):
    import keras
    import numpy as np

    import tnt_core
    from tarantella.keras.layers import SplitLayer
    from tarantella.pipeline.partition import partition
    from tarantella.pipeline.stage import StageStep

    def no_warm_up(stages: int, count: int) -> list[list[Action]]:
        # stage 0 waits for micro-batch 0's gradients before it sends micro-batch 1, which
        # the last stage waits for before it sends them
        first = [Action(op, k) for k in range(count) for op in (Op.FORWARD, Op.BACKWARD)]
        return [first] + schedule.gpipe(stages, count)[1:]

    monkeypatch.setitem(schedule.SCHEDULES, "no-warm-up", no_warm_up)
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(2)(SplitLayer()(keras.layers.Dense(4)(inp))))
    backend = tnt_core.LocalBackend(tnt_core.Config(rank=0, size=1, local_rank=0, local_size=1))
    step = StageStep(partition(model), 1, backend, loss=keras.losses.MeanSquaredError(),
                     optimizer=keras.optimizers.SGD(), num_micro_batches=2, schedule="no-warm-up")
    x, y = np.zeros((4, 4), np.float32), np.zeros((4, 2), np.float32)
    with pytest.raises(Deadlock, match=r"stage 0 waits in RECV_B0<1 for stage 1; stage 1 waits "
                                       r"in RECV_F1<0 for stage 0"):
        step.train(x, y)
