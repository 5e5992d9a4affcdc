"""Pipeline schedules as data: one list of actions per rank, built lazily, checked by one validator.

A schedule never runs code; it lists, for every rank, the order of its stages' forwards (``F``),
backwards (``B``) and optimizer steps (``S``); zero-bubble schedules split the backward into ``B``
(gradients of the stage's inputs, which the previous stage waits for) and ``W`` (gradients of its
weights, which nobody waits for, so it fills the bubbles). Microbatches are numbered globally across
minibatches (``unit = step * microbatches + j``), so an asynchronous schedule that never flushes is a
plain list too. A :data:`Layout` says which ranks run each stage: a stage's replicas, or several
stages on one rank (``interleaved``'s virtual stages, ``zbv``'s V).

Every schedule is one :class:`Schedule` in :data:`REGISTRY` (as torch.distributed.pipelining's
``get_schedule_class``): its per-rank builder, which yields a rank's actions one minibatch at a
time (a run of a million steps never holds them all), and what the runtime and the planner need to
know of it. Being data, a schedule is checked by :func:`validate` and dry-run by :func:`simulate`
without torch, and printed in the text form of ``torch.distributed.pipelining`` (``0F3 0B3``).

Example:
    >>> [format_actions(a) for a in build("gpipe", pipeline([1, 1]), microbatches=2)]
    ['0F0 0F1 0B0 0B1 0S0', '1F0 1F1 1B0 1B1 1S0']
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

__all__ = [
    "REGISTRY",
    "SCHEDULES",
    "Action",
    "Layout",
    "Schedule",
    "ScheduleError",
    "actions",
    "build",
    "format_actions",
    "get_schedule",
    "layout_of",
    "parse_actions",
    "pipeline",
    "round_of",
    "simulate",
    "stash_depth",
    "validate",
    "warmup",
]

_ACTION = re.compile(r"^(\d+)([FBWS])(\d+)$")

Layout = tuple[tuple[int, ...], ...]
"""The ranks of every stage, in pipeline order: ``((0, 1), (2,))`` is a stage on two replicas and
one on one; ``((0,), (1,), (0,), (1,))`` two ranks of two stages each (interleaved)."""


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order or deadlocks."""


@dataclass(frozen=True, order=True)
class Action:
    """One thing a stage does.

    Attributes:
        stage: the pipeline stage that does it.
        kind: ``F`` forward, ``B`` backward (of the inputs only, when the list also has a ``W`` of
            the unit), ``W`` the weight gradients of a split backward, ``S`` optimizer step (all
            replicas of the stage join it).
        index: the global microbatch (unit) for F/B/W; the step (minibatch) number for S.
    """

    stage: int
    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.index}"

    @staticmethod
    def parse(text: str) -> Action:
        """Read the text form ``0F3``."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(f"not an action: {text!r} (expected e.g. 0F3, 0B3, 0W3, 0S0)")
        return Action(int(match.group(1)), match.group(2), int(match.group(3)))


def format_actions(actions: Iterable[Action]) -> str:
    """Space-separated text form of an action list."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> tuple[Action, ...]:
    """Inverse of :func:`format_actions`."""
    return tuple(Action.parse(tok) for tok in text.split())


def pipeline(replicas: Sequence[int]) -> Layout:
    """Stages on consecutive ranks, ``replicas[k]`` of them for stage ``k``."""
    out, rank = [], 0
    for r in replicas:
        out.append(tuple(range(rank, rank + r)))
        rank += r
    return tuple(out)


def _world(layout: Layout) -> int:
    return len({r for ranks in layout for r in ranks})


def _hosted(layout: Layout, rank: int) -> list[tuple[int, int]]:
    """(stage, replica index) of every stage ``rank`` runs."""
    return [(k, ranks.index(rank)) for k, ranks in enumerate(layout) if rank in ranks]


# ----------------------------------------------------------------------------- orders


