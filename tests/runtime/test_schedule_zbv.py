"""zbv (ZB-V) as data: every (ranks, microbatches) validates on the V placement, takes the closed-form
slots (bubble p - 1 slots once m >= 2p - 1), splits every backward, keeps each rank's activations
near 1F1B's first stage, and lists that break the V or drop Ws are refused."""

from __future__ import annotations

import pytest

from runtime.schedule import (
    Action,
    Layout,
    ScheduleError,
    actions,
    build,
    format_actions,
    get_schedule,
    layout_of,
    parse_actions,
    simulate,
    validate,
)

RANGE = [(p, m) for p in range(1, 5) for m in range(1, 13)]


def v(ranks: int) -> Layout:
    """zbv's V: stages r and 2 ranks - 1 - r on rank r."""
    return layout_of("zbv", ranks, 2)


def build_zbv(ranks: int, micro: int, steps: int = 1, first_step: int = 0) -> tuple[tuple[Action, ...], ...]:
    return build("zbv", v(ranks), micro, steps, first_step)


def zbv_slots(ranks: int, micro: int) -> int:
    """Unit F, B and W per chunk: 6m per rank plus p - 1 slots of bubble once m >= 2p - 1."""
    return max(6 * micro + ranks - 1, 4 * micro + 4 * ranks - 2)


@pytest.mark.parametrize(("ranks", "micro"), RANGE)
def test_every_zbv_is_valid_on_the_v(ranks: int, micro: int) -> None:
    for steps in (1, 2):
        lists = build_zbv(ranks, micro, steps, first_step=3)
        validate(lists, micro, range(3, 3 + steps), v(ranks), "zbv")
        assert [{a.stage for a in acts} for acts in lists] == [{r, 2 * ranks - 1 - r} for r in range(ranks)]


@pytest.mark.parametrize(("ranks", "micro"), RANGE)
def test_zbv_takes_the_closed_form(ranks: int, micro: int) -> None:
    one = simulate(build_zbv(ranks, micro), v(ranks))
    assert one == zbv_slots(ranks, micro)
    # Steps are local: the next minibatch's first forwards may start under the last Ws of this one.
    assert 2 * 6 * micro <= simulate(build_zbv(ranks, micro, 2), v(ranks)) <= 2 * one
    if micro >= 2 * ranks - 1:  # the bubble: p - 1 slots of one chunk pass, against 6m of work
        assert zbv_slots(ranks, micro) - 6 * micro == ranks - 1


@pytest.mark.parametrize(("ranks", "micro"), RANGE)
def test_zbv_splits_every_backward_and_holds_about_1f1b_first_stage(ranks: int, micro: int) -> None:
    for r in range(ranks):
        acts = list(actions("zbv", v(ranks), r, micro, range(1)))
        for stage in (r, 2 * ranks - 1 - r):
            own = [a for a in acts if a.stage == stage]
            assert [a.index for a in own if a.kind == "W"] == [a.index for a in own if a.kind == "B"]
            assert own[-1].kind == "S"
        graphs = peak = 0
        for a in acts:
            graphs += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, graphs)
        # At most 2p graphs of half a stage (B and W of a unit pending): 1F1B's stage-0 peak of p
        # full-stage activations, reached on every rank once the warm-up fills (m >= 2p - 1).
        assert peak <= 2 * ranks
        assert peak == 2 * ranks or micro < 2 * ranks - 1


def test_zbv_layout() -> None:
    assert v(4) == tuple((r,) for r in (0, 1, 2, 3, 3, 2, 1, 0))  # stages 3 and 4 on rank 3: a loopback


def test_zbv_text_form() -> None:
    got = [format_actions(a) for a in build_zbv(2, 3)]
    assert got == [
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0B0 0W0 3F2 3B2 3W2 0B1 0W1 0B2 0W2 0S0 3S0",
        "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1B1 2B2 1B2 1W1 2W2 1W2 1S0 2S0",
    ]
    assert parse_actions(got[1]) == build_zbv(2, 3)[1]


def test_zbv_refuses_nonsense() -> None:
    with pytest.raises(ScheduleError, match="zbv needs ranks >= 1 and microbatches >= 1"):
        get_schedule("zbv").check(2, 2, 0)


def test_dropped_ws_or_a_broken_v_are_refused() -> None:
    lists = [list(acts) for acts in build_zbv(2, 4)]
    no_w = [[a for a in acts if not (a.kind == "W" and a.index == 1)] for acts in lists]
    with pytest.raises(ScheduleError, match="W actions cover"):
        validate(no_w, 4, [0], v(2), "zbv")
    with pytest.raises(ScheduleError, match="an action of rank"):
        validate(lists, 4, [0], layout_of("interleaved", 2, 2))  # stage 3 is not on rank 1 there
    swapped = [lists[0], [*lists[1]]]
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]  # 2F0 before 1F0 on one rank
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(swapped, 4, [0], v(2), "zbv")


def with_copies(layout: Layout, copies: int) -> Layout:
    """``layout`` on each of ``copies`` copies: copy ``i`` of rank ``r``'s stages on rank ``r d + i``."""
    return tuple(tuple(r * copies + i for i in range(copies)) for (r,) in layout)


@pytest.mark.parametrize(("ranks", "micro", "copies"), [(2, 4, 2), (2, 5, 2), (3, 6, 3), (1, 2, 2)])
def test_copies_play_v_pipelines_of_their_own(ranks: int, micro: int, copies: int) -> None:
    """Each copy is a V of its own over the microbatches j mod d == i (Schedule.replica_of): its
    lists are one copy's without copies, its microbatches renumbered, and together they validate."""
    layout = with_copies(v(ranks), copies)
    lists = build("zbv", layout, micro, 2)
    validate(lists, micro, range(2), layout, "zbv")
    for i in range(copies):
        own = list(range(i, micro, copies))
        alone = build("zbv", v(ranks), len(own), 2)
        for r in range(ranks):
            renumbered = [
                a
                if a.kind == "S"
                else Action(a.stage, a.kind, a.index // len(own) * micro + own[a.index % len(own)])
                for a in alone[r]
            ]
            assert list(lists[r * copies + i]) == renumbered
            assert {
                get_schedule("zbv").replica_of(a.index, micro, copies) for a in renumbered if a.kind != "S"
            } == {i}
