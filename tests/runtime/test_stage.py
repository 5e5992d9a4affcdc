"""StageRuntime's weight stashing: only units that an optimizer step separates from their backward
run on a stashed copy of the weights; the rank's list is read a little ahead, never whole."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.executing.lookahead import Lookahead, steps_before_backward
from runtime.schedule import Action, build, parse_actions, pipeline


def stashed(actions: Sequence[Action]) -> set[int]:
    """The units whose forward needs a stash (a step before their backward)."""
    stream = Lookahead(actions)
    return {a.index for i, a in enumerate(actions) if a.kind == "F" and steps_before_backward(stream, i)}


def test_pipedream_last_stage_never_stashes() -> None:
    first, middle, last = build("pipedream", pipeline([1, 1, 1]), 1, 5, first_step=0)
    assert stashed(last) == set()
    assert stashed(first) == stashed(middle) == {1, 2, 3, 4}


def test_a_step_between_forward_and_backward_needs_a_stash() -> None:
    assert stashed(parse_actions("0F0 0F1 0B0 0S0 0B1 0S1")) == {1}
    assert stashed(parse_actions("0F0 0S0 0B0")) == {0}
    assert stashed(parse_actions("0F0 0F1")) == {0, 1}  # backward in a later segment


def test_lookahead_keeps_only_what_it_was_asked_past() -> None:
    stream = Lookahead(iter(parse_actions("0F0 0B0 0S0 0F1 0B1 0S1")))
    assert str(stream[2]) == "0S0" and str(stream[0]) == "0F0"
    stream.forget(2)
    assert str(stream[5]) == "0S1" and stream[6] is None