def _one_f_one_b(stage: int, units: Iterable[int], warm: int) -> Iterator[Action]:
    """1F1B order over ``units``: ``warm`` warm-up forwards, then F/B pairs, then backwards
    (streamed: it holds only the units in flight)."""
    pending: deque[int] = deque()
    it = iter(units)
    for u in islice(it, warm):
        yield Action(stage, "F", u)
        pending.append(u)
    for u in it:
        yield Action(stage, "F", u)
        pending.append(u)
        yield Action(stage, "B", pending.popleft())
    while pending:
        yield Action(stage, "B", pending.popleft())


def _gpipe(stage: int, stages: int, units: Sequence[int]) -> Iterator[Action]:
    """All forwards, then all backwards."""
    yield from (Action(stage, "F", u) for u in units)
    yield from (Action(stage, "B", u) for u in units)


def _1f1b(stage: int, stages: int, units: Sequence[int]) -> Iterator[Action]:
    """1F1B with ``stages - stage - 1`` warm-up forwards: a stage holds at most that many + 1."""
    return _one_f_one_b(stage, units, stages - stage - 1)


def _zero_bubble(stage: int, stages: int, units: Sequence[int]) -> Iterator[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) over ``units``.

    The forwards and input backwards (B) come in 1F1B's order, with 1F1B's warm-up of
    ``stages - stage - 1`` forwards, so a stage holds no more forwards before their B than under
    1F1B. Each B is followed by the weight backward (W) of the unit ``stage`` Bs earlier: the later
    stages, which idle longest at the end of a 1F1B minibatch, keep the most Ws in hand and run them
    while the last input gradients travel to stage 0. With equal F, B and W times and at least as
    many microbatches as stages, the bubble is ``(stages - 1)`` slots of one pass against 1F1B's
    ``3 (stages - 1)`` (B+W fused), a third. The price: stage ``i`` holds the graphs of ``i`` units
    more (B done, W not), so every stage holds up to ``stages`` units, 1F1B's stage 0 peak.
    """
    warm = min(stages - stage - 1, len(units))
    out = [Action(stage, "F", u) for u in units[:warm]]
    pending: list[int] = []
    for i, u in enumerate(units):
        if warm + i < len(units):
            out.append(Action(stage, "F", units[warm + i]))
        out.append(Action(stage, "B", u))
        pending.append(u)
        if len(pending) > stage:
            out.append(Action(stage, "W", pending.pop(0)))
    return iter(out + [Action(stage, "W", u) for u in pending])


def warmup(replicas: Sequence[int], stage: int) -> int:
    """PipeDream's warm-up minibatches of a replica of ``stage``: (ranks from this stage to the end,
    less one) // this stage's replicas. A replica keeps ``warmup + 1`` minibatches (and weight
    versions) in flight: the planner's pipedream model prices exactly this."""
    return (sum(replicas[stage:]) - 1) // replicas[stage]


def round_of(step: int, first_step: int, replicas: int) -> int:
    """The pipedream round a minibatch belongs to, named by the round's first minibatch: ``S n``
    steps a stage of ``replicas`` replicas over minibatches ``n .. n + replicas - 1``."""
    return first_step + (step - first_step) // replicas * replicas


def stash_depth(actions: Iterable[Action]) -> int:
    """The most weight versions one rank holds at once: distinct versions (steps taken before the
    forward) among the units it has forwarded and not yet backwarded."""
    version, held, peak = 0, dict[int, int](), 0
    for a in actions:
        if a.kind == "S":
            version += 1
        elif a.kind == "F":
            held[a.index] = version
            peak = max(peak, len(set(held.values())))
        elif a.kind == "B":
            held.pop(a.index, None)
    return peak


# ----------------------------------------------------------------------------- builders
# One per schedule: (layout, rank, microbatches, steps) -> that rank's actions, one minibatch at a time.


