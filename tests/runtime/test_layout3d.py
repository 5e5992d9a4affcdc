"""A stage's 3D layout as the runtime reads it: plan.json's fields, the copy layout the schedules play,
and who sends to whom between stages of different tensor-parallel degrees."""

from __future__ import annotations

import pytest

from runtime.errors import RunError
from runtime.packages.layout3d import StageLayout, copy_layout, fans, partner, stage_layouts


def test_plans_without_3d_fields_read_as_replicas() -> None:
    plan = {"stages": [{"ranks": [0]}, {"ranks": [1, 2]}]}
    assert stage_layouts(plan, [(0,), (1, 2)], "plan.json") == (StageLayout(1, 1), StageLayout(1, 2))
    assert not any(lay.is_3d for lay in stage_layouts({}, [(0,), (1, 2)], "plan.json"))


@pytest.mark.parametrize(
    ("stage", "match"),
    [
        ({"tensor_parallel": 3}, "tensor_parallel 3 must be a positive integer dividing its 4 ranks"),
        ({"tensor_parallel": 4, "shard": "full"}, "shards \\(full\\) over 1 copy"),
        ({"shard": "zero9"}, "shard 'zero9' is not one of"),
        ({"tensor_parallel": 2, "sequence_parallel": True}, "sequence_parallel"),
    ],
)
def test_bad_stage_layouts_are_refused(stage: dict[str, object], match: str) -> None:
    with pytest.raises(RunError, match=match):
        stage_layouts({"stages": [{"ranks": [0, 1, 2, 3], **stage}]}, [(0, 1, 2, 3)], "plan.json")


def test_the_copy_layout_has_one_virtual_rank_per_copy() -> None:
    """PP2 x DP2 x TP2: 4 copies; zbv's V on TP2 copies: stages 0 and 3 on one copy, 1 and 2 on the other."""
    tp_dp = [StageLayout(2, 2)] * 2
    assert copy_layout([(0, 1, 2, 3), (4, 5, 6, 7)], tp_dp) == ((0, 1), (2, 3))
    v = [StageLayout(2, 1)] * 4
    assert copy_layout([(0, 1), (2, 3), (2, 3), (0, 1)], v) == ((0,), (1,), (1,), (0,))
    with pytest.raises(RunError, match="must be the same ranks"):
        copy_layout([(0, 1), (0, 2)], [StageLayout(2, 1)] * 2)


def test_tensor_ranks_pair_up_modulo_the_smaller_degree() -> None:
    """A TP4 stage after a TP2 one: receivers 0 and 2 read producer 0, 1 and 3 producer 1; producers
    read their gradients from receivers 0 and 1; every rank is someone's partner."""
    prev, nxt = StageLayout(2, 1), StageLayout(4, 1)
    producer, consumer = (0, 1), (2, 3, 4, 5)
    assert [partner(producer, prev, 0, j) for j in range(4)] == [0, 1, 0, 1]
    assert [fans(consumer, nxt, 0, j, own_t=2) for j in range(2)] == [[2, 4], [3, 5]]
    assert [partner(consumer, nxt, 0, j) for j in range(2)] == [2, 3]
    assert [fans(producer, prev, 0, j, own_t=4) for j in range(4)] == [[0], [1], [], []]
    assert partner((0, 1, 2, 3), StageLayout(1, 4), 2, 0) == 2  # a 2D stage: copy c is ranks[c]
