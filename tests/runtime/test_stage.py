"""StageRuntime's weight stashing: only units that an optimizer step separates from their backward
run on a stashed copy of the weights."""

from __future__ import annotations

from runtime.schedule import build, parse_actions
from runtime.stage import _no_step_between


def test_pipedream_last_stage_never_stashes() -> None:
    first, middle, last = build("pipedream", 3, 1, 5, first_step=0)
    assert _no_step_between(last) == frozenset(range(5))
    assert _no_step_between(first) == _no_step_between(middle) == frozenset({0})


def test_a_step_between_forward_and_backward_needs_a_stash() -> None:
    assert _no_step_between(parse_actions("0F0 0F1 0B0 0S0 0B1 0S1")) == frozenset({0})
    assert _no_step_between(parse_actions("0F0 0S0 0B0")) == frozenset()
    assert _no_step_between(parse_actions("0F0 0F1")) == frozenset()  # backward in a later segment
