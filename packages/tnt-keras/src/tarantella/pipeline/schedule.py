"""Pipeline schedules as data: each stage's passes and messages, one list of actions per stage.

Why lists: a schedule written down as data can be generated, checked and simulated apart from
TensorFlow (this module imports none), and the stage's compiled step
(:class:`tarantella.pipeline.stage.StageStep`) traces its own list in order, so what
:func:`dry_run` proves of the lists holds for the graphs.

An action is one micro-batch's

- compute pass: ``F`` (forward), ``B`` (backward: the gradient of the stage's inputs, and of
  its weights unless the stage's list has a ``W`` for that micro-batch), ``W`` (the weights'
  gradient alone, which zero-bubble schedules place apart from ``B``);
- or message to or from another stage (``peer``): ``SEND_F``/``RECV_F`` (activations, in a
  linear pipeline to ``p + 1`` / from ``p - 1``) and ``SEND_B``/``RECV_B`` (gradients, to
  ``p - 1`` / from ``p + 1``).

A generator (:data:`SCHEDULES`) gives the compute order of every stage for ``P`` stages and
``M`` micro-batches; :func:`with_messages` adds the messages a linear pipeline needs, each
receive just before the pass that uses it and each send just after the pass that makes it.
:func:`dry_run` runs all stages' lists against each other with the backends' point-to-point
semantics (docs/architecture.md, "point-to-point"): a send returns at once, a receive waits
for its message, and messages between two stages on one channel arrive in the order sent.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["SCHEDULES", "Action", "Costs", "Deadlock", "DryRun", "Op", "ScheduleError",
           "build", "check", "dry_run", "forward_only", "gpipe", "one_f_one_b", "parse",
           "weights_last", "with_messages", "zero_bubble_fused", "zero_bubble_h1"]


class Op(enum.Enum):
    """What an action does (its value is how it is written: ``F3``, ``SEND_F3>1``)."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_F, Op.SEND_B)

    @property
    def is_receive(self) -> bool:
        return self in (Op.RECV_F, Op.RECV_B)

    @property
    def channel(self) -> str:
        """What a message carries: ``activations`` or ``gradients`` (a stage step's tags)."""
        return "activations" if self in (Op.SEND_F, Op.RECV_F) else "gradients"


@dataclass(frozen=True)
class Action:
    """``op`` on micro-batch ``micro_batch``; a message's ``peer`` is the other stage."""

    op: Op
    micro_batch: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.op.value}{self.micro_batch}"
        if self.op.is_send:
            return f"{text}>{self.peer}"
        if self.op.is_receive:
            return f"{text}<{self.peer}"
        return text


def parse(text: str) -> list[Action]:
    """Actions written as :class:`Action` prints them, separated by spaces
    (``"RECV_F0<0 F0 RECV_B0<2 B0 SEND_B0>0"``): for tests and error messages."""
    actions = []
    for word in text.split():
        name, peer = word, None
        for mark in "<>":
            if mark in word:
                name, _, rest = word.partition(mark)
                peer = int(rest)
        digits = len(name) - len(name.rstrip("0123456789"))
        if not digits:
            raise ValueError(f"schedule action {word!r}: no micro-batch number (e.g. F0, SEND_F0>1)")
        op = Op(name[:-digits])
        if op.is_compute != (peer is None) or (op.is_send and ">" not in word) or \
                (op.is_receive and "<" not in word):
            raise ValueError(f"schedule action {word!r}: a send is written SEND_F0>1, a receive "
                             "RECV_F0<0, a compute pass F0, B0 or W0")
        actions.append(Action(op, int(name[-digits:]), peer))
    return actions


# -- generators: the compute order of every stage ----------------------------------------------

