"""``zbv``: the V-shaped zero-bubble schedule (ZB-V, Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, section 6) as per-rank action lists.

``p`` ranks play ``2p`` stages laid out as a V: rank ``r`` hosts stage ``r`` (its chunk 0, on the
way down) and stage ``2p - 1 - r`` (its chunk 1, on the way back up), so rank 0 holds both the first
and the last stage and the turn of the V (stages ``p - 1`` and ``p``) is a hand-off inside rank
``p - 1`` (the runtime's loopback). Every backward is split into ``B`` (input gradients, which the
previous stage waits for) and ``W`` (weight gradients, which nobody waits for): the Ws fill what
would be bubbles, and since a unit's way back starts on the rank where it started, each rank holds
about as many activations as 1F1B's first stage.

The order of one rank, in five phases (counters per chunk and kind give the microbatches):

1. warm-up down: ``2(p - r) - 1`` forwards of chunk 0, the units the ranks below need in flight;
2. warm-up across: ``r`` pairs (chunk 1 forward, chunk 0 forward): the returning units arrive;
3. warm-up back: ``p - r`` triples (chunk 1 F, B, W): the first units turn round;
4. steady: ``n - p`` rounds of (chunk 0 F while any is left, B, W; chunk 1 F, B, W);
5. cool-down: ``r`` pairs (chunk 0 B, chunk 1 B), ``p - r`` pairs (chunk 0 B, W), then every W
   still owed, chunk 1's first.

``n`` is at least ``2p - 1`` (phase 1 of rank 0 alone forwards that many); with fewer microbatches
the order is built for ``2p - 1`` and the missing units' actions are left out. A step of each
chunk ends the minibatch (chunk 0's first: it does the rank's once-per-step work, as under
``interleaved``).

Example:
    >>> from runtime.schedule import format_actions
    >>> [format_actions(a) for a in build_zbv(1, 2)]
    ['0F0 1F0 1B0 1W0 0F1 0B0 0W0 1F1 1B1 1W1 0B1 0W1 0S0 1S0']
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.schedule import Action, ScheduleError

__all__ = [
    "build_zbv",
    "check_zbv",
    "zbv_placement",
    "zbv_rank",
    "zbv_rank_of",
    "zbv_stages",
]


def zbv_stages(rank: int, ranks: int) -> tuple[int, int]:
    """The two stages ``rank`` hosts under zbv: ``rank`` on the way down, ``2 ranks - 1 - rank`` back up."""
    return rank, 2 * ranks - 1 - rank


def zbv_rank_of(stage: int, ranks: int) -> int:
    """The rank that hosts ``stage`` under zbv (the V: stages ``p - 1`` and ``p`` share a rank)."""
    return stage if stage < ranks else 2 * ranks - 1 - stage


def zbv_placement(ranks: int) -> tuple[int, ...]:
    """The rank of every one of the ``2 ranks`` stages, in pipeline order."""
    return tuple(zbv_rank_of(s, ranks) for s in range(2 * ranks))


def check_zbv(ranks: int, microbatches: int) -> None:
    """Refuse what zbv cannot play: it needs at least one rank and one microbatch."""
    if ranks < 1 or microbatches < 1:
        raise ScheduleError(f"zbv needs ranks >= 1 and microbatches >= 1, got {ranks}, {microbatches}")


def _phases(rank: int, ranks: int, n: int) -> list[tuple[int, str]]:
    """(chunk, kind) of every action of ``rank`` for ``n >= 2 ranks - 1`` microbatches, in order."""
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


def _zbv(rank: int, ranks: int, m: int, step: int) -> list[Action]:
    """One minibatch of ``rank``'s zbv list: the phases numbered per (chunk, kind), the units past
    ``m`` left out, then a step of each chunk."""
    stages = zbv_stages(rank, ranks)
    seen: dict[tuple[int, str], int] = {}
    out = []
    for chunk, kind in _phases(rank, ranks, max(m, 2 * ranks - 1)):
        j = seen.get((chunk, kind), 0)
        seen[(chunk, kind)] = j + 1
        if j < m:
            out.append(Action(stages[chunk], kind, step * m + j))
    return out + [Action(s, "S", step) for s in stages]


def zbv_rank(rank: int, ranks: int, microbatches: int) -> tuple[Action, ...]:
    """One minibatch (step 0) of ``rank``'s zbv list alone, for a cost model that needs one rank's
    order without building every rank's."""
    check_zbv(ranks, microbatches)
    return tuple(_zbv(rank, ranks, microbatches, 0))


def build_zbv(
    ranks: int, microbatches: int, steps: int = 1, first_step: int = 0
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's zbv list for ``steps`` minibatches from ``first_step``, flushed every minibatch.

    With unit-time F, B and W on every stage (:func:`runtime.schedule.simulate_ranks`), one
    minibatch of ``m`` microbatches on ``p`` ranks takes ``max(6m + p - 1, 4m + 4p - 2)`` slots.
    Each rank does ``6m`` actions (two chunks, three passes); from ``m >= 2p - 1`` on, rank
    ``p - 1`` waits ``p - 1`` slots for unit 0 to come down, then is never idle and finishes last
    (the Ws fill every wait; tests/partitioner/optimizer/test_zbv.py): ``p - 1`` slots of bubble
    per rank against ``6m`` of work; with half-size stages, half of zb1p's ``p - 1`` full-stage
    slots. Below ``2p - 1`` microbatches the warm-up cannot be filled and the slots are
    ``4m + 4p - 2``. One rank is two chunks played back to back: ``6m``, no bubble.
    """
    check_zbv(ranks, microbatches)
    ids: Sequence[int] = range(first_step, first_step + steps)
    return tuple(tuple(a for s in ids for a in _zbv(r, ranks, microbatches, s)) for r in range(ranks))
