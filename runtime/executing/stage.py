"""StageRuntime: the one executor that plays a rank's action list, whatever the schedule.

``F`` receives the stage's inputs (or reads data on the first stage), runs the stage, sends each
output to the replica of every consumer stage that handles that microbatch
(``Schedule.replica_of``), and on the last stage
computes the loss scaled by the microbatch's share of the minibatch (so gradients are the minibatch
mean, as in plain training). ``B`` receives output gradients (summed over consumers), runs autograd
and sends input gradients back. Under a zero-bubble schedule (a list with ``W`` actions), ``B``
computes only the input gradients (``torch.autograd.grad`` with ``retain_graph``) and sends them at
once; ``W`` later takes the weight gradients from the retained graph, adds them to ``.grad`` and
frees the graph (:mod:`runtime.executing.split_backward`: W does only the weight half, not the backward
again). ``S`` sums gradients over the replica group and over tie groups,
clips them by the whole model's norm (an all-reduce over every rank, :mod:`runtime.executing.optimizer`), then
steps the optimizer and the learning-rate schedule.

Under ``interleaved`` a rank hosts several stages (Megatron's virtual stages): one StageRuntime per
stage, sharing the rank's ``comm``, and the first plays the rank's one list, handing each action to
the runtime of its stage (``play(..., hosted=...)``). Two ranks then exchange several streams at
once, in orders their lists need not share, so every (producer, consumer, direction) gets a tag.

Replicas under ``pipedream`` are PipeDream's data parallelism: each replica runs whole minibatches
(round-robin) and steps once per round; its step all-reduces the gradients of the round's
minibatches, which every replica computed on the same weight version, and takes their mean (as
PipeDream's DistributedDataParallel does). The synchronous schedules split a minibatch's
microbatches over the replicas instead, whose summed gradients are already the minibatch mean.

Mixed precision (:mod:`runtime.precision`): under ``bf16`` or ``fp16`` every forward and the loss run
under autocast; weights, gradients and optimizer state stay float32. Under ``fp16`` the last stage
scales its loss by a :class:`runtime.executing.loss_scale.LossScaler`'s factor, and ``S`` first unscales this
rank's gradients and agrees with every rank on an overflow: all of them skip that step together.

Weight stashing (``pipedream``): a forward runs on a snapshot of the weights of its version (taken
once per version, as PipeDream keeps one copy per version in flight) through
``torch.func.functional_call``; the autograd graph holds that snapshot, so the backward uses the very
weights of its forward while the optimizer updates the live parameters in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from runtime.executing.comm import Answer, Comm, Posted, TensorMeta
from runtime.executing.lookahead import Lookahead, steps_before_backward
from runtime.executing.loss_scale import LossScaler
from runtime.executing.mesh import StageMesh
from runtime.executing.optimizer import Clip, clip_grads
from runtime.executing.recompute import run_forward
from runtime.executing.split_backward import WeightWork, backward_input, backward_weight
from runtime.observing.metrics import Recorder
from runtime.observing.peak_memory import local
from runtime.packages.job_config import RankConfig
from runtime.packages.layout3d import fans, partner
from runtime.packages.load import Wiring
from runtime.precision import autocast
from runtime.schedule import Action, Schedule, get_schedule, warmup

__all__ = ["LOOKAHEAD", "STASH_LOG_MAX", "Batches", "Groups", "StageRuntime", "Unit"]


class Batches(Protocol):
    """A source of minibatches addressed by global step."""

    steps_per_epoch: int

    def inputs(self, step: int) -> tuple[torch.Tensor, ...]: ...

    def targets(self, step: int) -> torch.Tensor: ...


STASH_LOG_MAX = 1000
"""Backwards per rank whose (unit, forward version, version at backward) go into metrics.json."""

LOOKAHEAD = 4096
"""Actions ahead of the one playing that are searched for the next one that receives (its receives
are posted early); one further away is posted when it comes that close."""


def _functional(module: nn.Module, params: dict[str, torch.Tensor], *args: torch.Tensor) -> Any:
    """Run ``module`` on ``params`` instead of its own parameters (buffers stay the module's)."""
    return torch.func.functional_call(module, params, args)


@dataclass(frozen=True)
class Groups:
    """Collective groups of this rank: its stage's replicas, and one group per tie it holds.

    Attributes:
        replicas: the replica group (None when the stage has one replica).
        ties: (group, parameter name in this stage) for every tie this stage holds.
        rank_ties: under ``interleaved`` (a rank hosts several stages, and ``ties`` is empty): per
            tie this rank holds, the group of every rank holding it (None: this rank alone) and the
            (stage, parameter name) members this rank hosts; the rank's first chunk sums them.
        meshes: per 3D stage this rank runs, its data and tensor groups and DeviceMesh
            (:mod:`runtime.executing.mesh`).
        sharded: the stage's copies shard their gradients (FSDP2 reduces them): the replica group
            then sums only the losses.
    """

    replicas: dist.ProcessGroup | None
    ties: tuple[tuple[dist.ProcessGroup, str], ...] = ()
    rank_ties: tuple[tuple[dist.ProcessGroup | None, tuple[tuple[int, str], ...]], ...] = ()
    meshes: dict[int, StageMesh] = field(default_factory=dict)
    sharded: bool = False


@dataclass
class Unit:
    """A microbatch between its forward and its backward on this rank."""

    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None
    version: int
    stashed: bool = False


@dataclass
class StageRuntime:
    """Plays one rank's actions. Build it, call :meth:`setup` once, then :meth:`play` per segment.

    Attributes:
        cfg: this rank's role.
        wiring: tensor names in and out of every stage.
        module: this rank's stage.
        criterion: the loss (last stage only).
        optimizer: steps ``module``'s parameters.
        comm: point-to-point channels.
        groups: collective groups.
        batches: minibatches by step.
        stash: keep a weight version per forward (pipedream).
        recorder: timing and trace spans.
        scheduler: the learning-rate schedule, stepped once per minibatch a step covers.
        clip: global gradient-norm clipping; None: none.
        on_step: called after every optimizer step with the minibatches it covered and, on the
            last stage, their losses (None elsewhere).
        precision: fp32, bf16 or fp16: forwards and the loss run under autocast to the latter two.
        scaler: fp16's dynamic loss scale (None otherwise).
        overflow_steps: steps (1-based) whose gradients on this rank held an inf or nan (fp16).
        skipped_steps: steps (1-based) every rank skipped because some rank found an overflow (fp16).
        units: microbatches between their forward and backward.
        version: optimizer steps taken (the weight version new forwards use).
        versions: weight snapshots still referenced by a unit in flight (pipedream).
        stash_log: (unit, version its forward and backward used, version current at its backward) for
            the first STASH_LOG_MAX backwards under pipedream: the evidence of weight stashing.
        step_versions: (step, forward versions of the units whose gradients it applies) for the first
            STASH_LOG_MAX steps under pipedream: replicas of one step must name one version.
        versions_in_flight_max: the most distinct weight versions held by units between their forward
            and backward (the cost model's ``in_flight`` for pipedream).
        first_step: the first minibatch of the segment being played (pipedream's round-robin origin).
        pending: units whose B has run and whose W has not (zero-bubble schedules): what W needs.
        chunks: under ``interleaved``, on the rank's first chunk: every chunk of the rank. Its step
            does the rank's once-per-step work over all their gradients (all their backwards come
            before the rank's first step): fp16's unscale and overflow vote, and clipping. Empty:
            this stage's own gradients.
        lead: under ``interleaved``, on the rank's other chunks: the first chunk, whose step decided
            whether this step is skipped (fp16); they neither unscale nor clip.
        skipping: whether the step being taken is skipped for an overflow (read by ``lead``'s chunks).
        ends_minibatch: whether this runtime's step ends its rank's minibatch, and so marks the
            recorder's step: always, but under ``interleaved`` only the rank's last chunk's step does
            (its chunks share one recorder).
    """

    cfg: RankConfig
    wiring: Wiring
    module: nn.Module
    criterion: nn.Module | None
    optimizer: torch.optim.Optimizer
    comm: Comm
    groups: Groups
    batches: Batches
    stash: bool
    recorder: Recorder
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    clip: Clip | None = None
    on_step: Callable[[tuple[int, ...], tuple[float, ...] | None], None] | None = None
    precision: str = "fp32"
    scaler: LossScaler | None = None
    overflow_steps: list[int] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    units: dict[int, Unit] = field(default_factory=dict)
    version: int = 0
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    stash_log: list[tuple[int, int, int]] = field(default_factory=list)
    step_versions: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    versions_in_flight_max: int = 0
    first_step: int = 0
    _step_units: list[int] = field(default_factory=list)
    step_loss: torch.Tensor | None = None
    _step_losses: torch.Tensor | None = None
    in_meta: dict[int, tuple[TensorMeta, ...]] = field(default_factory=dict)
    out_meta: dict[str, TensorMeta] = field(default_factory=dict)
    _batch_cache: dict[str, tuple[int, tuple[torch.Tensor, ...]]] = field(default_factory=dict)
    _inbox: dict[tuple[str, int], Posted] = field(default_factory=dict)
    pending: dict[int, WeightWork] = field(default_factory=dict)
    ends_minibatch: bool = True
    chunks: tuple[StageRuntime, ...] = ()
    lead: StageRuntime | None = None
    skipping: bool = False
    before_backward: Callable[[int], None] | None = None
    before_step: Callable[[], None] | None = None
    _synced: list[float] = field(default_factory=list)

    # ------------------------------------------------------------------ routing
    @functools.cached_property
    def schedule(self) -> Schedule:
        """The job's schedule (:data:`runtime.schedule.REGISTRY`)."""
        return get_schedule(self.cfg.job.schedule)

    @functools.cached_property
    def producers(self) -> dict[int, tuple[str, ...]]:
        """Earlier stages this stage reads from, with the tensor names read from each."""
        return self.wiring.producers(self.cfg.stage)

    @functools.cached_property
    def consumers(self) -> dict[int, tuple[str, ...]]:
        """Later stages that read this stage's outputs, with the names each reads."""
        return self.wiring.consumers(self.cfg.stage)

    @functools.cached_property
    def _send_lag(self) -> int:
        """Optimizer steps after which every send of this rank has surely been received. A flushing
        schedule's steps end every rank's list of the minibatch (every builder puts them last), so
        at its step a rank has posted all its sends of the minibatch and none of its receivers needs
        anything more from it to take them: waiting for them there cannot deadlock, and costs no
        time, as this rank's next receive comes from a peer that must have finished the minibatch
        (taken this rank's gradients) first. Under pipedream a chain of single-replica stages needs
        2: stage s's gradient of minibatch n goes in its step n, stage s-1 takes it in its backward
        of n and only then runs its forward of n + w_s + 1 (w: the minibatches a stage runs ahead,
        one more upstream), which this rank receives in its step n + 2. With replicas the rounds
        interleave; there it keeps the bound of world-size minibatches in flight, doubled for
        margin. (Activations go earlier: :meth:`Comm.answered`.)"""
        if not self.stash:
            return 0
        return 2 if self._single_replicas else 2 * (self.cfg.job.world_size + 1)

    @functools.cached_property
    def _single_replicas(self) -> bool:
        """No stage of the job has replicas: pipedream's rounds are one minibatch each."""
        return all(len(ranks) == 1 for ranks in self.cfg.job.stage_ranks)

    def _tag(self, producer: int, consumer: int, grads: bool) -> int:
        """The stream of messages between two stages, one way. 0 (untagged) when every rank runs one
        stage: then two ranks exchange one stream each way, in unit order. A rank that hosts several
        stages (``interleaved``) talks to a peer for several pairs of stages, in an order the two
        ranks' lists need not share, so each pair and direction gets its own tag."""
        job = self.cfg.job
        return 1 + 2 * (producer * job.stages + consumer) + grads if job.virtual_stages > 1 else 0

    def _peer(self, stage: int, unit: int) -> int:
        """The rank of ``stage`` that ``unit``'s tensors come from
        (:func:`runtime.packages.layout3d.partner`)."""
        ranks, job = self.cfg.job.stage_ranks[stage], self.cfg.job
        layout = job.layout(stage)
        copy = self.schedule.replica_of(unit, job.microbatches, layout.copies, self.first_step)
        return partner(ranks, layout, copy, self.cfg.tensor_rank)

    def _fans(self, stage: int, unit: int) -> list[int]:
        """The ranks of ``stage`` that read ``unit``'s tensors from this rank (one without tensor
        parallelism: :func:`runtime.packages.layout3d.fans`)."""
        ranks, job = self.cfg.job.stage_ranks[stage], self.cfg.job
        layout = job.layout(stage)
        copy = self.schedule.replica_of(unit, job.microbatches, layout.copies, self.first_step)
        return fans(ranks, layout, copy, self.cfg.tensor_rank, self.cfg.layout.tensor_parallel)

    def _micro(self, kind: str, unit: int) -> tuple[torch.Tensor, ...]:
        """Microbatch ``unit`` of the minibatch's inputs or targets (split along dim 0)."""
        step, j = divmod(unit, self.cfg.job.microbatches)
        cached = self._batch_cache.get(kind)
        if cached is None or cached[0] != step:
            whole = self.batches.inputs(step) if kind == "inputs" else (self.batches.targets(step),)
            whole = tuple(t.to(self.comm.device) for t in whole)
            self._batch_cache[kind] = cached = (step, whole)
        return tuple(torch.tensor_split(t, self.cfg.job.microbatches)[j] for t in cached[1])

    # ------------------------------------------------------------------ start-up
    def setup(self) -> None:
        """Agree on the shapes of every message once: receive producers' metas, run one forward, tell
        consumers. Replica 0 of each stage speaks for its stage."""
        me = self.cfg.stage
        producers, first = self.producers, {k: self.cfg.job.stage_ranks[k][0] for k in self.producers}
        if self.cfg.job.virtual_stages > 1:
            self.in_meta = {k: self.comm.recv_meta(first[k], self._tag(k, me, False)) for k in producers}
        else:
            got = self.comm.exchange_meta(list(first.values()))
            self.in_meta = {k: got[first[k]] for k in producers}
        named: dict[str, torch.Tensor] = {}
        if self.cfg.is_first:
            named.update(zip(self.wiring.stage_inputs[me], self._micro("inputs", 0), strict=True))
        for k, names in producers.items():
            for name, meta in zip(names, self.in_meta[k], strict=True):
                named[name] = torch.zeros(
                    meta.shape, dtype=meta.dtype, device=self.comm.device, requires_grad=meta.needs_grad
                )
        with torch.enable_grad():  # (which outputs need a gradient, as in training: TensorMeta.grad)
            outs = self._run(named, None)
        self.out_meta = {n: TensorMeta.of(t) for n, t in outs.items() if isinstance(t, torch.Tensor)}
        if self.cfg.leads:
            for k, names in self.consumers.items():
                for peer in self.cfg.job.stage_ranks[k]:
                    self.comm.send_meta(peer, [self.out_meta[n] for n in names], self._tag(me, k, False))

    def run_stage(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stage on named inputs with its live weights, outputs by name (forward-only evaluation)."""
        return self._run(named, None)

    def _run(
        self, named: dict[str, torch.Tensor], params: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        args = tuple(named[n] for n in self.wiring.stage_inputs[self.cfg.stage])
        call = self.module if params is None else functools.partial(_functional, self.module, params)
        with autocast(self.precision, self.comm.device):
            out = run_forward(call, args, self.cfg.recompute)
        names = self.wiring.stage_outputs[self.cfg.stage]
        outs = (out,) if len(names) == 1 else tuple(out)
        return dict(zip(names, outs, strict=True))

    # ------------------------------------------------------------------ actions
    def play(
        self, actions: Iterable[Action], first_step: int = 0, hosted: Sequence[StageRuntime] = ()
    ) -> None:
        """Run ``actions`` (a segment starting at minibatch ``first_step``, read as it plays) in
        order, then wait for this rank's outstanding sends. ``hosted``: every stage this rank runs
        (``interleaved``: its chunks, sharing this runtime's ``comm``); each action goes to the
        runtime of its stage."""
        owners = {rt.cfg.stage: rt for rt in hosted} or {self.cfg.stage: self}
        for rt in owners.values():
            rt.first_step = first_step
        stream, scanned, i = Lookahead(actions), (0, -1), 0
        while (action := stream[i]) is not None:
            if self.comm.prefetch:  # this action's receives and the next receiving action's in flight
                scanned = self._prefetch(stream, owners, i, *scanned)
            else:  # an action's sends ride with the next action's receives when it has any
                following = stream[i + 1]
                self.comm.hold = following is not None and owners[following.stage]._receives(following)
            owner = owners[action.stage]
            if action.kind == "F":
                owner.forward(action.index, owner.stash and steps_before_backward(stream, i))
            else:
                {"B": owner.backward, "W": owner.weights, "S": owner.step}[action.kind](action.index)
            stream.forget(i + 1)
            i += 1
        self.comm.drain()

    def _prefetch(
        self, stream: Lookahead, owners: dict[int, StageRuntime], i: int, scanned: int, last: int
    ) -> tuple[int, int]:
        """Post the receives of every action up to the first receiving one after ``i`` (searched at
        most :data:`LOOKAHEAD` actions ahead). ``scanned``: the actions before it are posted;
        ``last``: the last one posted. Returns both, moved on."""
        while last <= i and scanned <= i + LOOKAHEAD and (ahead := stream[scanned]) is not None:
            owner = owners[ahead.stage]
            if owner._receives(ahead):
                owner._inbox[(ahead.kind, ahead.index)] = self.comm.post(*owner._incoming(ahead))
                last = scanned
            scanned += 1
        return scanned, last

    def _receives(self, action: Action) -> bool:
        return bool(self.producers if action.kind == "F" else self.consumers if action.kind == "B" else False)

    def _incoming(self, action: Action) -> tuple[list[tuple[int, tuple[TensorMeta, ...]]], list[int]]:
        """(peer, metas) of every message ``action`` receives (producers' outputs for a forward,
        consumers' gradients for a backward), and the tag of each."""
        unit, me = action.index, self.cfg.stage
        if action.kind == "F":
            ks = list(self.producers)
            return [(self._peer(k, unit), self.in_meta[k]) for k in ks], [self._tag(k, me, False) for k in ks]
        if action.kind == "B":
            messages = [(self._peer(k, unit), self._grad_meta(n)) for k, n in self.consumers.items()]
            return messages, [self._tag(me, k, True) for k in self.consumers]
        return [], []

    def forward(self, unit: int, stashed: bool = False) -> None:
        """Inputs (data or received), the stage, outputs sent on; keeps what the backward needs.
        ``stashed``: run on a snapshot of this weight version (a step comes before the backward)."""
        me, named = self.cfg.stage, dict[str, torch.Tensor]()
        if self.cfg.is_first:
            named.update(zip(self.wiring.stage_inputs[me], self._micro("inputs", unit), strict=True))
        producers = self.producers
        got = self._recv(Action(me, "F", unit))
        for k in producers:  # (a forward of a pipedream producer proves its earlier gradients came)
            self.comm.answered(self._peer(k, unit), self._tag(k, me, False), unit)
        for k, tensors in zip(producers, got, strict=True):
            for name, t, meta in zip(producers[k], tensors, self.in_meta[k], strict=True):
                named[name] = t.requires_grad_(meta.needs_grad)
        with self.recorder.span(f"F{unit}", "compute"):
            outs = self._run(named, self._version_params() if stashed else None)
            loss = self._loss(unit, outs) if self.cfg.is_last else None
        sends = [(k, peer, names) for k, names in self.consumers.items() for peer in self._fans(k, unit)]
        self.comm.send(
            [(peer, [outs[n] for n in names]) for _, peer, names in sends],
            [self._tag(me, k, False) for k, _, _ in sends],
            [(peer, self._tag(me, k, False), unit) for k, peer, _ in sends],
        )
        inputs = {n: t for n, t in named.items() if t.requires_grad}
        # Only what a later stage reads: the backward starts from those and the loss. The loss's own
        # input (the last stage's logits) stays alive only as long as its graph needs it.
        sent = {n for names in self.consumers.values() for n in names}
        kept = {n: t for n, t in outs.items() if n in sent}
        self.units[unit] = Unit(inputs, kept, loss, self.version, stashed)
        held = len({u.version for u in self.units.values()})
        self.versions_in_flight_max = max(self.versions_in_flight_max, held)

    def _loss(self, unit: int, outs: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self.criterion is not None
        (target,) = self._micro("targets", unit)
        with autocast(self.precision, self.comm.device):
            loss = self.criterion(outs[self.wiring.loss_input], target)
        share = target.shape[0] / self.cfg.job.batch_size
        self.step_loss = loss.detach() * share + (0 if self.step_loss is None else self.step_loss)
        return loss * share if self.scaler is None else self.scaler.scale_loss(loss * share)

    def backward(self, unit: int) -> None:
        """Output gradients summed over consumers, autograd, input gradients sent back."""
        state = self.units.pop(unit)
        if self.before_backward is not None:  # (FSDP2: whether this backward syncs and reshards)
            self.before_backward(unit)
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if state.loss is not None:
            roots, grads = [state.loss], [None]
        consumers = self.consumers
        got = self._recv(Action(self.cfg.stage, "B", unit))
        for k, names in consumers.items():
            if self._grad_meta(names):  # (a gradient came back: the activations arrived)
                self.comm.answered(self._peer(k, unit), self._tag(self.cfg.stage, k, False), unit)
        summed: dict[str, torch.Tensor] = {}
        for names, tensors in zip(consumers.values(), got, strict=True):
            for name, g in zip([n for n in names if self.out_meta[n].needs_grad], tensors, strict=True):
                summed[name] = summed[name] + g if name in summed else g
        for name, g in summed.items():
            if state.outputs[name].requires_grad:
                roots.append(state.outputs[name])
                grads.append(g)
        if self.schedule.split_backward:
            self._input_grads(unit, state, roots, grads)
            return
        with self.recorder.span(f"B{unit}", "compute"):
            if roots:
                torch.autograd.backward(roots, grads)
            if state.stashed:
                self._collect_stash_grads(state.version)
        if self.stash and len(self.stash_log) < STASH_LOG_MAX:
            self.stash_log.append((unit, state.version, self.version))
        if (unit + 1) % self.cfg.job.microbatches == 0:
            self._step_units.append(state.version)
        self._send_input_grads(unit, state)

    def _input_grads(
        self, unit: int, state: Unit, roots: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> None:
        """Split B: only the gradients of the stage's inputs, sent at once; the graph is kept for W.
        A stage without inputs that need gradients (stage 0) computes nothing here: its whole
        backward is its W."""
        names = [n for n, t in state.inputs.items() if t.requires_grad]
        params = [p for p in self.module.parameters() if p.requires_grad]
        with self.recorder.span(f"B{unit}", "compute"):
            got, self.pending[unit] = backward_input(roots, grads, [state.inputs[n] for n in names], params)
        for name, g in zip(names, got, strict=True):
            state.inputs[name].grad = g
        self._send_input_grads(unit, state)

    def weights(self, unit: int) -> None:
        """W of a split backward: the weight gradients of ``unit`` from its retained graph, added to
        ``.grad`` as a fused backward would; dropping the unit's roots frees the graph."""
        work = self.pending.pop(unit)
        with self.recorder.span(f"W{unit}", "compute"):
            for p, g in backward_weight(work):
                if p.grad is None:
                    p.grad = g  # a fresh tensor of autograd's, ours to add into in place later
                else:
                    p.grad.add_(g)

    def _recv(self, action: Action) -> list[list[torch.Tensor]]:
        """What ``action`` receives: collected from its prefetched receives, or received now."""
        posted = self._inbox.pop((action.kind, action.index), None)
        if posted is None:
            messages, tags = self._incoming(action)
            if not messages:
                self.comm.flush()
                return []
            with self.recorder.span(f"recv {action.kind}{action.index}", "comm"):
                return self.comm.recv(messages, tags)
        if not posted.works and not posted.local:  # (a loopback-only receive is filled by wait)
            return posted.bufs
        with self.recorder.span(f"recv {action.kind}{action.index}", "comm"):
            return self.comm.wait(posted)

    def _grad_meta(self, names: Sequence[str]) -> tuple[TensorMeta, ...]:
        return tuple(self.out_meta[n] for n in names if self.out_meta[n].needs_grad)

    def _send_input_grads(self, unit: int, state: Unit) -> None:
        messages, tags, answers, me = [], [], [], self.cfg.stage
        for k, names in self.producers.items():
            tensors = []
            for name, meta in zip(names, self.in_meta[k], strict=True):
                if meta.needs_grad:
                    t = state.inputs[name]
                    tensors.append(t.grad if t.grad is not None else torch.zeros_like(t))
            for peer in self._fans(k, unit):
                messages.append((peer, tensors))
                tags.append(self._tag(k, me, True))
                answers.append(self._answer_of_gradient(k, unit))
        self.comm.send(messages, tags, answers)

    def _answer_of_gradient(self, producer: int, unit: int) -> Answer | None:
        """Under pipedream on a chain of single-replica stages, the producer takes ``unit``'s gradient
        in its backward of ``unit`` and runs the forward of ``unit + its warm-up`` next (its 1F1B
        list), whose activations then prove the gradient arrived; elsewhere None (retired by
        era, :attr:`_send_lag`)."""
        if not (self.stash and self._single_replicas):
            return None
        job = self.cfg.job
        ahead = warmup([1] * job.stages, producer) * job.microbatches
        return self._peer(producer, unit), self._tag(producer, self.cfg.stage, False), unit + ahead

    def step(self, step: int) -> None:
        """Sum gradients over replicas and ties, unscale them (fp16: every rank skips the step if one
        found an overflow), clip, step the optimizer and schedule, report the loss."""
        if self.before_step is not None:  # (FSDP2 under a split backward: reduce once, after the last W)
            self.before_step()
        params = dict(self.module.named_parameters())
        for p in self._rank_params(params).values():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        ran, self._synced = self._synced or self._sync_grads(params), []
        if self.chunks:  # (the rank's other chunks summed over their copies first: clipping sees all)
            for rt in self.chunks[1:]:
                rt._synced = rt._sync_grads(dict(rt.module.named_parameters()))
            self._sync_rank_ties()
        if self.lead is not None:
            skip = self.lead.skipping
        else:
            skip = self._unscale(self._rank_params(params), step) if self.scaler is not None else False
            self.skipping = skip
        if self.clip is not None and not skip:
            with self.recorder.span("clip", "comm"):
                clip_grads(self._rank_params(params), self.clip, self.comm)
        covered = tuple(step + i for i, n in enumerate(ran) if n) if self.stash else (step,)
        with self.recorder.span(f"S{step}", "compute"):
            if not skip:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            for _ in covered:  # the schedule counts minibatches (a pipedream round covers several)
                self.scheduler.step()
        if self.ends_minibatch:
            self.recorder.mark_step(len(covered), self.comm.seconds)
        if self.stash and len(self.step_versions) < STASH_LOG_MAX:
            self.step_versions.append((step, tuple(sorted(set(self._step_units)))))
        self._step_units = []
        self.version += 1
        self.comm.era = self.version
        self.comm.retire(self.version - self._send_lag)
        self._report(covered, ran)

    def _sync_rank_ties(self) -> None:
        """Under ``interleaved``, on the rank's first chunk (every chunk's backwards are done): each
        tied weight's gradient summed over the members this rank hosts and over the other ranks
        holding it, and given to every member, so the copies step alike."""
        hosted = {rt.cfg.stage: dict(rt.module.named_parameters()) for rt in self.chunks}
        with self.recorder.span("tie all-reduce", "comm"):
            for group, members in self.groups.rank_ties:
                grads = [hosted[stage][name].grad for stage, name in members]
                total = torch.stack([g for g in grads if g is not None]).sum(0)
                if group is not None:
                    self.comm.all_reduce_sum([total], group)
                for g in grads:
                    if g is not None:
                        g.copy_(total)

    def _rank_params(self, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        """What :meth:`step` unscales and clips: this stage's parameters, or every chunk's of the
        rank (:attr:`chunks`), named ``<stage>/<name>`` as the worker's ``Clip`` counts them."""
        if not self.chunks:
            return params
        return {f"{rt.cfg.stage}/{n}": p for rt in self.chunks for n, p in rt.module.named_parameters()}

    def _unscale(self, params: dict[str, nn.Parameter], step: int) -> bool:
        """Divide the gradients by the loss scale and move the scale; whether every rank skips ``step``
        (the learning-rate schedule still advances: it counts minibatches)."""
        assert self.scaler is not None
        with self.recorder.span("unscale", "comm"):
            found = self.scaler.unscale_((p.grad for p in params.values()), self.comm)
        self.scaler.update(found.anywhere)
        if found.here:
            self.overflow_steps.append(step + 1)
        if found.anywhere:
            self.skipped_steps.append(step + 1)
        return found.anywhere

    def _sync_grads(self, params: dict[str, nn.Parameter]) -> list[float]:
        """All-reduce gradients over the replica and tie groups. Under pipedream each replica adds
        how many minibatches it ran this round, and the sum is divided by their total (the mean over
        the round's minibatches). Returns the minibatches each replica ran (pipedream), else ``[1]``.
        The last stage's losses ride in the same all-reduce (:meth:`_loss_vector`), so a replicated
        step pays one collective, not a second one for the losses in :meth:`_report`."""
        tied = {name for _, name in self.groups.ties}  # (a rank's tie spans every copy: summed there)
        tied |= {name for _, held in self.groups.rank_ties for stage, name in held if stage == self.cfg.stage}
        r = len(self.cfg.replica_ranks)
        ran = torch.zeros(r if self.stash else 1, dtype=torch.float32, device=self.comm.device)
        ran[self.cfg.replica if self.stash else 0] = len(self._step_units) if self.stash else 1
        if self.groups.replicas is None and not self.groups.ties:
            return ran.tolist()
        with self.recorder.span("all-reduce", "comm"):
            if self.groups.replicas is not None:
                own = [local(p.grad) for n, p in params.items() if n not in tied and p.grad is not None]
                own = [] if self.groups.sharded else own
                losses = [self._loss_vector()] if self.cfg.is_last else []
                self.comm.all_reduce_sum(
                    [*own, *([ran] if self.stash else []), *losses], self.groups.replicas
                )
                self._step_losses = losses[0] if losses else None
            for group, name in self.groups.ties:
                grad = params[name].grad
                assert grad is not None
                self.comm.all_reduce_sum([grad], group)
        total = float(ran.sum())
        if self.stash and total > 1:
            for p in params.values():
                if p.grad is not None:
                    p.grad.div_(total)
        return ran.tolist()

    def _report(self, covered: tuple[int, ...], ran: list[float]) -> None:
        """Tell ``on_step`` the minibatches this step covered and, on the last stage, their losses:
        the replicas' losses summed (synchronous: shares of one minibatch), or one per replica that
        ran a minibatch of the round (pipedream)."""
        losses = None
        if self.cfg.is_last:
            vec = self._step_losses if self._step_losses is not None else self._loss_vector()
            values = vec.tolist()
            losses = tuple(v for v, n in zip(values, ran, strict=True) if n) if self.stash else (sum(values),)
            self.step_loss, self._step_losses = None, None
        if self.on_step is not None:
            self.on_step(covered, losses)

    def _loss_vector(self) -> torch.Tensor:
        """This replica's loss at its place in a vector of the replicas' (zeros elsewhere), float32
        like the gradients it is all-reduced with: each entry is one replica's value plus zeros, so
        the sum is exact (a float64 loss is reported at float32 precision)."""
        vec = torch.zeros(len(self.cfg.replica_ranks), dtype=torch.float32, device=self.comm.device)
        if self.step_loss is not None:
            vec[self.cfg.replica] = self.step_loss.float()
        return vec

    # ------------------------------------------------------------------ weight stashing
    def _version_params(self) -> dict[str, torch.Tensor]:
        """The snapshot of the current weights that forwards of this version run on."""
        if self.version not in self.versions:
            self.versions[self.version] = {
                n: p.detach().clone().requires_grad_(p.requires_grad)
                for n, p in self.module.named_parameters()
            }
        return self.versions[self.version]

    def _collect_stash_grads(self, version: int) -> None:
        """Move the gradients that landed on a snapshot onto the live parameters; drop unused snapshots."""
        snapshot = self.versions[version]
        for name, p in self.module.named_parameters():
            g = snapshot[name].grad
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
                snapshot[name].grad = None
        live = {u.version for u in self.units.values() if u.stashed} | {self.version}
        for v in [v for v in self.versions if v not in live]:
            del self.versions[v]
