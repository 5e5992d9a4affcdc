"""Pipeline schedules as data: per-stage action lists that one generic executor plays back.

A schedule never runs code; it lists, for every stage, the order of its forwards (``F``), backwards
(``B``) and optimizer steps (``S``); zero-bubble schedules split the backward into ``B`` (gradients
of the stage's inputs, which the previous stage waits for) and ``W`` (gradients of its weights,
which nobody waits for, so it fills the bubbles). Microbatches are numbered globally across minibatches
(``unit = step * microbatches + j``), so an asynchronous schedule that never flushes is a plain list
too. Being data, a schedule is checked by :func:`validate` and dry-run by :func:`simulate` without
torch, and printed in the text form of ``torch.distributed.pipelining`` (``0F3 0B3``).
``interleaved`` (Megatron's virtual stages) is listed per rank rather than per stage, since a rank
hosts several stages: :func:`build_interleaved`, :func:`validate_ranks`, :func:`simulate_ranks`;
so is ``zbv`` (:mod:`runtime.schedule_zbv`, two stages per rank laid out as a V).

Example:
    >>> [format_actions(a) for a in build("gpipe", stages=2, microbatches=2)]
    ['0F0 0F1 0B0 0B1 0S0', '1F0 1F1 1B0 1B1 1S0']
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "ScheduleError",
    "build",
    "build_interleaved",
    "build_job",
    "check_interleaved",
    "format_actions",
    "interleaved_rank",
    "interleaved_stage",
    "parse_actions",
    "rank_actions",
    "replica_of",
    "round_of",
    "simulate",
    "simulate_job",
    "simulate_ranks",
    "stash_depth",
    "validate",
    "validate_job",
    "validate_ranks",
    "warmup",
]

SCHEDULES: tuple[str, ...] = ("pipedream", "1f1b", "gpipe", "zb1p", "interleaved", "zbv")
_ACTION = re.compile(r"^(\d+)([FBWS])(\d+)$")


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


def _one_f_one_b(stage: int, units: Sequence[int], warm: int) -> list[Action]:
    """1F1B order over ``units``: ``warm`` warm-up forwards, then F/B pairs, then backwards."""
    warm = min(warm, len(units))
    out = [Action(stage, "F", u) for u in units[:warm]]
    for i in range(len(units) - warm):
        out += [Action(stage, "F", units[warm + i]), Action(stage, "B", units[i])]
    out += [Action(stage, "B", u) for u in units[len(units) - warm :]]
    return out


def _zero_bubble(stage: int, stages: int, units: Sequence[int]) -> list[Action]:
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
    return out + [Action(stage, "W", u) for u in pending]


def warmup(replicas: Sequence[int], stage: int) -> int:
    """PipeDream's warm-up minibatches of a replica of ``stage``: (ranks from this stage to the end,
    less one) // this stage's replicas. A replica keeps ``warmup + 1`` minibatches (and weight
    versions) in flight: ``partitioner.optimizer.cost.in_flight`` prices exactly this."""
    return (sum(replicas[stage:]) - 1) // replicas[stage]


def _pipedream(
    stage: int, replicas: Sequence[int], replica: int, m: int, steps: Sequence[int]
) -> list[Action]:
    """One replica's pipedream list: its own minibatches (every ``r``-th of the segment, PipeDream's
    round-robin) in 1F1B order over whole minibatches, and a step per round of ``r`` minibatches
    after its backward of that round, so replicas all-reduce gradients of one weight version."""
    r = replicas[stage]
    own = list(steps[replica::r])
    units = [s * m + j for s in own for j in range(m)]
    out: list[Action] = []
    for action in _one_f_one_b(stage, units, warmup(replicas, stage) * m):
        out.append(action)
        if action.kind == "B" and (action.index + 1) % m == 0:
            out.append(Action(stage, "S", round_of(action.index // m, steps[0], r)))
    # A last round without a minibatch for this replica: it still joins the round's all-reduce.
    return out + [Action(stage, "S", s) for s in steps[len(own) * r :: r]]


def round_of(step: int, first_step: int, replicas: int) -> int:
    """The pipedream round a minibatch belongs to, named by the round's first minibatch: ``S n``
    steps a stage of ``replicas`` replicas over minibatches ``n .. n + replicas - 1``."""
    return first_step + (step - first_step) // replicas * replicas


def _synchronous(name: str, stage: int, stages: int, m: int, steps: Sequence[int]) -> list[Action]:
    out: list[Action] = []
    for s in steps:
        units = [s * m + j for j in range(m)]
        if name == "1f1b":
            out += _one_f_one_b(stage, units, stages - stage - 1)
        elif name == "zb1p":
            out += _zero_bubble(stage, stages, units)
        else:
            out += [Action(stage, "F", u) for u in units] + [Action(stage, "B", u) for u in units]
        out.append(Action(stage, "S", s))
    return out


def build_job(
    name: str, replicas: Sequence[int], microbatches: int, steps: int = 1, first_step: int = 0
) -> tuple[tuple[tuple[Action, ...], ...], ...]:
    """Every rank's action list, as ``job[stage][replica]``, for ``steps`` minibatches from
    ``first_step``.

    ``pipedream`` is PipeDream's: whole minibatches go round-robin to a stage's replicas (minibatch
    ``first_step + i`` to replica ``i % r``), each replica runs 1F1B over its own minibatches with
    :func:`warmup` minibatches ahead and steps after each of its backwards; ``S t`` is the stage's
    round of minibatches ``t .. t + r - 1`` (see :func:`round_of`; their forwards all saw the same
    weight version), joined by every replica. ``1f1b`` and ``gpipe`` flush every minibatch and
    hand its microbatches round-robin to the replicas; ``S s`` is minibatch ``s``'s step. ``zb1p`` is
    1f1b with each backward split into B and W (see :func:`_zero_bubble`), flushed the same way.
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name in ("interleaved", "zbv"):
        raise ScheduleError(f"{name} is listed per rank, not per stage: use build_{name}")
    if not replicas or min(replicas) < 1 or microbatches < 1 or steps < 0:
        raise ScheduleError(f"need replicas >= 1 and microbatches >= 1, got {list(replicas)}, {microbatches}")
    ids = range(first_step, first_step + steps)
    if name == "pipedream":
        return tuple(
            tuple(tuple(_pipedream(k, replicas, i, microbatches, ids)) for i in range(r))
            for k, r in enumerate(replicas)
        )
    job = []
    for k, r in enumerate(replicas):
        whole = _synchronous(name, k, len(replicas), microbatches, ids)
        job.append(tuple(rank_actions(whole, i, r, microbatches) for i in range(r)))
    return tuple(job)


