"""The gradient all-reduce's buckets: what one collective copies into a flat buffer."""

from __future__ import annotations

import torch

from runtime.comm import buckets


def test_buckets_keep_order_split_by_dtype_and_size() -> None:
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(30)  # 40, 40 and 120 bytes
    half = torch.zeros(4, dtype=torch.float16)
    got = buckets([a, half, b, c], 80)
    assert [[t.numel() for t in run] for run in got] == [[4], [10, 10], [30]]  # float16 sorts first
    assert got[1][0] is a and got[1][1] is b
    assert buckets([c], 80) == [[c]]  # a tensor over the size goes alone, reduced in place


def test_every_tensor_is_in_one_bucket() -> None:
    tensors = [torch.zeros(n) for n in (1, 7, 3, 50, 2, 2, 9)]
    got = buckets(tensors, 40)
    assert [t for run in got for t in run] == tensors
    assert all(sum(t.numel() * 4 for t in run) <= 40 or len(run) == 1 for run in got)
