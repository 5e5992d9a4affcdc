"""A stage's 3D layout as the runtime reads it: ``t`` tensor ranks to a copy, ``d`` copies, a shard
level (docs/layout-3d.md), and who talks to whom between stages.

plan.json's stages carry ``tensor_parallel`` and ``shard`` (absent: 1 and ``none``, every plan
written before reads unchanged); their ``ranks`` are data-major, ``ranks[i * t + j]`` tensor rank
``j`` of copy ``i``. The schedules know nothing of tensor ranks: every rank of a copy plays the
copy's list, so the schedule builders get the *copy layout*, one virtual rank per copy
(:func:`copy_layout`), which for a plan without tensor parallelism is the plan's own layout.

Between stages a message is a plain tensor, whole on every tensor rank (a row-wise layer's
all-reduce leaves its output whole). Tensor rank ``j`` of a receiving copy reads from tensor rank
``j mod t_prev`` of the producing copy; gradients go back the same way round: producer tensor rank
``j`` reads its output's gradient from receiver ``j mod t`` (:func:`partner`), and every rank sends
to each rank of the other stage that reads from it (:func:`fans`). With equal degrees that is rank
``j`` to rank ``j`` both ways.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.errors import RunError

__all__ = ["SHARD_LEVELS", "StageLayout", "copy_layout", "fans", "partner", "stage_layouts"]

SHARD_LEVELS = ("none", "optimizer", "gradients", "full")


@dataclass(frozen=True)
class StageLayout:
    """One stage's layout.

    Attributes:
        tensor_parallel: ``t``, the ranks one copy is split over.
        copies: ``d``, data-parallel copies (plan.json's ``replicas``).
        shard: what the copies share (:data:`SHARD_LEVELS`).
    """

    tensor_parallel: int = 1
    copies: int = 1
    shard: str = "none"

    @property
    def is_3d(self) -> bool:
        """Whether the stage needs more than today's replicated runtime."""
        return self.tensor_parallel > 1 or self.shard != "none"


def stage_layouts(
    plan: Mapping[str, Any], ranks: Sequence[Sequence[int]], where: str
) -> tuple[StageLayout, ...]:
    """Every stage's layout from plan.json (plain replicas where plan.json says nothing), checked
    against the ranks of mp_conf.json.

    Raises:
        RunError: a degree or shard level plan.json cannot mean, in one line naming the stage.
    """
    stages = plan.get("stages") or ()
    out = []
    for k, rs in enumerate(ranks):
        doc = stages[k] if k < len(stages) and isinstance(stages[k], Mapping) else {}
        t, shard = doc.get("tensor_parallel", 1), doc.get("shard", "none")
        if not isinstance(t, int) or isinstance(t, bool) or t < 1 or len(rs) % t:
            raise RunError(
                f"{where}: stage {k}'s tensor_parallel {t!r} must be a positive integer dividing its "
                f"{len(rs)} ranks"
            )
        if shard not in SHARD_LEVELS:
            raise RunError(f"{where}: stage {k}'s shard {shard!r} is not one of {', '.join(SHARD_LEVELS)}")
        layout = StageLayout(t, len(rs) // t, str(shard))
        if layout.shard != "none" and layout.copies < 2:
            raise RunError(
                f"{where}: stage {k} shards ({shard}) over {layout.copies} copy; it needs 2 or more"
            )
        if "sequence_parallel" in doc:
            raise RunError(f"{where}: stage {k} asks for sequence_parallel, which this runtime does not run")
        out.append(layout)
    return tuple(out)


def copy_layout(
    ranks: Sequence[Sequence[int]], layouts: Sequence[StageLayout]
) -> tuple[tuple[int, ...], ...]:
    """The layout the schedules play: one virtual rank per copy, numbered densely in the order of the
    copies' first ranks. Copies of two stages that share their first rank (interleaved's and zbv's
    several stages per rank) must share all their ranks, in the same order.

    Raises:
        RunError: two copies that start on one rank but hold different ranks.
    """
    groups: dict[int, tuple[int, ...]] = {}
    for k, (rs, lay) in enumerate(zip(ranks, layouts, strict=True)):
        t = lay.tensor_parallel
        for i in range(lay.copies):
            group = tuple(rs[i * t : (i + 1) * t])
            if groups.setdefault(group[0], group) != group:
                raise RunError(
                    f"stage {k}'s copy {i} on ranks {list(group)} starts on rank {group[0]} as another "
                    f"stage's copy on ranks {list(groups[group[0]])} does; such copies must be the same ranks"
                )
    dense = {lead: n for n, lead in enumerate(sorted(groups))}
    return tuple(
        tuple(dense[rs[i * lay.tensor_parallel]] for i in range(lay.copies))
        for rs, lay in zip(ranks, layouts, strict=True)
    )


def partner(ranks: Sequence[int], layout: StageLayout, copy: int, tensor_rank: int) -> int:
    """The one rank of the other stage's ``copy`` that this tensor rank reads from (activations
    from a producer, gradients from a consumer): its tensor rank ``tensor_rank mod t``."""
    t = layout.tensor_parallel
    return ranks[copy * t + tensor_rank % t]


def fans(ranks: Sequence[int], layout: StageLayout, copy: int, tensor_rank: int, own_t: int) -> list[int]:
    """The ranks of the other stage's ``copy`` that read from this tensor rank (of a stage of ``own_t``
    tensor ranks): those whose tensor rank is ``tensor_rank`` mod ``own_t``."""
    t = layout.tensor_parallel
    return [ranks[copy * t + j] for j in range(t) if j % own_t == tensor_rank]
