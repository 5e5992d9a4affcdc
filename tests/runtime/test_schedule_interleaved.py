"""interleaved (Megatron's virtual stages) as data: every supported (ranks, microbatches, virtual
stages) validates, takes the closed-form slots (bubble (p - 1) / (v m)), holds Megatron's warm-up in
flight, and broken or unsupported lists are refused."""

from __future__ import annotations

import pytest

from runtime.schedule import (
    Action,
    Layout,
    ScheduleError,
    build,
    format_actions,
    get_schedule,
    layout_of,
    parse_actions,
    pipeline,
    simulate,
    validate,
)


def build_interleaved(
    ranks: int, virtual: int, micro: int, steps: int = 1, first_step: int = 0
) -> tuple[tuple[Action, ...], ...]:
    return build("interleaved", cycle(ranks, virtual), micro, steps, first_step)


def cycle(ranks: int, virtual: int) -> Layout:
    return layout_of("interleaved", ranks, virtual)


RANGE = [(p, m, v) for p in range(1, 5) for m in range(1, 9) for v in range(1, 4) if v == 1 or m % p == 0]


@pytest.mark.parametrize(("ranks", "micro", "virtual"), RANGE)
def test_every_supported_interleaved_is_valid(ranks: int, micro: int, virtual: int) -> None:
    for steps in (1, 2):
        lists = build_interleaved(ranks, virtual, micro, steps, first_step=3)
        validate(lists, micro, range(3, 3 + steps), cycle(ranks, virtual), "interleaved")
        hosted = {a.stage for acts in lists for a in acts}
        assert hosted == set(range(ranks * virtual))


@pytest.mark.parametrize(("ranks", "micro", "virtual"), RANGE)
def test_interleaved_bubble_is_p_minus_1_over_v_m(ranks: int, micro: int, virtual: int) -> None:
    """Equal stages, unit F and B per chunk: the ideal is 2 v m slots per rank, the bubble
    (p - 1) / (v m) of it, so 2 (v m + p - 1) slots per minibatch."""
    for steps in (1, 2):
        slots = simulate(build_interleaved(ranks, virtual, micro, steps), cycle(ranks, virtual))
        ideal = 2 * virtual * micro
        assert slots == steps * 2 * (virtual * micro + ranks - 1)
        assert slots / steps / ideal - 1 == pytest.approx((ranks - 1) / (virtual * micro))


@pytest.mark.parametrize(("ranks", "micro", "virtual"), RANGE)
def test_interleaved_holds_megatrons_warm_up_plus_one(ranks: int, micro: int, virtual: int) -> None:
    for r, acts in enumerate(build_interleaved(ranks, virtual, micro)):
        live = peak = 0
        for a in acts:
            live += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, live)
        warm = (virtual - 1) * ranks + 2 * (ranks - r - 1) if virtual > 1 else ranks - r - 1
        assert peak == min(warm + 1, virtual * micro)


def test_one_chunk_is_1f1b() -> None:
    assert build_interleaved(3, 1, 5, steps=2) == build("1f1b", pipeline([1, 1, 1]), 5, steps=2)


def test_interleaved_text_form_and_layout() -> None:
    lists = build_interleaved(2, 2, 2)
    assert [format_actions(a) for a in lists] == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 0S0 2S0",
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 1S0 3S0",
    ]
    assert cycle(4, 2) == tuple((s % 4,) for s in range(8))


def test_unsupported_microbatches_are_refused() -> None:
    with pytest.raises(ScheduleError, match=r"multiple of the 4 ranks.*--microbatches 8"):
        get_schedule("interleaved").check(4, 2, 6)
    with pytest.raises(ScheduleError, match="at least 2 ranks"):
        get_schedule("interleaved").check(1, 2, 2)


@pytest.mark.parametrize(
    ("lists", "error"),
    [
        (["0F0 1F0 0B0 0S0", "1B0 1S0"], "rank 0 lists 1F0, an action of rank 1"),
        (["0F0 2F0 0B0 2B0 0S0 2S0", "1F0 3F0 3B0 1B0 1S0 3S0"], "deadlock"),
        (["0F0 2F0 2B0 0B0 0S0", "1F0 3F0 3B0 1B0 1S0 3S0"], "stage 2 replica 0 steps"),
        (["0F0 2B0 2F0 0B0 0S0 2S0", "1F0 3F0 3B0 1B0 1S0 3S0"], "2B0 before 2F0"),
        (["2F0 0F0 2B0 0B0 0S0 2S0", "1F0 3F0 3B0 1B0 1S0 3S0"], "deadlock"),
    ],
)
def test_validate_ranks_refuses_broken_lists(lists: list[str], error: str) -> None:
    with pytest.raises(ScheduleError, match=error):
        validate([parse_actions(t) for t in lists], 1, [0], cycle(2, 2), "interleaved")


def test_a_valid_hand_written_list_passes() -> None:
    rank0, rank1 = parse_actions("0F0 2F0 2B0 0B0 0S0 2S0"), parse_actions("1F0 3F0 3B0 1B0 1S0 3S0")
    validate([rank0, rank1], 1, [0], cycle(2, 2), "interleaved")
    assert Action(3, "S", 0) in rank1


def test_copies_play_interleaved_pipelines_of_their_own() -> None:
    """PP2 x DP2 with 2 chunks a rank: copy i (ranks 2r + i) plays 2 ranks' interleaved order over
    its microbatches j mod 2 == i, and the four lists validate together."""
    layout = tuple(tuple(r * 2 + i for i in range(2)) for (r,) in cycle(2, 2))
    lists = build("interleaved", layout, 8, 2)
    validate(lists, 8, range(2), layout, "interleaved")
    alone = build("interleaved", cycle(2, 2), 4)
    for i in range(2):
        own = {a.index for a in lists[i] if a.kind != "S"}
        assert own == {s * 8 + j for s in range(2) for j in range(i, 8, 2)}
        first = [a for a in lists[2 + i] if (a.index if a.kind == "S" else a.index // 8) == 0]
        assert [a.kind + str(a.stage) for a in first] == [a.kind + str(a.stage) for a in alone[1]]
