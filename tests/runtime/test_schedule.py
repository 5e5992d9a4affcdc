"""Schedules as data: every small (stages, microbatches) validates, and the closed forms hold."""

from __future__ import annotations

import pytest

from runtime.schedule import (
    Action,
    ScheduleError,
    build,
    format_actions,
    parse_actions,
    rank_actions,
    simulate,
    validate,
)

RANGE = [(p, m) for p in range(1, 6) for m in range(1, 9)]


@pytest.mark.parametrize("name", ["pipedream", "1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_every_small_schedule_is_valid(name: str, stages: int, micro: int) -> None:
    for steps in (1, 3):
        validate(build(name, stages, micro, steps, first_step=2), micro, range(2, 2 + steps))


@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_synchronous_schedules_take_2_m_plus_p_minus_1_slots(stages: int, micro: int) -> None:
    for name in ("gpipe", "1f1b"):
        assert simulate(build(name, stages, micro)) == 2 * (micro + stages - 1)
        assert simulate(build(name, stages, micro, steps=3)) == 3 * 2 * (micro + stages - 1)


@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_pipedream_never_flushes(stages: int, micro: int) -> None:
    steps = 4
    # Without flushes, n units take 2n slots in steady state plus one fill and drain of the pipe.
    assert simulate(build("pipedream", stages, micro, steps)) == 2 * (steps * micro + stages - 1)


@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_1f1b_keeps_at_most_p_minus_k_microbatches_in_flight(stages: int, micro: int) -> None:
    for k, actions in enumerate(build("1f1b", stages, micro)):
        live = peak = 0
        for a in actions:
            live += {"F": 1, "B": -1, "S": 0}[a.kind]
            peak = max(peak, live)
        assert peak == min(stages - k, micro)


def test_text_form_round_trips_and_matches_pipelining_notation() -> None:
    acts = build("1f1b", stages=2, microbatches=3)
    assert format_actions(acts[0]) == "0F0 0F1 0B0 0F2 0B1 0B2 0S0"
    assert format_actions(acts[1]) == "1F0 1B0 1F1 1B1 1F2 1B2 1S0"
    assert parse_actions(format_actions(acts[0])) == acts[0]
    with pytest.raises(ScheduleError):
        Action.parse("0X1")


def test_pipedream_steps_after_each_minibatch_without_flush() -> None:
    acts = build("pipedream", stages=2, microbatches=1, steps=3)
    assert format_actions(acts[0]) == "0F0 0F1 0B0 0S0 0F2 0B1 0S1 0B2 0S2"


def test_validate_rejects_broken_schedules() -> None:
    good = build("gpipe", 2, 2)
    swapped = (good[0], (good[1][2], *good[1][:2], *good[1][3:]))
    with pytest.raises(ScheduleError, match="before"):
        validate(swapped, 2, [0])
    missing = (good[0], good[1][1:])
    with pytest.raises(ScheduleError, match="cover"):
        validate(missing, 2, [0])
    # Stage 0 waits for a backward before sending the forward stage 1 needs: a deadlock.
    dead = (parse_actions("0F0 0B0 0F1 0B1 0S0"), parse_actions("1F1 1B1 1F0 1B0 1S0"))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(dead, 2, [0])


def test_replicas_split_microbatches_round_robin_and_all_step() -> None:
    acts = build("1f1b", stages=2, microbatches=4)[0]
    r0 = rank_actions(acts, replica=0, replicas=3, microbatches=4)
    r1 = rank_actions(acts, replica=1, replicas=3, microbatches=4)
    assert [a.index for a in r0 if a.kind == "F"] == [0, 3]
    assert [a.index for a in r1 if a.kind == "F"] == [1]
    assert r0[-1] == r1[-1] == Action(0, "S", 0)
