"""zb1p (ZB-H1) as data: it validates, splits every backward into B then W, keeps 1F1B's forwards
in flight, and takes the closed-form slots; broken split lists are refused."""

from __future__ import annotations

import pytest

from runtime.schedule import (
    Action,
    ScheduleError,
    build,
    format_actions,
    parse_actions,
    pipeline,
    simulate,
    validate,
)

RANGE = [(p, m) for p in range(1, 7) for m in range(1, 13)]


def zb_slots(stages: int, micro: int) -> int:
    """ZB-H1 with unit F, B and W: 3m + p - 1 once m >= p (bubble p - 1, a third of 1F1B's 3(p - 1))."""
    return 2 * (micro + stages - 1) + 1 + max(micro - stages, 0)


@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_every_small_zb1p_is_valid_and_takes_the_closed_form(stages: int, micro: int) -> None:
    for steps in (1, 2):
        validate(
            build("zb1p", pipeline([1] * stages), micro, steps, first_step=3), micro, range(3, 3 + steps)
        )
        assert simulate(build("zb1p", pipeline([1] * stages), micro, steps)) == steps * zb_slots(
            stages, micro
        )


@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_zb1p_keeps_1f1b_forwards_and_at_most_p_graphs(stages: int, micro: int) -> None:
    for k, (zb, one) in enumerate(
        zip(
            build("zb1p", pipeline([1] * stages), micro),
            build("1f1b", pipeline([1] * stages), micro),
            strict=True,
        )
    ):
        assert [a for a in zb if a.kind != "W"] == list(one)  # F, B and S exactly in 1F1B's order
        fwd = graphs = most_f = most_g = 0
        for a in zb:
            fwd += {"F": 1, "B": -1}.get(a.kind, 0)
            graphs += {"F": 1, "W": -1}.get(a.kind, 0)
            most_f, most_g = max(most_f, fwd), max(most_g, graphs)
        assert most_f == min(stages - k, micro)
        assert most_g == min(stages, micro)


def test_zb1p_text_form() -> None:
    got = [format_actions(a) for a in build("zb1p", pipeline([1] * 2), 3)]
    assert got == ["0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2 0S0", "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2 1S0"]
    assert parse_actions(got[1]) == build("zb1p", pipeline([1] * 2), 3)[1]


def test_zb1p_replicas_keep_b_and_w_of_a_unit_together() -> None:
    lists = build("zb1p", pipeline([2, 1]), 4)
    validate(lists, 4, [0], pipeline([2, 1]), "zb1p")
    for acts in lists[:2]:
        units = {a.index for a in acts if a.kind == "B"}
        assert units == {a.index for a in acts if a.kind == "W"}


@pytest.mark.parametrize(
    ("lists", "error"),
    [
        (["0F0 0W0 0B0 0S0"], "0W0 before 0B0"),
        (["0F0 0B0 0S0 0W0"], "steps 0S0 before 0W0"),
        (["0F0 0F1 0B0 0B1 0W0 0S0"], "W actions cover"),
        (["0F0 0B0 0W0 0W0 0S0"], "twice"),
    ],
)
def test_validate_refuses_broken_split_backwards(lists: list[str], error: str) -> None:
    units = max(a.index for a in parse_actions(lists[0]) if a.kind != "S") + 1
    with pytest.raises(ScheduleError, match=error):
        validate([parse_actions(t) for t in lists], units, [0])


def test_w_on_another_replica_is_refused() -> None:
    lists = [parse_actions("0F0 0B0 0S0"), parse_actions("0F1 0B1 0W0 0W1 0S0")]
    with pytest.raises(ScheduleError, match="0W0 before 0B0 or on another replica"):
        validate(lists, 2, [0], pipeline([2]), "zb1p")


def test_w_parses_and_round_trips() -> None:
    assert Action.parse("2W7") == Action(2, "W", 7)
    with pytest.raises(ScheduleError, match="0W3"):
        Action.parse("0X3")
