"""Sends retired as soon as the schedule proves them received, and the gradient all-reduce's buckets:
what one collective copies into a flat buffer, and how long."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.executing import comm
from runtime.executing.comm import TensorMeta, buckets, decode_meta, encode_meta
from runtime.observing.peak_memory import _LiveStorages


def test_the_memory_model_prices_the_runtimes_bucket() -> None:
    """The memory model (no torch there) keeps its own copy of the bucket size it prices."""
    from partitioner.optimizer.pricing import memory

    assert memory.BUCKET_BYTES == comm.BUCKET_BYTES


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


class _Work:
    """A send or receive handle that keeps its tensors, as gloo's do, until waited for."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors, self.waited = tensors, False

    def wait(self) -> bool:
        self.waited, self.tensors = True, []
        return True


def _batched(monkeypatch: pytest.MonkeyPatch, coalesce: bool, made: list[_Work]) -> None:
    """Point-to-point batches without a process group: one handle per operation, or one for all."""
    monkeypatch.setattr(
        comm.dist, "P2POp", lambda op, tensor, peer, group, tag: SimpleNamespace(tensor=tensor)
    )

    def batch(ops):  # type: ignore[no-untyped-def]
        works = [_Work([op.tensor for op in ops])] if coalesce else [_Work([op.tensor]) for op in ops]
        made.extend(works)
        return works

    monkeypatch.setattr(comm.dist, "batch_isend_irecv", batch)


def test_an_activation_send_ends_when_its_gradient_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Units 3 and 4 sent to rank 1 (stream 5): unit 3's gradient back from rank 1 on that stream ends
    unit 3's send and no other; a gradient send waits for its era."""
    made: list[_Work] = []
    _batched(monkeypatch, False, made)
    c = comm.Comm(None, torch.device("cpu"), prefetch=True)  # type: ignore[arg-type]
    c.send([(1, [torch.ones(4)])], [5], [(1, 5, 3)])
    c.send([(1, [torch.ones(4)])], [5], [(1, 5, 4)])
    c.send([(0, [torch.ones(4)])], [6])  # a gradient: no unit
    c.answered(1, 6, 3)  # another stream
    c.answered(2, 5, 3)  # another peer
    assert [w.waited for w in made] == [False, False, False] and len(c.pending) == 3
    c.answered(1, 5, 3)
    assert [w.waited for w in made] == [True, False, False] and not made[0].tensors
    assert [s.work for s in c.pending] == made[1:]
    c.era = 1
    c.retire(1)  # the gradient (era 0) goes with unit 4's activation, whatever their answers
    assert all(w.waited for w in made) and not c.pending


def test_a_batch_coalesced_into_one_handle_is_waited_for_its_receives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL returns one handle for a batch of sends and receives: waiting for the receives is
    waiting for it (taken as a send handle alone, the received buffers would be read unfilled)."""
    made: list[_Work] = []
    _batched(monkeypatch, True, made)
    c = comm.Comm(None, torch.device("cpu"), hold=True)  # type: ignore[arg-type]
    c.send([(1, [torch.ones(4)])], answers=[(1, 0, 0)])
    assert c.outbox and not made  # held for the next receive
    (buf,) = c.recv([(1, (TensorMeta((2,), torch.float32),))])[0]
    assert len(made) == 1 and made[0].waited and buf.shape == (2,)
    assert [s.work for s in c.pending] == made and not c.pending[0].answers  # retired by era alone


def test_a_meta_says_whether_its_tensor_needs_a_gradient_and_keeps_it_across_ranks() -> None:
    """A float its producer computed from weights needs a gradient back; one from buffers alone, or
    an integer, does not; the flag survives the start-up exchange (metas of an older peer: needed)."""
    w = torch.ones(3, requires_grad=True)
    metas = (TensorMeta.of(w * 2), TensorMeta.of(torch.ones(3) * 2), TensorMeta.of(torch.ones(3).long()))
    assert [m.needs_grad for m in metas] == [True, False, False]
    assert decode_meta(encode_meta(metas)) == metas
    assert decode_meta('[[[3], "float32"]]') == (TensorMeta((3,), torch.float32, True),)