def _pipedream(layout: Layout, rank: int, m: int, steps: range) -> Iterator[Action]:
    """PipeDream's: whole minibatches go round-robin to a stage's replicas (minibatch ``steps[i]`` to
    replica ``i % r``); each replica runs 1F1B over its own minibatches with :func:`warmup`
    minibatches ahead and steps after each backward that ends one of its minibatches; ``S t`` is the
    stage's round of minibatches ``t .. t + r - 1`` (:func:`round_of`; their forwards all saw the same
    weight version), joined by every replica, also for a last round without a minibatch of its own."""
    ((stage, replica),) = _hosted(layout, rank)
    replicas = [len(ranks) for ranks in layout]
    r = replicas[stage]
    own = steps[replica::r]
    units = (s * m + j for s in own for j in range(m))
    for action in _one_f_one_b(stage, units, warmup(replicas, stage) * m):
        yield action
        if action.kind == "B" and (action.index + 1) % m == 0:
            yield Action(stage, "S", round_of(action.index // m, steps[0], r))
    yield from (Action(stage, "S", s) for s in steps[len(own) * r :: r])


def _flushed(order: Callable[[int, int, Sequence[int]], Iterator[Action]]) -> Callable[..., Iterator[Action]]:
    """A synchronous schedule's builder from its per-stage ``order`` of one minibatch: every minibatch
    flushed and stepped; a stage's replicas take its microbatches round-robin and all join the step."""

    def build(layout: Layout, rank: int, m: int, steps: range) -> Iterator[Action]:
        ((stage, replica),) = _hosted(layout, rank)
        r = len(layout[stage])
        for s in steps:
            units = [s * m + j for j in range(m)]
            yield from (a for a in order(stage, len(layout), units) if (a.index % m) % r == replica)
            yield Action(stage, "S", s)

    return build


def _interleaved_pass(rank: int, ranks: int, virtual: int, k: int, backward: bool) -> tuple[int, int]:
    """(stage, microbatch within the minibatch) of a rank's ``k``-th forward (or backward): groups
    of ``ranks`` microbatches go through chunk 0, then chunk 1, ... (backwards from the last chunk)."""
    group, within = divmod(k, ranks * virtual)
    chunk = within // ranks
    chunk = virtual - 1 - chunk if backward else chunk
    return chunk * ranks + rank, group * ranks + within % ranks


def _interleaved_step(
    rank: int, ranks: int, virtual: int, m: int, step: int, own: Sequence[int]
) -> Iterator[Action]:
    """One minibatch of Megatron's interleaved 1F1B on the rank at place ``rank`` of its copy's
    pipeline, over the copy's microbatches ``own`` (of ``m``), then a step of each chunk.

    Warm-up: ``(virtual - 1) * ranks`` forwards for the chunks before the last, and two per rank
    downstream (Megatron's count: one for the activation on its way down, one for the gradient on
    its way back), at most all of them; then one forward and one backward in turn; then the
    remaining backwards. One chunk per rank is 1F1B."""
    if virtual == 1:
        yield from _one_f_one_b(rank, (step * m + j for j in own), ranks - rank - 1)
        yield Action(rank, "S", step)
        return
    total = len(own) * virtual
    warm = min((virtual - 1) * ranks + 2 * (ranks - rank - 1), total)

    def act(kind: str, k: int) -> Action:
        stage, j = _interleaved_pass(rank, ranks, virtual, k, kind == "B")
        return Action(stage, kind, step * m + own[j])

    yield from (act("F", k) for k in range(warm))
    for k in range(total - warm):
        yield act("F", warm + k)
        yield act("B", k)
    yield from (act("B", k) for k in range(total - warm, total))
    yield from (Action(c * ranks + rank, "S", step) for c in range(virtual))


def _copy_place(layout: Layout, rank: int, m: int) -> tuple[list[int], list[int]]:
    """A laid-out schedule's rank: the stages it hosts (in order) and the microbatches of its copy.
    Every stage has the same copies (``d``) and the rank is the same copy ``i`` of each, so copy ``i``
    is a pipeline of its own, laid out as without copies, running microbatches ``j`` with
    ``j mod d == i`` (``Schedule.replica_of``); one copy (``d = 1``) runs them all."""
    hosted = _hosted(layout, rank)
    copy, copies = hosted[0][1], len(layout[hosted[0][0]])
    return [k for k, _ in hosted], [j for j in range(m) if j % copies == copy]


def _interleaved(layout: Layout, rank: int, m: int, steps: range) -> Iterator[Action]:
    """Megatron's virtual stages: the rank at place ``r`` of a pipeline of ``ranks`` hosts stages
    ``r, r + ranks, ...`` and plays their forwards and backwards in one list, flushed every
    minibatch (each copy of the stages its own such pipeline: :func:`_copy_place`). With equal
    stages of unit F and B it takes ``2 * (virtual * microbatches + ranks - 1)`` slots per
    minibatch: a bubble of ``(ranks - 1) / (virtual * microbatches)`` against 1F1B's
    ``(ranks - 1) / microbatches``."""
    stages, own = _copy_place(layout, rank, m)
    virtual = len(stages)
    ranks = len(layout) // virtual
    for s in steps:
        yield from _interleaved_step(stages[0], ranks, virtual, m, s, own)


def _zbv_phases(rank: int, ranks: int, n: int) -> list[tuple[int, str]]:
    """(chunk, kind) of every action of ``rank`` for ``n >= 2 ranks - 1`` microbatches, in order:
    warm-up down (``2(p - r) - 1`` chunk-0 forwards), across (``r`` pairs chunk 1 F, chunk 0 F),
    back (``p - r`` triples chunk 1 F, B, W); ``n - p`` steady rounds (chunk 0 F while any is left,
    B, W; chunk 1 F, B, W); cool-down (``r`` pairs chunk 0 B, chunk 1 B, ``p - r`` pairs chunk 0 B,
    W), then every W still owed, chunk 1's first."""
    p, r = ranks, rank
    order = (
        [(0, "F")] * (2 * (p - r) - 1) + [(1, "F"), (0, "F")] * r + [(1, "F"), (1, "B"), (1, "W")] * (p - r)
    )
    down_left = n - (2 * p - r - 1)  # chunk-0 forwards the steady rounds still owe
    for k in range(n - p):
        order += ([(0, "F")] if k < down_left else []) + [(0, "B"), (0, "W"), (1, "F"), (1, "B"), (1, "W")]
    order += [(0, "B"), (1, "B")] * r + [(0, "B"), (0, "W")] * (p - r)
    done_w = {c: sum(1 for cc, kind in order if (cc, kind) == (c, "W")) for c in (0, 1)}
    return order + [(1, "W")] * (n - done_w[1]) + [(0, "W")] * (n - done_w[0])


def _zbv(layout: Layout, rank: int, m: int, steps: range) -> Iterator[Action]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): ``p`` ranks play
    ``2p`` stages laid out as a V, rank ``r`` hosting stage ``r`` (chunk 0, on the way down) and
    ``2p - 1 - r`` (chunk 1, back up); the turn of the V is a hand-off inside rank ``p - 1``. Every
    backward is split into B and W, the Ws filling what would be bubbles, and each rank holds about
    1F1B's first stage's activations. The order (:func:`_zbv_phases`) is built for at least
    ``2p - 1`` microbatches; with fewer the missing units' actions are left out. A step of each chunk
    ends the minibatch (chunk 0's first). With unit-time F, B and W, a minibatch takes
    ``max(6m + p - 1, 4m + 4p - 2)`` slots: ``p - 1`` of bubble per rank once ``m >= 2p - 1``.
    Copies of the stages are V pipelines of their own over their microbatches (:func:`_copy_place`)."""
    stages, own = _copy_place(layout, rank, m)
    ranks = len(layout) // 2
    for step in steps:
        seen: dict[tuple[int, str], int] = {}
        for chunk, kind in _zbv_phases(stages[0], ranks, max(len(own), 2 * ranks - 1)):
            j = seen.get((chunk, kind), 0)
            seen[(chunk, kind)] = j + 1
            if j < len(own):
                yield Action(stages[chunk], kind, step * m + own[j])
        yield from (Action(s, "S", step) for s in stages)


# ----------------------------------------------------------------------------- layouts


def _cycle(ranks: int, virtual: int) -> Layout:
    """Megatron's layout: chunk ``c`` of rank ``r`` is stage ``c * ranks + r``."""
    return tuple((s % ranks,) for s in range(ranks * virtual))


def _v(ranks: int, virtual: int) -> Layout:
    """zbv's V: stages ``r`` and ``2 ranks - 1 - r`` on rank ``r`` (``virtual`` is always 2)."""
    return tuple((s if s < ranks else 2 * ranks - 1 - s,) for s in range(2 * ranks))


def _check_nothing(ranks: int, virtual: int, microbatches: int) -> None:
    if ranks < 1 or microbatches < 1:
        raise ScheduleError(f"need ranks >= 1 and microbatches >= 1, got {ranks}, {microbatches}")


def _check_interleaved(ranks: int, virtual: int, microbatches: int) -> None:
    """Megatron's forwards go round in groups of ``ranks`` microbatches per chunk, so with more than
    one chunk per rank the microbatches must be a multiple of the ranks."""
    if ranks < 1 or virtual < 1 or microbatches < 1:
        raise ScheduleError(
            "interleaved needs ranks, virtual stages and microbatches >= 1, "
            f"got {ranks}, {virtual}, {microbatches}"
        )
    if virtual > 1 and ranks < 2:
        raise ScheduleError(
            "--schedule interleaved with several stages per GPU needs at least 2 GPUs (at least 2 ranks "
            "to pass each microbatch between)"
        )
    if virtual > 1 and microbatches % ranks:
        raise ScheduleError(
            f"interleaved with {virtual} virtual stages needs microbatches a multiple of the {ranks} ranks "
            f"(Megatron's order), got {microbatches}; use --microbatches {ranks * -(-microbatches // ranks)}"
        )


def _check_zbv(ranks: int, virtual: int, microbatches: int) -> None:
    if ranks < 1 or microbatches < 1:
        raise ScheduleError(f"zbv needs ranks >= 1 and microbatches >= 1, got {ranks}, {microbatches}")


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Schedule:
    """One schedule: how a rank's actions are built, and what it asks of the runtime.

    Attributes:
        name: what plan.json and ``--schedule`` call it.
        rank_actions: (layout, rank, microbatches, steps) -> the rank's actions, lazily.
        flushes: every minibatch drains the pipeline and steps once (exact gradients); without it
            (pipedream) replicas run whole minibatches and a weight version per forward is stashed.
        split_backward: every backward is a B and a W (zero bubble).
        placement: (ranks, virtual stages) -> the layout of a schedule that lays several stages on
            each rank, one device each; None: stages on ranks of their own, replicas allowed.
        check: (ranks, virtual stages, microbatches) -> refuses what its order cannot play.
    """

    name: str
    rank_actions: Callable[[Layout, int, int, range], Iterator[Action]]
    flushes: bool = True
    split_backward: bool = False
    placement: Callable[[int, int], Layout] | None = None
    check: Callable[[int, int, int], None] = _check_nothing

    @property
    def stashes(self) -> bool:
        """A weight version kept per forward in flight (pipedream's weight stashing)."""
        return not self.flushes

    def replica_of(self, unit: int, microbatches: int, replicas: int, first_step: int = 0) -> int:
        """Which replica of a stage runs ``unit``: pipedream hands whole minibatches round-robin from
        the segment's first step; the flushed schedules hand out each minibatch's microbatches."""
        if self.flushes:
            return (unit % microbatches) % replicas
        return (unit // microbatches - first_step) % replicas


REGISTRY: dict[str, Schedule] = {
    "pipedream": Schedule("pipedream", _pipedream, flushes=False),
    "1f1b": Schedule("1f1b", _flushed(_1f1b)),
    "gpipe": Schedule("gpipe", _flushed(_gpipe)),
    "zb1p": Schedule("zb1p", _flushed(_zero_bubble), split_backward=True),
    "interleaved": Schedule("interleaved", _interleaved, placement=_cycle, check=_check_interleaved),
    "zbv": Schedule("zbv", _zbv, split_backward=True, placement=_v, check=_check_zbv),
}
SCHEDULES: tuple[str, ...] = tuple(REGISTRY)


def get_schedule(name: str) -> Schedule:
    """The registry's entry for ``name``.

    Raises:
        ScheduleError: an unknown name (the message lists the known ones).
    """
    if name not in REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return REGISTRY[name]


def layout_of(name: str, ranks: int, virtual: int = 1) -> Layout:
    """The layout of ``ranks`` ranks without replicas: the schedule's placement of ``virtual``
    stages per rank, or one stage per rank."""
    placed = get_schedule(name).placement
    return placed(ranks, virtual) if placed is not None else pipeline([1] * ranks)


def actions(name: str, layout: Layout, rank: int, microbatches: int, steps: range) -> Iterator[Action]:
    """``rank``'s actions for minibatches ``steps``, built one minibatch at a time as they are read."""
    if microbatches < 1 or not any(rank in ranks for ranks in layout):
        raise ScheduleError(f"rank {rank} has no stage in {[list(r) for r in layout]}, or microbatches < 1")
    return get_schedule(name).rank_actions(layout, rank, microbatches, steps)


def build(
    name: str, layout: Layout, microbatches: int, steps: int = 1, first_step: int = 0
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's whole list for ``steps`` minibatches from ``first_step``."""
    ids = range(first_step, first_step + steps)
    return tuple(tuple(actions(name, layout, r, microbatches, ids)) for r in range(_world(layout)))


# ----------------------------------------------------------------------------- checks


def _check_stage(
    k: int, ranks: Sequence[Sequence[Action]], units: set[int], covering: dict[int, int]
) -> None:
    """Every unit forwarded and backwarded once, on one replica, backward after forward and before
    the step that covers it; every replica joins the same steps. A split backward: every unit's W
    (or none at all) on the B's replica, after its B and before that step."""
    where: dict[tuple[str, int], tuple[int, int]] = {}
    for i, acts in enumerate(ranks):
        for pos, a in enumerate(acts):
            key = (a.kind, a.index) if a.kind != "S" else ("S", a.index * len(ranks) + i)
            if key in where:
                raise ScheduleError(f"stage {k} lists {a} twice")
            where[key] = (i, pos)
    split = any(kd == "W" for kd, _ in where)
    for kind in ("F", "B", "W") if split else ("F", "B"):
        have = {u for (kd, u) in where if kd == kind}
        if have != units:
            raise ScheduleError(f"stage {k}: {kind} actions cover {sorted(have)}, expected {sorted(units)}")
    want = sorted(set(covering.values()))
    for i, acts in enumerate(ranks):
        if sorted(a.index for a in acts if a.kind == "S") != want:
            raise ScheduleError(f"stage {k} replica {i} steps {[str(a) for a in acts if a.kind == 'S']}")
    for u in units:
        (i, f), (j, b) = where[("F", u)], where[("B", u)]
        if i != j or b < f:
            raise ScheduleError(f"stage {k} runs {k}B{u} before {k}F{u} or on another replica")
        last = b
        if split:
            w, last = where[("W", u)]
            if w != i or last < b:
                raise ScheduleError(f"stage {k} runs {k}W{u} before {k}B{u} or on another replica")
        if where[("S", covering[u] * len(ranks) + i)][1] < last:
            raise ScheduleError(f"stage {k} steps {k}S{covering[u]} before {k}{'W' if split else 'B'}{u}")


def validate(
    lists: Sequence[Sequence[Action]],
    microbatches: int,
    steps: Sequence[int],
    layout: Layout | None = None,
    name: str = "1f1b",
) -> None:
    """Check every rank's list (``lists[rank]``): each lists only the stages ``layout`` gives it (by
    default stage ``k`` alone on rank ``k``); each stage, over its replicas, covers every unit once,
    in order, before the step that covers it (a flush per minibatch, or under ``name``'s rounds of
    whole minibatches); and the ranks together do not deadlock (:func:`simulate`).

    Raises:
        ScheduleError: naming the first rank, stage or action that is wrong.
    """
    layout = layout if layout is not None else pipeline([1] * len(lists))
    stages = max([len(layout) - 1, *(a.stage for acts in lists for a in acts)]) + 1
    if stages > len(layout) or _world(layout) != len(lists):
        raise ScheduleError(f"{len(lists)} lists of {stages} stages do not match the layout {layout}")
    for r, acts in enumerate(lists):
        wrong = [a for a in acts if r not in layout[a.stage]]
        if wrong:
            raise ScheduleError(f"rank {r} lists {wrong[0]}, an action of rank {layout[wrong[0].stage][0]}")
    units = {s * microbatches + j for s in steps for j in range(microbatches)}
    flushes, first = get_schedule(name).flushes, min(steps, default=0)
    for k, ranks in enumerate(layout):
        r = 1 if flushes else len(ranks)
        covering = {u: round_of(u // microbatches, first, r) for u in units}
        own = [tuple(a for a in lists[rank] if a.stage == k) for rank in ranks]
        _check_stage(k, own, units, covering)
    simulate(lists, layout)


def _join_steps(lists: Sequence[Sequence[Action]], layout: Layout, pos: list[int]) -> bool:
    """Advance past every step that all ranks of its stage have reached (a collective); whether any."""
    moved = False
    for r, acts in enumerate(lists):
        if pos[r] < len(acts) and acts[pos[r]].kind == "S":
            a = acts[pos[r]]
            peers = layout[a.stage]
            heads = [lists[q][pos[q]] if pos[q] < len(lists[q]) else None for q in peers]
            if all(h is not None and h.kind == "S" and h.stage == a.stage for h in heads):
                if len({h.index for h in heads if h is not None}) > 1:
                    raise ScheduleError(f"stage {a.stage}: replicas join different steps "
                                        f"{sorted({h.index for h in heads if h is not None})}")  # fmt: skip
                for q in peers:
                    pos[q] += 1
                moved = True
    return moved


def simulate(lists: Sequence[Sequence[Action]], layout: Layout | None = None) -> int:
    """Dry-run every rank with unit-time forwards, backwards and weight backwards and free steps;
    returns the slots.

    A forward needs the previous stage's forward of the same unit (on whichever rank ran it) from an
    earlier slot, a backward the next stage's backward (or, on the last stage, its own forward), a W
    only its own B (earlier in its list); a step waits until every rank of its stage reaches it. With
    equal stage times and no replicas, GPipe and 1F1B take ``2 * (microbatches + stages - 1)`` slots
    per minibatch, and zb1p (three unit passes per unit) ``3 microbatches + stages - 1`` once there
    are as many microbatches as stages.

    Raises:
        ScheduleError: if the ranks deadlock.
    """
    layout = layout if layout is not None else pipeline([1] * len(lists))
    last = len(layout) - 1
    done: set[tuple[int, str, int]] = set()
    pos, slot = [0] * len(lists), 0
    while any(p < len(acts) for p, acts in zip(pos, lists, strict=True)):
        joined = False
        while _join_steps(lists, layout, pos):
            joined = True
        finished = []
        for r, acts in enumerate(lists):
            if pos[r] == len(acts) or acts[pos[r]].kind == "S":
                continue
            a = acts[pos[r]]
            need = (a.stage - 1, "F", a.index) if a.kind == "F" else (a.stage + 1, "B", a.index)
            local = (a.kind == "F" and a.stage == 0) or (a.kind == "B" and a.stage == last) or a.kind == "W"
            if local or need in done:
                finished.append((a.stage, a.kind, a.index))
                pos[r] += 1
        left = any(p < len(acts) for p, acts in zip(pos, lists, strict=True))
        if not finished and not joined and left:
            stuck = [str(acts[p]) for p, acts in zip(pos, lists, strict=True) if p < len(acts)]
            raise ScheduleError(f"schedule deadlocks at slot {slot}: waiting on {' '.join(stuck)}")
        done.update(finished)
        slot += 1 if finished else 0
    return slot