def build(
    name: str, stages: int, microbatches: int, steps: int = 1, first_step: int = 0
) -> tuple[tuple[Action, ...], ...]:
    """Per-stage action lists of schedule ``name`` for a pipeline without replicas (see :func:`build_job`).

    ``pipedream`` pipelines across minibatches without a flush and steps each stage's optimizer after
    the backward of a minibatch's last microbatch (weights are stashed by the executor); ``1f1b`` and
    ``gpipe`` flush every minibatch, so their gradients are exact; so does ``zb1p`` (zero bubble H1).
    """
    job = build_job(name, [1] * stages, microbatches, steps, first_step)
    return tuple(ranks[0] for ranks in job)


def replica_of(name: str, unit: int, microbatches: int, replicas: int, first_step: int = 0) -> int:
    """Which replica of a stage runs ``unit``: pipedream hands whole minibatches round-robin from the
    segment's first step; the synchronous schedules hand out the microbatches of each minibatch."""
    if name == "pipedream":
        return (unit // microbatches - first_step) % replicas
    return (unit % microbatches) % replicas


def rank_actions(
    actions: Sequence[Action], replica: int, replicas: int, microbatches: int
) -> tuple[Action, ...]:
    """The actions one replica of a synchronous stage plays: its own F/B units and every step."""
    return tuple(
        a for a in actions if a.kind == "S" or replica_of("1f1b", a.index, microbatches, replicas) == replica
    )


def stash_depth(actions: Sequence[Action]) -> int:
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


def validate(schedule: Sequence[Sequence[Action]], microbatches: int, steps: Sequence[int]) -> None:
    """:func:`validate_job` for per-stage lists without replicas (as :func:`build` makes)."""
    validate_job(tuple((actions,) for actions in schedule), "1f1b", microbatches, steps)


def _check_stage(
    k: int, ranks: Sequence[Sequence[Action]], units: set[int], covering: dict[int, int]
) -> None:
    """Every unit forwarded and backwarded once, on one replica, backward after forward and before
    the step that covers it; every replica joins the same steps. A split backward: every unit's W
    (or none at all) on the B's replica, after its B and before that step."""
    where: dict[tuple[str, int], tuple[int, int]] = {}
    for i, actions in enumerate(ranks):
        for pos, a in enumerate(actions):
            if a.stage != k:
                raise ScheduleError(f"stage {k} lists {a}, an action of stage {a.stage}")
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
    for i, actions in enumerate(ranks):
        if sorted(a.index for a in actions if a.kind == "S") != want:
            raise ScheduleError(f"stage {k} replica {i} steps {[str(a) for a in actions if a.kind == 'S']}")
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


def validate_job(
    job: Sequence[Sequence[Sequence[Action]]], name: str, microbatches: int, steps: Sequence[int]
) -> None:
    """Check completeness, local order and deadlock-freedom of every rank's list (``job[stage][replica]``).

    Raises:
        ScheduleError: naming the first stage and action that is wrong.
    """
    units = {s * microbatches + j for s in steps for j in range(microbatches)}
    for k, ranks in enumerate(job):
        r = len(ranks) if name == "pipedream" else 1
        first = min(steps, default=0)
        _check_stage(k, ranks, units, {u: round_of(u // microbatches, first, r) for u in units})
    simulate_job(job)


def simulate(schedule: Sequence[Sequence[Action]]) -> int:
    """:func:`simulate_job` for per-stage lists without replicas."""
    return simulate_job(tuple((actions,) for actions in schedule))


def _join_steps(job: Sequence[Sequence[Sequence[Action]]], pos: list[list[int]]) -> None:
    """Advance past every step that all replicas of its stage have reached (a collective)."""
    for k, ranks in enumerate(job):
        while all(p < len(acts) and acts[p].kind == "S" for p, acts in zip(pos[k], ranks, strict=True)):
            heads = {acts[p].index for p, acts in zip(pos[k], ranks, strict=True)}
            if len(heads) > 1:
                raise ScheduleError(f"stage {k}: replicas join different steps {sorted(heads)}")
            pos[k] = [p + 1 for p in pos[k]]


def simulate_job(job: Sequence[Sequence[Sequence[Action]]]) -> int:
    """Dry-run every rank with unit-time forwards, backwards and weight backwards and free steps;
    returns the slots.

    A forward needs the previous stage's forward of the same unit (on whichever replica ran it) from
    an earlier slot, a backward the next stage's backward (or, on the last stage, its own forward), a
    W only its own B (earlier in its list); a step waits until every replica of its stage reaches
    it. With equal stage times and no replicas,
    GPipe and 1F1B take ``2 * (microbatches + stages - 1)`` slots per minibatch, and zb1p (three
    unit passes per unit) ``2 * (microbatches + stages - 1) + 1 + max(microbatches - stages, 0)``:
    ``3 microbatches + stages - 1`` once there are as many microbatches as stages.

    Raises:
        ScheduleError: if the ranks deadlock.
    """
    last = len(job) - 1
    done: set[tuple[int, str, int]] = set()
    pos = [[0] * len(ranks) for ranks in job]
    slot = 0
    left = sum(len(acts) for ranks in job for acts in ranks)
    while left:
        _join_steps(job, pos)
        finished: list[tuple[int, str, int]] = []
        for k, ranks in enumerate(job):
            for i, acts in enumerate(ranks):
                if pos[k][i] == len(acts) or acts[pos[k][i]].kind == "S":
                    continue
                a = acts[pos[k][i]]
                need = (k - 1, "F", a.index) if a.kind == "F" else (k + 1, "B", a.index)
                local = (a.kind == "F" and k == 0) or (a.kind == "B" and k == last) or a.kind == "W"
                if local or need in done:
                    finished.append((k, a.kind, a.index))
                    pos[k][i] += 1
        left_now = sum(len(acts) - p for ranks, ps in zip(job, pos, strict=True)
                       for acts, p in zip(ranks, ps, strict=True))  # fmt: skip
        if not finished and left_now == left:
            stuck = [str(acts[p]) for ranks, ps in zip(job, pos, strict=True)
                     for acts, p in zip(ranks, ps, strict=True) if p < len(acts)]  # fmt: skip
            raise ScheduleError(f"schedule deadlocks at slot {slot}: waiting on {' '.join(stuck)}")
        done.update(finished)
        slot += 1 if finished else 0
        left = left_now
    return slot


def interleaved_stage(rank: int, chunk: int, ranks: int) -> int:
    """The pipeline stage of ``chunk`` on ``rank`` under ``interleaved``: Megatron's layout, where
    chunk ``c`` of rank ``r`` is stage ``c * ranks + r``, so a unit leaves every rank ``virtual`` times."""
    return chunk * ranks + rank


def check_interleaved(ranks: int, virtual: int, microbatches: int) -> None:
    """Refuse what Megatron's interleaved order cannot play: its forwards go round in groups of
    ``ranks`` microbatches per chunk, so with more than one chunk per rank the microbatches must be a
    multiple of the ranks (one chunk per rank is plain 1F1B, any count)."""
    if ranks < 1 or virtual < 1 or microbatches < 1:
        raise ScheduleError(
            "interleaved needs ranks, virtual stages and microbatches >= 1, "
            f"got {ranks}, {virtual}, {microbatches}"
        )
    if virtual > 1 and microbatches % ranks:
        raise ScheduleError(
            f"interleaved with {virtual} virtual stages needs microbatches a multiple of the {ranks} ranks "
            f"(Megatron's order), got {microbatches}; use --microbatches {ranks * -(-microbatches // ranks)}"
        )


def _interleaved_pass(rank: int, ranks: int, virtual: int, k: int, backward: bool) -> tuple[int, int]:
    """(stage, microbatch within the minibatch) of a rank's ``k``-th forward (or backward): groups
    of ``ranks`` microbatches go through chunk 0, then chunk 1, ... (backwards from the last chunk)."""
    group, within = divmod(k, ranks * virtual)
    chunk = within // ranks
    chunk = virtual - 1 - chunk if backward else chunk
    return interleaved_stage(rank, chunk, ranks), group * ranks + within % ranks


def _interleaved(rank: int, ranks: int, virtual: int, m: int, step: int) -> list[Action]:
    """One minibatch of Megatron's interleaved 1F1B on ``rank``, then a step of each chunk.

    Warm-up: ``(virtual - 1) * ranks`` forwards for the chunks before the last, and two per rank
    downstream (Megatron's count: one for the activation on its way down, one for the gradient on
    its way back), at most all of them; then one forward and one backward in turn; then the
    remaining backwards."""
    total = m * virtual
    warm = min((virtual - 1) * ranks + 2 * (ranks - rank - 1), total)

    def act(kind: str, k: int) -> Action:
        stage, j = _interleaved_pass(rank, ranks, virtual, k, kind == "B")
        return Action(stage, kind, step * m + j)

    out = [act("F", k) for k in range(warm)]
    for k in range(total - warm):
        out += [act("F", warm + k), act("B", k)]
    out += [act("B", k) for k in range(total - warm, total)]
    return out + [Action(interleaved_stage(rank, c, ranks), "S", step) for c in range(virtual)]


def interleaved_rank(rank: int, ranks: int, virtual: int, microbatches: int) -> tuple[Action, ...]:
    """One minibatch (step 0) of ``rank``'s interleaved list alone (what :func:`build_interleaved`
    gives that rank), for a cost model that needs one rank's order without building every rank's."""
    check_interleaved(ranks, virtual, microbatches)
    if virtual == 1:
        warm = ranks - rank - 1
        return (*_one_f_one_b(rank, range(microbatches), warm), Action(rank, "S", 0))
    return tuple(_interleaved(rank, ranks, virtual, microbatches, 0))


def build_interleaved(
    ranks: int, virtual: int, microbatches: int, steps: int = 1, first_step: int = 0
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's list of ``interleaved`` (Megatron's virtual stages): rank ``r`` hosts stages
    ``r, r + ranks, ...`` (see :func:`interleaved_stage`) and plays their forwards and backwards in
    one list, flushed every minibatch. With equal stages of unit F and B it takes
    ``2 * (virtual * microbatches + ranks - 1)`` slots per minibatch: a bubble of
    ``(ranks - 1) / (virtual * microbatches)`` against 1F1B's ``(ranks - 1) / microbatches``.
    One chunk per rank is 1f1b's lists.

    Example:
        >>> format_actions(build_interleaved(2, 2, 2)[1])
        '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 1S0 3S0'
    """
    check_interleaved(ranks, virtual, microbatches)
    if virtual == 1:
        return tuple(acts for (acts,) in build_job("1f1b", [1] * ranks, microbatches, steps, first_step))
    ids = range(first_step, first_step + steps)
    return tuple(
        tuple(a for s in ids for a in _interleaved(r, ranks, virtual, microbatches, s)) for r in range(ranks)
    )


def validate_ranks(
    lists: Sequence[Sequence[Action]],
    microbatches: int,
    steps: Sequence[int],
    placement: Sequence[int] | None = None,
) -> None:
    """Check per-rank lists that host several stages each: every rank lists only the stages it
    hosts (``placement[stage]``, the rank of each stage; by default ``interleaved``'s, stage ``s`` on
    rank ``s mod p``; ``zbv`` passes its V); each stage, taken alone, is complete and in order (as
    :func:`validate_job` checks it); and the ranks together do not deadlock (:func:`simulate_ranks`).

    Raises:
        ScheduleError: naming the first rank, stage or action that is wrong.
    """
    p = len(lists)
    stages = 1 + max((a.stage for acts in lists for a in acts), default=-1)
    home = list(placement) if placement is not None else [k % p for k in range(stages)]
    if len(home) < stages:
        raise ScheduleError(f"the lists name {stages} stages but the placement only {len(home)}")
    units = {s * microbatches + j for s in steps for j in range(microbatches)}
    for r, acts in enumerate(lists):
        wrong = [a for a in acts if home[a.stage] != r]
        if wrong:
            raise ScheduleError(f"rank {r} lists {wrong[0]}, an action of rank {home[wrong[0].stage]}")
    for k in range(stages):
        own = tuple(a for a in lists[home[k]] if a.stage == k)
        _check_stage(k, (own,), units, {u: u // microbatches for u in units})
    simulate_ranks(lists)


def simulate_ranks(lists: Sequence[Sequence[Action]]) -> int:
    """Dry-run ranks that each play one list of actions of any stages, one unit-time action per slot
    (steps are free and local: no replicas); returns the slots.

    As :func:`simulate_job`: a forward needs the previous stage's forward of its unit from an earlier
    slot, a backward the next stage's (the last stage: its own forward), a W nothing.

    Raises:
        ScheduleError: if the ranks deadlock.
    """
    last = max((a.stage for acts in lists for a in acts), default=0)
    done: set[tuple[int, str, int]] = set()
    pos, slot = [0] * len(lists), 0
    while any(p < len(acts) for p, acts in zip(pos, lists, strict=True)):
        finished = []
        for r, acts in enumerate(lists):
            while pos[r] < len(acts) and acts[pos[r]].kind == "S":
                pos[r] += 1
            if pos[r] == len(acts):
                continue
            a = acts[pos[r]]
            need = (a.stage - 1, "F", a.index) if a.kind == "F" else (a.stage + 1, "B", a.index)
            local = (a.kind == "F" and a.stage == 0) or (a.kind == "B" and a.stage == last) or a.kind == "W"
            if local or need in done:
                finished.append((a.stage, a.kind, a.index))
                pos[r] += 1
        if not finished and any(p < len(acts) for p, acts in zip(pos, lists, strict=True)):
            stuck = [str(acts[p]) for p, acts in zip(pos, lists, strict=True) if p < len(acts)]
            raise ScheduleError(f"schedule deadlocks at slot {slot}: waiting on {' '.join(stuck)}")
        done.update(finished)
        slot += 1 if finished else 0
    return slot
