"""Schedules as data: every small (stages, microbatches) validates, and the closed forms hold."""

from __future__ import annotations

import pytest

from partitioner.optimizer.pricing.schedules import in_flight
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
    pipeline,
    simulate,
    stash_depth,
    validate,
    warmup,
)

RANGE = [(p, m) for p in range(1, 6) for m in range(1, 9)]


def line(p: int) -> Layout:
    """``p`` stages, one rank each."""
    return pipeline([1] * p)


@pytest.mark.parametrize("name", ["pipedream", "1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_every_small_schedule_is_valid(name: str, stages: int, micro: int) -> None:
    for steps in (1, 3):
        validate(build(name, line(stages), micro, steps, first_step=2), micro, range(2, 2 + steps))


@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_synchronous_schedules_take_2_m_plus_p_minus_1_slots(stages: int, micro: int) -> None:
    for name in ("gpipe", "1f1b"):
        assert simulate(build(name, line(stages), micro)) == 2 * (micro + stages - 1)
        assert simulate(build(name, line(stages), micro, steps=3)) == 3 * 2 * (micro + stages - 1)


@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_pipedream_never_flushes(stages: int, micro: int) -> None:
    steps = 4
    # Without flushes, n units take 2n slots in steady state plus one fill and drain of the pipe.
    assert simulate(build("pipedream", line(stages), micro, steps)) == 2 * (steps * micro + stages - 1)


@pytest.mark.parametrize(("stages", "micro"), RANGE)
def test_1f1b_keeps_at_most_p_minus_k_microbatches_in_flight(stages: int, micro: int) -> None:
    for k, acts in enumerate(build("1f1b", line(stages), micro)):
        live = peak = 0
        for a in acts:
            live += {"F": 1, "B": -1, "S": 0}[a.kind]
            peak = max(peak, live)
        assert peak == min(stages - k, micro)


def test_text_form_round_trips_and_matches_pipelining_notation() -> None:
    acts = build("1f1b", line(2), microbatches=3)
    assert format_actions(acts[0]) == "0F0 0F1 0B0 0F2 0B1 0B2 0S0"
    assert format_actions(acts[1]) == "1F0 1B0 1F1 1B1 1F2 1B2 1S0"
    assert parse_actions(format_actions(acts[0])) == acts[0]
    with pytest.raises(ScheduleError):
        Action.parse("0X1")


def test_pipedream_steps_after_each_minibatch_without_flush() -> None:
    acts = build("pipedream", line(2), microbatches=1, steps=3)
    assert format_actions(acts[0]) == "0F0 0F1 0B0 0S0 0F2 0B1 0S1 0B2 0S2"


def test_validate_rejects_broken_schedules() -> None:
    good = build("gpipe", line(2), 2)
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
    r0, r1, _, _ = build("1f1b", pipeline([3, 1]), microbatches=4)
    assert [a.index for a in r0 if a.kind == "F"] == [0, 3]
    assert [a.index for a in r1 if a.kind == "F"] == [1]
    assert r0[-1] == r1[-1] == Action(0, "S", 0)


PLANS = [(3, 1), (2, 1, 1), (15, 1), (1, 2, 1), (2, 2), (1, 1, 1, 1), (4,)]


@pytest.mark.parametrize("replicas", PLANS)
@pytest.mark.parametrize("micro", [1, 2])
def test_every_rank_stashes_what_the_cost_model_prices(replicas: tuple[int, ...], micro: int) -> None:
    steps = 3 * sum(replicas) + 1  # a partial last round on every replicated stage
    lists = build("pipedream", pipeline(replicas), micro, steps, first_step=5)
    validate(lists, micro, range(5, 5 + steps), pipeline(replicas), "pipedream")
    for k, ranks in enumerate(pipeline(replicas)):
        for r in ranks:
            assert stash_depth(lists[r]) == in_flight("pipedream", k, replicas, micro)


def test_pipedream_warm_up_is_pipedreams() -> None:
    assert [warmup((1, 1, 1, 1), k) for k in range(4)] == [3, 2, 1, 0]
    assert [warmup((3, 1), k) for k in range(2)] == [1, 0]
    assert [warmup((2, 1, 1), k) for k in range(3)] == [1, 1, 0]
    assert [warmup((15, 1), k) for k in range(2)] == [1, 0]


def test_pipedream_replicas_take_whole_minibatches_and_step_per_round() -> None:
    r0, r1, r2, last = build("pipedream", pipeline((3, 1)), microbatches=2, steps=4)
    assert format_actions(r0) == "0F0 0F1 0F6 0B0 0F7 0B1 0S0 0B6 0B7 0S3"
    assert format_actions(r2) == "0F4 0F5 0B4 0B5 0S0 0S3"  # no minibatch in round 3: joins its step
    assert [a.index for a in r1 if a.kind == "F"] == [2, 3]
    assert [a.index for a in last if a.kind == "S"] == [0, 1, 2, 3]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("replicas", PLANS)
def test_synchronous_replicas_split_each_minibatch(name: str, replicas: tuple[int, ...]) -> None:
    micro = 2 * max(replicas)
    validate(build(name, pipeline(replicas), micro, steps=2), micro, range(2), pipeline(replicas), name)


def test_replicas_that_join_different_steps_deadlock() -> None:
    lists = (parse_actions("0F0 0B0 0S0"), parse_actions("0F1 0B1 0S1"), parse_actions("1F0 1B0 1F1 1B1"))
    with pytest.raises(ScheduleError):
        simulate(lists, pipeline([2, 1]))


def test_a_rank_reads_its_list_one_minibatch_at_a_time() -> None:
    """A million steps cost nothing until they are read: the lists are generated as they play."""
    for name in ("pipedream", "1f1b", "zb1p"):
        stream = actions(name, pipeline([2, 1]), 0, 4, range(10**9))
        first = [next(stream) for _ in range(20)]
        assert first == list(build(name, pipeline([2, 1]), 4, steps=40)[0][:20])
    for name in ("interleaved", "zbv"):
        layout = layout_of(name, 2, 2)
        stream = actions(name, layout, 1, 4, range(10**9))
        assert [next(stream) for _ in range(30)] == list(build(name, layout, 4, steps=4)[1][:30])


def test_the_registry_knows_every_schedule() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'; choose one of pipedream"):
        get_schedule("nope")
    assert get_schedule("pipedream").stashes and not get_schedule("gpipe").stashes
    assert get_schedule("zbv").split_backward and get_schedule("zb1p").split_backward