def gpipe(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """Every forward pass, then every backward pass, the last micro-batch's first: each stage
    holds all ``M`` micro-batches' activations at the turn."""
    m = range(num_micro_batches)
    return [[Action(Op.FORWARD, k) for k in m] + [Action(Op.BACKWARD, k) for k in reversed(m)]
            for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """1F1B: stage ``p`` runs ``P - 1 - p`` forward passes ahead, then one forward and one
    backward pass in turn, then the remaining backward passes; it holds at most ``P - p``
    micro-batches' activations. Same bubble as GPipe."""
    schedules = []
    for p in range(num_stages):
        ahead = min(num_stages - 1 - p, num_micro_batches)
        actions = [Action(Op.FORWARD, k) for k in range(ahead)]
        for k in range(num_micro_batches - ahead):
            actions += [Action(Op.FORWARD, ahead + k), Action(Op.BACKWARD, k)]
        actions += [Action(Op.BACKWARD, k) for k in range(num_micro_batches - ahead, num_micro_batches)]
        schedules.append(actions)
    return schedules


def zero_bubble_h1(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's forward and
    backward passes, where ``B`` computes only the gradient of the stage's inputs (what the
    previous stage waits for) and each micro-batch's weight gradient is a ``W`` of its own,
    ``p`` micro-batches after its ``B`` on stage ``p``. Why: the later stages' ``B`` reach
    the first stage sooner, and the ``W`` left over fill the tail of the step, where 1F1B
    waits. Every stage then holds at most ``P`` micro-batches' activations, what 1F1B's
    first stage holds; with equal passes the bubble is ``P - 1`` passes instead of 1F1B's
    ``3 (P - 1)``."""
    schedules = []
    for p in range(num_stages):
        ahead = min(num_stages - 1 - p, num_micro_batches)
        actions = [Action(Op.FORWARD, k) for k in range(ahead)]
        for k in range(num_micro_batches):
            if ahead + k < num_micro_batches:
                actions.append(Action(Op.FORWARD, ahead + k))
            actions.append(Action(Op.BACKWARD, k))
            if k >= p:
                actions.append(Action(Op.WEIGHT, k - p))
        actions += [Action(Op.WEIGHT, k) for k in range(max(num_micro_batches - p, 0), num_micro_batches)]
        schedules.append(actions)
    return schedules


def zero_bubble_fused(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """1F1B's forward and backward passes with every ``W`` apart, as in ZB-H1, but placed so
    that several micro-batches' ``W`` come one after the other, which the stage's step
    computes as one pass over their rows joined
    (:mod:`tarantella.pipeline.fused_weights`):

    - the last stage and the middle ones run all their ``W`` after their last ``B``: a ``W``
      before it would delay the input gradients every earlier stage waits for;
    - the first stage, which has no input gradient (its ``B`` are empty) and so waits for
      the next stage's gradients, runs all its forward passes first, then the ``W`` of the
      first ``ceil(M / 2)`` micro-batches as soon as their gradients are in (while the later
      stages are still busy) and the rest at the end.

    Why: fused, the ``W`` of ``n`` micro-batches cost one matrix product of ``n`` times the
    rows instead of ``n`` products and ``n - 1`` additions of weight-sized tensors. The
    price is memory: a stage holds every micro-batch's activations until its ``W`` (the
    dry run's ``peak_in_flight``: ``M``, as GPipe)."""
    m = num_micro_batches
    half = (m + 1) // 2
    weights = [Action(Op.WEIGHT, k) for k in range(m)]
    schedules = []
    for p, actions in enumerate(one_f_one_b(num_stages, m)):
        if p == 0 and num_stages > 1:
            actions = [Action(Op.FORWARD, k) for k in range(m)] + \
                [Action(Op.BACKWARD, k) for k in range(half)] + weights[:half] + \
                [Action(Op.BACKWARD, k) for k in range(half, m)] + weights[half:]
        else:
            actions = actions + weights
        schedules.append(actions)
    return schedules


def weights_last(actions: Sequence[Action]) -> list[Action]:
    """A stage's list with its ``W`` moved after its last action, in their order: what a
    last stage runs that joins its ``W`` into one pass
    (:meth:`tarantella.pipeline.stage.StageStep._defers_weights` decides when it is traced,
    from what the ``W`` hold; its messages keep their order, so the other stages' lists do
    not change)."""
    return [a for a in actions if a.op is not Op.WEIGHT] + [a for a in actions if a.op is Op.WEIGHT]


def forward_only(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """Evaluation and prediction: each micro-batch's forward pass, in order."""
    return [[Action(Op.FORWARD, k) for k in range(num_micro_batches)] for _ in range(num_stages)]


#: the training schedules by name (``StageStep(schedule=...)``); the first is the default
SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {
    "1f1b": one_f_one_b,
    "zb-h1": zero_bubble_h1,
    "zb-fused": zero_bubble_fused,
    "gpipe": gpipe,
}


def with_messages(compute: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """The compute orders of a linear pipeline (stage ``p`` talks to ``p - 1`` and ``p + 1``)
    with its messages: before ``F(k)`` the activations from ``p - 1`` are received and after
    it sent to ``p + 1``; before ``B(k)`` the gradients from ``p + 1`` are received and after
    it sent to ``p - 1``. ``W`` exchanges nothing."""
    last = len(compute) - 1
    lowered = []
    for p, actions in enumerate(compute):
        out: list[Action] = []
        for a in actions:
            k = a.micro_batch
            if a.op is Op.FORWARD and p > 0:
                out.append(Action(Op.RECV_F, k, p - 1))
            if a.op is Op.BACKWARD and p < last:
                out.append(Action(Op.RECV_B, k, p + 1))
            out.append(a)
            if a.op is Op.FORWARD and p < last:
                out.append(Action(Op.SEND_F, k, p + 1))
            if a.op is Op.BACKWARD and p > 0:
                out.append(Action(Op.SEND_B, k, p - 1))
        lowered.append(out)
    return lowered


def build(name: str, num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """Schedule ``name`` (of :data:`SCHEDULES`, or ``"forward"`` for evaluation) for
    ``num_stages`` stages and ``num_micro_batches`` micro-batches, messages included."""
    generator = forward_only if name == "forward" else SCHEDULES.get(name)
    if generator is None:
        raise ValueError(f"schedule={name!r}: one of {', '.join(SCHEDULES)}")
    return with_messages(generator(num_stages, num_micro_batches))


# -- the checks and the dry run -----------------------------------------------------------------

class ScheduleError(ValueError):
    """A schedule that would compute on missing data, mix up micro-batches or hang."""


class Deadlock(ScheduleError):
    """Stages that wait for each other (or for a message never sent) forever.

    :ivar waits: each stuck stage and the receive it waits in.
    :ivar cycle: stages that wait on each other in a circle, in order (empty when the
        stuck stages wait for one that has finished instead)."""

    def __init__(self, message: str, waits: dict[int, Action], cycle: list[int]) -> None:
        super().__init__(message)
        self.waits, self.cycle = waits, cycle


#: what must come before an action of the same micro-batch on its stage
_NEEDS = {Op.FORWARD: (Op.RECV_F,), Op.BACKWARD: (Op.FORWARD, Op.RECV_B), Op.WEIGHT: (Op.BACKWARD,),
          Op.SEND_F: (Op.FORWARD,), Op.SEND_B: (Op.BACKWARD,)}


def _stage_errors(p: int, actions: Sequence[Action], num_stages: int, num_micro_batches: int,
                  passes: tuple[Op, ...]) -> list[str]:
    """What is wrong with stage ``p``'s list on its own."""
    errors = []
    seen: dict[tuple[Op, int, int | None], int] = {}
    for i, a in enumerate(actions):
        if a.op.is_compute != (a.peer is None):
            errors.append(f"{a}: a compute pass has no peer, a message needs one")
        elif a.peer is not None and not (0 <= a.peer < num_stages and a.peer != p):
            errors.append(f"{a}: peer {a.peer} is not another stage of {num_stages}")
        if not 0 <= a.micro_batch < num_micro_batches:
            errors.append(f"{a}: micro-batch {a.micro_batch} is not one of 0..{num_micro_batches - 1}")
        key = (a.op, a.micro_batch, a.peer)
        if key in seen:
            errors.append(f"{a} appears twice (actions {seen[key]} and {i})")
        seen.setdefault(key, i)
    for k in range(num_micro_batches):
        for op in passes:
            if (op, k, None) not in seen:
                errors.append(f"{Action(op, k)} is missing")
    index = {(a.op, a.micro_batch): i for i, a in enumerate(actions)}
    for (op, k), i in sorted(index.items(), key=lambda item: item[1]):
        for need in _NEEDS.get(op, ()):
            j = index.get((need, k))
            if j is None and not need.is_receive:  # a stage may receive nothing (first, last)
                errors.append(f"{actions[i]} without {Action(need, k)}")
            elif j is not None and j > i:
                errors.append(f"{actions[i]} comes before {actions[j]}")
    return errors


def _micro_batches(actions: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.micro_batch for stage in actions for a in stage), default=-1)


def check(actions: Sequence[Sequence[Action]], num_micro_batches: int | None = None) -> None:
    """Each stage's list on its own: every micro-batch's ``F`` and ``B`` once (``F`` only
    when no stage has a ``B``: evaluation), ``B`` after ``F``, ``W`` (if any) after ``B``,
    a pass after the receive of its inputs and before the send of its outputs, no action
    twice, messages to another existing stage. Raises :class:`ScheduleError` listing what
    is wrong (the dry run also checks the messages against each other)."""
    m = _micro_batches(actions) if num_micro_batches is None else num_micro_batches
    training = any(a.op is Op.BACKWARD for stage in actions for a in stage)
    passes = (Op.FORWARD, Op.BACKWARD) if training else (Op.FORWARD,)
    errors = [f"stage {p}: {e}" for p, stage in enumerate(actions)
              for e in _stage_errors(p, stage, len(actions), m, passes)]
    if errors:
        raise ScheduleError("schedule: " + "; ".join(errors))


@dataclass(frozen=True)
class Costs:
    """The time of each pass, one value for every stage or one per stage. ``backward`` is
    the input gradient's: a ``B`` whose micro-batch has no ``W`` on its stage also computes
    the weights' gradient, and costs ``backward + weight``. ``message``: from a send to the
    moment its receive can complete."""

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 1.0
    weight: float | Sequence[float] = 0.0
    message: float = 0.0

    def of(self, action: Action, stage: int, separate_weight: bool) -> float:
        def at(value: float | Sequence[float]) -> float:
            return float(value) if isinstance(value, (int, float)) else float(value[stage])

        if action.op is Op.FORWARD:
            return at(self.forward)
        if action.op is Op.BACKWARD:
            return at(self.backward) + (0.0 if separate_weight else at(self.weight))
        if action.op is Op.WEIGHT:
            return at(self.weight)
        return 0.0


@dataclass(frozen=True)
class Span:
    """When a stage ran an action (a receive: from when it began waiting to its message)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class DryRun:
    """What :func:`dry_run` found: every action's span per stage, and from them the step's
    time, each stage's compute time and the bubble."""

    spans: tuple[tuple[Span, ...], ...]
    #: the most micro-batches whose activations each stage held at once (forward done, their
    #: backward, or ``W`` where it is apart, not yet; 0 for evaluation, which keeps none)
    peak_in_flight: tuple[int, ...]

    @property
    def step_time(self) -> float:
        return max((s[-1].end for s in self.spans if s), default=0.0)

    @property
    def busy(self) -> tuple[float, ...]:
        """Each stage's time in compute passes."""
        return tuple(sum(s.end - s.start for s in spans if s.action.op.is_compute)
                     for spans in self.spans)

    @property
    def bubble(self) -> float:
        """The share of the stages' time over the step spent not computing: ``1 - sum(busy)
        / (P * step_time)`` (1F1B and GPipe with equal passes: ``(P - 1) / (M + P - 1)``)."""
        total = len(self.spans) * self.step_time
        return 1.0 - sum(self.busy) / total if total else 0.0

    def stage_bubble(self, stage: int) -> float:
        """The share of the step stage ``stage`` spends not computing."""
        return 1.0 - self.busy[stage] / self.step_time if self.step_time else 0.0


def dry_run(actions: Sequence[Sequence[Action]], costs: Costs | None = None) -> DryRun:
    """Run every stage's list against the others without computing anything: sends return
    at once, a receive waits until its peer has sent on that channel, and takes the oldest
    message there. Proves that every receive gets the micro-batch it names, that every
    message sent is received, and that no stage waits forever; raises
    :class:`ScheduleError` (:class:`Deadlock` for stages stuck in receives, naming each and
    what it waits for) otherwise. With ``costs``, the spans are timed by them (by default
    every pass takes 1)."""
    check(actions)
    costs = costs or Costs()
    stages = len(actions)
    separate = [{a.micro_batch for a in stage if a.op is Op.WEIGHT} for stage in actions]
    training = any(a.op is Op.BACKWARD for stage in actions for a in stage)
    queues: dict[tuple[int, int, str], deque[tuple[Action, float]]] = {}
    clock = [0.0] * stages
    at = [0] * stages
    spans: list[list[Span]] = [[] for _ in range(stages)]
    live, peak = [0] * stages, [0] * stages
    moved = True
    while moved:
        moved = False
        for p in range(stages):
            while at[p] < len(actions[p]):
                a = actions[p][at[p]]
                start = clock[p]
                if a.op.is_receive:
                    assert a.peer is not None
                    queue = queues.get((a.peer, p, a.op.channel))
                    if not queue:
                        break  # waits: another stage may send it later in this sweep
                    sent, arrival = queue.popleft()
                    if sent.micro_batch != a.micro_batch:
                        raise ScheduleError(
                            f"schedule: stage {p}'s {a} would receive micro-batch "
                            f"{sent.micro_batch}: stage {a.peer} sends its {a.op.channel} in the "
                            f"order {_sent_order(actions[a.peer], p, a.op.channel)}, stage {p} "
                            f"receives them in the order {_received_order(actions[p], a.peer, a.op.channel)}")
                    clock[p] = max(clock[p], arrival)
                elif a.op.is_send:
                    assert a.peer is not None
                    queues.setdefault((p, a.peer, a.op.channel), deque()).append(
                        (a, clock[p] + costs.message))
                else:
                    clock[p] += costs.of(a, p, a.micro_batch in separate[p])
                    releases = Op.WEIGHT if a.micro_batch in separate[p] else Op.BACKWARD
                    if training:
                        live[p] += 1 if a.op is Op.FORWARD else -1 if a.op is releases else 0
                    peak[p] = max(peak[p], live[p])
                spans[p].append(Span(a, start, clock[p]))
                at[p] += 1
                moved = True
    stuck = {p: actions[p][at[p]] for p in range(stages) if at[p] < len(actions[p])}
    if stuck:
        raise _deadlock(stuck)
    for (src, dst, channel), queue in sorted(queues.items()):
        if queue:
            unread = ", ".join(str(a) for a, _ in queue)
            raise ScheduleError(f"schedule: stage {src} sends {channel} that stage {dst} never "
                                f"receives ({unread}): they would wait at the step's end")
    return DryRun(tuple(tuple(s) for s in spans), tuple(peak))


def _sent_order(actions: Sequence[Action], to: int, channel: str) -> str:
    return " ".join(str(a.micro_batch) for a in actions
                    if a.op.is_send and a.peer == to and a.op.channel == channel)


def _received_order(actions: Sequence[Action], frm: int, channel: str) -> str:
    return " ".join(str(a.micro_batch) for a in actions
                    if a.op.is_receive and a.peer == frm and a.op.channel == channel)


def _deadlock(stuck: dict[int, Action]) -> Deadlock:
    """The error for stages stuck in receives: a circle of stages waiting on each other, or
    stages waiting for one that has run all its actions."""
    waits = "; ".join(f"stage {p} waits in {a} for stage {a.peer}" for p, a in sorted(stuck.items()))
    cycle: list[int] = []
    for start in sorted(stuck):
        path, p = [start], stuck[start].peer
        while p in stuck and p not in path:
            path.append(p)
            p = stuck[p].peer
        if p in path:
            cycle = path[path.index(p):]
            break
    if cycle:
        circle = " -> ".join(str(p) for p in [*cycle, cycle[0]])
        return Deadlock(f"schedule: deadlock, stages {circle} wait on each other ({waits})",
                        dict(stuck), cycle)
    done = sorted({a.peer for a in stuck.values() if a.peer is not None and a.peer not in stuck})
    return Deadlock(f"schedule: deadlock, {waits}; stage {', '.join(map(str, done))} has run all "
                    "its actions without sending it", dict(stuck), [])
