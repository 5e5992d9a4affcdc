"""Pipeline schedules as data: per-stage action lists that one generic executor plays back.

A schedule never runs code; it lists, for every stage, the order of its forwards (``F``), backwards
(``B``) and optimizer steps (``S``). Microbatches are numbered globally across minibatches
(``unit = step * microbatches + j``), so an asynchronous schedule that never flushes is a plain list
too. Being data, a schedule is checked by :func:`validate` and dry-run by :func:`simulate` without
torch, and printed in the text form of ``torch.distributed.pipelining`` (``0F3 0B3``).

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
    "format_actions",
    "parse_actions",
    "rank_actions",
    "replica_of",
    "simulate",
    "validate",
]

SCHEDULES: tuple[str, ...] = ("pipedream", "1f1b", "gpipe")
_ACTION = re.compile(r"^(\d+)([FBS])(\d+)$")


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order or deadlocks."""


@dataclass(frozen=True, order=True)
class Action:
    """One thing a stage does.

    Attributes:
        stage: the pipeline stage that does it.
        kind: ``F`` forward, ``B`` backward, ``S`` optimizer step (all replicas of the stage join it).
        index: the global microbatch (unit) for F/B; the step (minibatch) number for S.
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
            raise ScheduleError(f"not an action: {text!r} (expected e.g. 0F3, 0B3, 0S0)")
        return Action(int(match.group(1)), match.group(2), int(match.group(3)))


def format_actions(actions: Iterable[Action]) -> str:
    """Space-separated text form of an action list."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> tuple[Action, ...]:
    """Inverse of :func:`format_actions`."""
    return tuple(Action.parse(tok) for tok in text.split())


def _one_f_one_b(stage: int, stages: int, units: Sequence[int]) -> list[Action]:
    """1F1B order over ``units``: ``stages-stage-1`` warm-up forwards, then F/B pairs, then backwards."""
    warm = min(stages - stage - 1, len(units))
    out = [Action(stage, "F", u) for u in units[:warm]]
    for i in range(len(units) - warm):
        out += [Action(stage, "F", units[warm + i]), Action(stage, "B", units[i])]
    out += [Action(stage, "B", u) for u in units[len(units) - warm :]]
    return out


def _stage_actions(name: str, stage: int, stages: int, m: int, steps: Sequence[int]) -> list[Action]:
    if name == "pipedream":
        units = [s * m + j for s in steps for j in range(m)]
        out: list[Action] = []
        for action in _one_f_one_b(stage, stages, units):
            out.append(action)
            if action.kind == "B" and (action.index + 1) % m == 0:
                out.append(Action(stage, "S", action.index // m))
        return out
    out = []
    for s in steps:
        units = [s * m + j for j in range(m)]
        if name == "1f1b":
            out += _one_f_one_b(stage, stages, units)
        else:
            out += [Action(stage, "F", u) for u in units] + [Action(stage, "B", u) for u in units]
        out.append(Action(stage, "S", s))
    return out


def build(
    name: str, stages: int, microbatches: int, steps: int = 1, first_step: int = 0
) -> tuple[tuple[Action, ...], ...]:
    """Per-stage action lists of schedule ``name`` for ``steps`` minibatches starting at ``first_step``.

    ``pipedream`` pipelines across minibatches without a flush and steps each stage's optimizer after
    the backward of a minibatch's last microbatch (weights are stashed by the executor); ``1f1b`` and
    ``gpipe`` flush every minibatch, so their gradients are exact.
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or steps < 0:
        raise ScheduleError(f"need stages >= 1 and microbatches >= 1, got {stages}, {microbatches}")
    step_ids = range(first_step, first_step + steps)
    return tuple(tuple(_stage_actions(name, k, stages, microbatches, step_ids)) for k in range(stages))


def replica_of(unit: int, microbatches: int, replicas: int) -> int:
    """Which replica of a stage runs ``unit``: microbatches go round-robin within each minibatch."""
    return (unit % microbatches) % replicas


def rank_actions(
    actions: Sequence[Action], replica: int, replicas: int, microbatches: int
) -> tuple[Action, ...]:
    """The actions one replica of a stage plays: its own F/B units and every optimizer step."""
    return tuple(
        a for a in actions if a.kind == "S" or replica_of(a.index, microbatches, replicas) == replica
    )


def validate(schedule: Sequence[Sequence[Action]], microbatches: int, steps: Sequence[int]) -> None:
    """Check completeness, local order and deadlock-freedom of a per-stage schedule.

    Raises:
        ScheduleError: naming the first stage and action that is wrong.
    """
    units = {s * microbatches + j for s in steps for j in range(microbatches)}
    for k, actions in enumerate(schedule):
        seen: dict[tuple[str, int], int] = {}
        for pos, a in enumerate(actions):
            if a.stage != k:
                raise ScheduleError(f"stage {k} lists {a}, an action of stage {a.stage}")
            if (a.kind, a.index) in seen:
                raise ScheduleError(f"stage {k} lists {a} twice")
            seen[(a.kind, a.index)] = pos
        for kind, want in (("F", units), ("B", units), ("S", set(steps))):
            have = {i for (kd, i) in seen if kd == kind}
            if have != want:
                raise ScheduleError(
                    f"stage {k}: {kind} actions cover {sorted(have)}, expected {sorted(want)}"
                )
        for u in units:
            if seen[("B", u)] < seen[("F", u)]:
                raise ScheduleError(f"stage {k} runs {k}B{u} before {k}F{u}")
            if seen[("S", u // microbatches)] < seen[("B", u)]:
                raise ScheduleError(f"stage {k} steps {k}S{u // microbatches} before {k}B{u}")
    simulate(schedule)


def simulate(schedule: Sequence[Sequence[Action]]) -> int:
    """Dry-run with unit-time forwards and backwards and free steps; returns the number of slots.

    A forward needs the previous stage's forward of the same unit from an earlier slot, a backward the
    next stage's backward (or, on the last stage, its own forward). With equal stage times GPipe and
    1F1B take ``2 * (microbatches + stages - 1)`` slots per minibatch.

    Raises:
        ScheduleError: if the stages deadlock.
    """
    last = len(schedule) - 1
    done: set[tuple[int, str, int]] = set()
    pos = [0] * len(schedule)
    slot = 0
    while any(p < len(acts) for p, acts in zip(pos, schedule, strict=True)):
        finished: list[tuple[int, str, int]] = []
        for k, acts in enumerate(schedule):
            while pos[k] < len(acts) and acts[pos[k]].kind == "S":
                pos[k] += 1
            if pos[k] == len(acts):
                continue
            a = acts[pos[k]]
            need = (k - 1, "F", a.index) if a.kind == "F" else (k + 1, "B", a.index)
            if (a.kind == "F" and k == 0) or (a.kind == "B" and k == last) or need in done:
                finished.append((k, a.kind, a.index))
                pos[k] += 1
        if not finished and any(p < len(acts) for p, acts in zip(pos, schedule, strict=True)):
            stuck = [str(acts[p]) for p, acts in zip(pos, schedule, strict=True) if p < len(acts)]
            raise ScheduleError(f"schedule deadlocks at slot {slot}: waiting on {' '.join(stuck)}")
        done.update(finished)
        slot += 1 if finished else 0
    return slot
