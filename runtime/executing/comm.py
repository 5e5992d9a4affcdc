"""Point-to-point and group communication of one rank, on process groups it is given.

Activations and gradients travel with ``isend``/``irecv`` (batched with ``batch_isend_irecv``) between
the ranks that run neighbouring (or skip-connected) stages. Shapes are agreed once at start-up by
:meth:`Comm.exchange_meta`; afterwards a message is just its tensors. Sends never block the sender:
their handles are kept and retired later, so a valid schedule cannot deadlock on a send. Replica and
tie gradients are summed with one all-reduce per bucket of at most ``BUCKET_BYTES`` (DDP's default
size), so the flat copy a rank makes beside its gradients stays small.

A send is retired (waited for, which frees its tensor) as soon as the schedule proves it was
received, as gloo never reports a send complete before ``wait()``: an activation once its unit's
gradient has come back from that peer, a pipedream gradient once the peer's next forward arrives
(:meth:`Comm.answered`), and any other send at the step that ends its minibatch (flushing
schedules) or some steps later (pipedream with replicas; :meth:`Comm.retire`).

Two ways to receive. On gloo (``prefetch``) the executor posts an action's receives one receiving
action ahead, so the transfer runs on gloo's own threads while this rank computes: gloo moves a
payload only once the receiver has posted its buffer, so a receive posted at the moment of need
pays a round of wake-ups (several milliseconds on a loaded CPU) even when the sender finished long
ago. On NCCL receives are posted when needed, batched with the held sends (see :meth:`Comm.recv`).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from runtime.errors import PeerLost

__all__ = [
    "BUCKET_BYTES",
    "Answer",
    "Comm",
    "Posted",
    "Sent",
    "TensorMeta",
    "buckets",
    "decode_meta",
    "encode_meta",
    "peer_errors",
]

BUCKET_BYTES = 25 * 2**20
"""Most bytes one gradient all-reduce copies into a flat buffer (DDP's default bucket)."""


def buckets(tensors: Sequence[torch.Tensor], most: int) -> list[list[torch.Tensor]]:
    """``tensors`` by dtype, in order, cut into runs of at most ``most`` bytes (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        run: list[torch.Tensor] = []
        size = 0
        for t in (t for t in tensors if t.dtype == dtype):
            nbytes = t.numel() * t.element_size()
            if run and size + nbytes > most:
                out.append(run)
                run, size = [], 0
            run.append(t)
            size += nbytes
        out.append(run)
    return out


def _sum_bucket(bucket: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """One all-reduce of a :func:`buckets` bucket, in place: a lone contiguous tensor itself, several
    through a flat copy that is dropped on return. (Made in a loop over the buckets, the copy of one
    bucket lived on while the next one's was made: resnet18's 25 and 20 MiB buckets held 45 MiB at
    once beside its 45 MiB of gradients.)"""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        dist.all_reduce(bucket[0], op=dist.ReduceOp.SUM, group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in bucket])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@contextmanager
def peer_errors(what: str) -> Iterator[None]:
    """Re-raise a failed distributed call as :class:`PeerLost`, so the launcher can tell the rank that
    broke from the ranks that merely lost it."""
    try:
        yield
    except RuntimeError as exc:
        raise PeerLost(f"{what} failed, another rank is gone or stuck: {str(exc).splitlines()[0]}") from exc


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor that crosses ranks, and whether its producer's autograd graph
    reaches it (``grad``: the producer's output required a gradient)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool = True

    @property
    def needs_grad(self) -> bool:
        """Whether a gradient goes back for it: a floating-point tensor its producer computed from
        something that needs one. A tensor made from buffers alone (a rotary embedding's cos and
        sin) needs none: its consumer would keep what multiplies it and send back a gradient
        nobody uses."""
        return self.dtype.is_floating_point and self.grad

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)


def encode_meta(metas: Sequence[TensorMeta]) -> str:
    return json.dumps([[list(m.shape), str(m.dtype).removeprefix("torch."), m.grad] for m in metas])


def decode_meta(text: str) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(tuple(s), getattr(torch, d), *grad) for s, d, *grad in json.loads(text))


def _tags(tags: Sequence[int], messages: Sequence[object]) -> Sequence[int]:
    return tags or [0] * len(messages)


Answer = tuple[int, int, int]
"""(peer, tag, unit): the message from ``peer`` on stream ``tag`` for ``unit`` whose arrival proves a send
arrived (an activation's: its gradient; under pipedream, a gradient's: the peer's next forward)."""


@dataclass
class Sent:
    """A posted send (or, on a backend that coalesces a batch into one handle, several).

    Attributes:
        era: the step it was posted in (:meth:`Comm.retire`).
        work: its handle; waiting for it releases the tensors it sends.
        answers: the messages (:data:`Answer`) still to arrive that prove its sends were received;
            retired once the last arrives. Empty: retired by era alone (a send nothing answers, or
            a batch coalesced into one handle).
    """

    era: int
    work: dist.Work
    answers: set[Answer] = field(default_factory=set)


@dataclass(frozen=True)
class Posted:
    """Receives of one action, posted and not yet waited for; ``local``: (message index, tag) of the
    messages this rank sends itself, taken from its loopback when waited for."""

    bufs: list[list[torch.Tensor]]
    works: list[dist.Work]
    peers: tuple[int, ...]
    local: tuple[tuple[int, int], ...] = ()


@dataclass
class Comm:
    """One rank's channels.

    Attributes:
        group: the group point-to-point messages use (ranks are global ranks within it).
        device: where received tensors are allocated (CPU for gloo, the rank's GPU for nccl).
        prefetch: receives are posted ahead of need (gloo) and sends are never held.
        pending: sends not yet retired, oldest first; gloo never reports a send complete before
            ``wait()``, so completion is inferred from the schedule (:meth:`answered`, :meth:`retire`).
        era: the optimizer steps this rank has taken, stamped on each send.
        peak_pending: the most sends ever held in ``pending`` (bounded when :meth:`retire` is called).
        seconds: time spent blocked in receives, waits and all-reduces.
        hold: keep new sends in ``outbox`` until the next receive posts them together with it.
        outbox: sends not yet posted.
        loopback: per tag, messages this rank sent itself and has not yet received (``interleaved``:
            a tensor skipping from one of its stages to another of them), oldest first.
        loopback_meta: per tag, the metas this rank told itself at start-up.
    """

    group: dist.ProcessGroup
    device: torch.device
    prefetch: bool = False
    pending: deque[Sent] = field(default_factory=deque)
    era: int = 0
    peak_pending: int = 0
    seconds: float = 0.0
    hold: bool = False
    outbox: list[tuple[dist.P2POp, Answer | None]] = field(default_factory=list)
    loopback: dict[int, deque[list[torch.Tensor]]] = field(default_factory=dict)
    loopback_meta: dict[int, tuple[TensorMeta, ...]] = field(default_factory=dict)

    @property
    def me(self) -> int:
        """This rank (in ``group``, whose ranks are the global ones)."""
        return dist.get_rank() if dist.is_initialized() else -1

    def exchange_meta(self, recv_from: Sequence[int]) -> dict[int, tuple[TensorMeta, ...]]:
        """Receive, from each peer, the metas of the tensors it will send (start-up only)."""
        out = {}
        for peer in recv_from:
            out[peer] = self._recv_meta(peer)
        return out

    def _recv_meta(self, peer: int, tag: int = 0) -> tuple[TensorMeta, ...]:
        with peer_errors(f"start-up receive from rank {peer}"):
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.recv(size, src=peer, group=self.group, tag=tag)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
            dist.recv(buf, src=peer, group=self.group, tag=tag)
        return decode_meta(bytes(buf.cpu().tolist()).decode())

    def recv_meta(self, peer: int, tag: int) -> tuple[TensorMeta, ...]:
        """The metas ``peer`` sends on stream ``tag`` (start-up only; see :meth:`send_meta`)."""
        if peer == self.me:
            if tag not in self.loopback_meta:
                raise RuntimeError(f"internal: stream {tag} of this rank read before it was written")
            return self.loopback_meta.pop(tag)
        return self._recv_meta(peer, tag)

    def send_meta(self, peer: int, metas: Sequence[TensorMeta], tag: int = 0) -> None:
        """Tell ``peer`` what this rank will send it (start-up only). With a ``tag`` (a rank hosting
        several stages) the send does not block: the peer may be busy with another of its stages;
        :meth:`drain` waits for it."""
        if peer == self.me:
            self.loopback_meta[tag] = tuple(metas)
            return
        data = torch.tensor(list(encode_meta(metas).encode()), dtype=torch.uint8, device=self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        with peer_errors(f"start-up send to rank {peer}"):
            if tag:
                self._keep([dist.isend(t, peer, self.group, tag) for t in (size, data)], [None, None])  # type: ignore[misc]
                return
            dist.send(size, peer, self.group)
            dist.send(data, peer, self.group)

    def send(
        self, messages: Sequence[tuple[int, Sequence[torch.Tensor]]], tags: Sequence[int] = (),
        answers: Sequence[Answer | None] = (),
    ) -> None:  # fmt: skip
        """Post sends of each (peer, tensors) message, or hold them for the next :meth:`recv` when
        ``hold`` is set; returns at once either way. ``tags``: one per message (default 0), for ranks
        that exchange several streams at once (``interleaved``: a rank hosts several stages). A message
        to this rank itself goes to its loopback as detached copies (no process group sends to itself).
        ``answers``: one per message, what retires its send when :meth:`answered` (default: its era)."""
        me = self.me
        for (peer, tensors), tag, answer in zip(
            messages, _tags(tags, messages), answers or [None] * len(messages), strict=True
        ):
            if peer == me:
                self.loopback.setdefault(tag, deque()).append([t.detach().clone() for t in tensors])
                continue
            self.outbox.extend(
                (dist.P2POp(dist.isend, t.detach().contiguous(), peer, self.group, tag), answer)
                for t in tensors
            )
        if not self.hold or self.prefetch:
            self.flush()

    def flush(self) -> None:
        """Post the held sends."""
        if self.outbox:
            held, self.outbox = self.outbox, []
            with peer_errors("send"):
                self._keep(dist.batch_isend_irecv([op for op, _ in held]), [a for _, a in held])

    def post(self, messages: Sequence[tuple[int, Sequence[TensorMeta]]], tags: Sequence[int] = ()) -> Posted:
        """Post receives of each (peer, metas) message (with the held sends, if any) and return at
        once; :meth:`wait` collects them. ``tags`` as in :meth:`send`."""
        me, tagged = self.me, _tags(tags, messages)
        local = tuple(
            (i, tag) for i, ((peer, _), tag) in enumerate(zip(messages, tagged, strict=True)) if peer == me
        )
        bufs = [
            [] if peer == me else [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
            for peer, metas in messages
        ]
        ops = [
            dist.P2POp(dist.irecv, buf, peer, self.group, tag)
            for (peer, _), tensors, tag in zip(messages, bufs, tagged, strict=True)
            for buf in tensors
        ]
        peers = tuple(sorted({p for p, _ in messages}))
        if not ops:
            self.flush()
            return Posted(bufs, [], peers, local)
        held, self.outbox = self.outbox, []
        with peer_errors(f"receive from rank(s) {list(peers)}"):
            works = dist.batch_isend_irecv([op for op, _ in held] + ops)
        if len(works) != len(held) + len(ops):  # one handle for the batch (NCCL coalesces it)
            self._keep(works, [None] * len(works))
            return Posted(bufs, works, peers, local)
        self._keep(works[: len(held)], [a for _, a in held])
        return Posted(bufs, works[len(held) :], peers, local)

    def _keep(self, works: Sequence[dist.Work], answers: Sequence[Answer | None]) -> None:
        """Hold send handles until retired: one per send, each with its answer if any, or (a batch
        coalesced into fewer handles) retired by era alone."""
        if len(works) != len(answers):
            answers = [None] * len(works)
        self.pending.extend(
            Sent(self.era, w, set() if a is None else {a}) for w, a in zip(works, answers, strict=True)
        )
        self.peak_pending = max(self.peak_pending, len(self.pending))

    def answered(self, peer: int, tag: int, unit: int) -> None:
        """The message of ``unit`` from ``peer`` on stream ``tag`` arrived: the sends it answers
        (:data:`Answer`) were received, so they end now, freeing their tensors. A stage output stays
        alive until its backward anyway; without this its send kept it for another step (pipedream:
        ``2 (world + 1)`` steps), and a pipedream gradient for as long."""
        answer, kept = (peer, tag, unit), deque[Sent]()
        with peer_errors("waiting for sends"):
            for sent in self.pending:
                if answer in sent.answers:
                    sent.answers.discard(answer)
                    if not sent.answers:
                        sent.work.wait()
                        continue
                kept.append(sent)
        self.pending = kept

    def wait(self, posted: Posted) -> list[list[torch.Tensor]]:
        """Block until the posted receives have arrived; returns their tensors per message."""
        start = time.perf_counter()
        with peer_errors(f"receive from rank(s) {list(posted.peers)}"):
            for work in posted.works:
                work.wait()
        self.seconds += time.perf_counter() - start
        for index, tag in posted.local:  # (the sending stage ran earlier in this rank's list)
            if not self.loopback.get(tag):
                raise RuntimeError(f"internal: stream {tag} of this rank read before it was written")
            posted.bufs[index] = self.loopback[tag].popleft()
        return posted.bufs

    def recv(
        self, messages: Sequence[tuple[int, Sequence[TensorMeta]]], tags: Sequence[int] = ()
    ) -> list[list[torch.Tensor]]:
        """Receive each (peer, metas) message, posted in one batch with the held sends (as Megatron's
        send_backward_recv_forward: on NCCL a send waiting in the stream ahead of a receive can
        deadlock two stages that each wait for the other's receive); blocks until all have arrived."""
        start = time.perf_counter()
        posted = self.post(messages, tags)
        self.seconds += time.perf_counter() - start
        return self.wait(posted)

    def retire(self, before_era: int) -> None:
        """Wait for (and free) the sends stamped with an era before ``before_era``. The caller picks an
        era whose sends every receiver has provably taken, so the waits return at once; without this
        every sent tensor of a segment would stay alive until :meth:`drain`."""
        with peer_errors("waiting for sends"):
            while self.pending and self.pending[0].era < before_era:
                self.pending.popleft().work.wait()

    def drain(self) -> None:
        """Post held sends and wait for all of them (end of a segment, when every receiver will post)."""
        self.hold = False
        self.flush()
        start = time.perf_counter()
        with peer_errors("waiting for sends"):
            for sent in self.pending:
                sent.work.wait()
        self.pending.clear()
        self.seconds += time.perf_counter() - start

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
        """Sum ``tensors`` in place across ``group``, one collective per :func:`buckets` bucket: a
        bucket of one tensor is reduced in place, several through one flat buffer, so the copy a
        rank holds beside its gradients is at most ``BUCKET_BYTES`` (gpt2's 147 MiB tied head once
        needed a second 147 MiB)."""
        start = time.perf_counter()
        for bucket in buckets(tensors, BUCKET_BYTES):
            with peer_errors("gradient all-reduce"):
                _sum_bucket(bucket, group)
        self.seconds += time.perf_counter() - start
