"""A rank's actions, read a little ahead of the one it plays.

Schedules are built lazily, a minibatch at a time (:func:`runtime.schedule.actions`), so a run's
start-up and memory do not grow with its steps. The executor still needs to see a few actions ahead:
the next one that receives (to post its receives early) and, under weight stashing, whether a
forward's backward comes before the stage's next step. :class:`Lookahead` keeps only the actions
between the one playing and the furthest one looked at.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from runtime.schedule import Action

__all__ = ["Lookahead", "steps_before_backward"]


class Lookahead:
    """Actions by absolute position, pulled from an iterator as they are asked for."""

    def __init__(self, actions: Iterable[Action]) -> None:
        self._source = iter(actions)
        self._kept: deque[Action] = deque()
        self._first = 0  # the position of _kept[0]

    def __getitem__(self, position: int) -> Action | None:
        """The action at ``position`` (not yet forgotten), or None past the end."""
        while position - self._first >= len(self._kept):
            following = next(self._source, None)
            if following is None:
                return None
            self._kept.append(following)
        return self._kept[position - self._first]

    def forget(self, before: int) -> None:
        """Drop the actions before ``before``: they will not be asked for again."""
        while self._first < before and self._kept:
            self._kept.popleft()
            self._first += 1


def steps_before_backward(stream: Lookahead, position: int) -> bool:
    """Whether the forward at ``position`` is followed by a step of its stage before its backward
    (or has no backward in the stream): its backward then needs the weights of its forward stashed.
    PipeDream's last stage, whose backward follows its forward at once, never stashes."""
    forward = stream[position]
    assert forward is not None and forward.kind == "F"
    at = position + 1
    while (a := stream[at]) is not None:
        if a.stage == forward.stage and (a.kind == "S" or (a.kind == "B" and a.index == forward.index)):
            return a.kind == "S"
        at += 1
    return True
