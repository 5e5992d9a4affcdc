"""The gradient all-reduce's buckets: what one collective copies into a flat buffer, and how long."""

from __future__ import annotations

import pytest
import torch

from runtime import comm
from runtime.comm import buckets
from runtime.memory import _LiveStorages


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


def test_one_buckets_flat_copy_is_gone_before_the_next_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two buckets of 400 and 320 kB beside 720 kB of gradients: at most one flat copy at a time
    (the loop once kept a bucket's copy alive while making the next one's: 720 kB here)."""
    monkeypatch.setattr(comm.dist, "all_reduce", lambda t, op=None, group=None: None)
    monkeypatch.setattr(comm, "BUCKET_BYTES", 400_000)
    grads = [torch.ones(10_000) for _ in range(18)]  # 40 kB each
    assert [len(r) for r in buckets(grads, comm.BUCKET_BYTES)] == [10, 8]
    counter = _LiveStorages()
    counter.add(grads)
    start = counter.level
    with counter:
        comm.Comm(None, torch.device("cpu")).all_reduce_sum(grads, None)  # type: ignore[arg-type]
    assert counter.peak - start == 400_000
    assert all(torch.equal(g, torch.ones(10_000)) for g in grads)
