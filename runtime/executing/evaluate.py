"""Forward-only evaluation of the pipeline on held-out data (``--eval-data SPEC --eval-every N``).

Between two segments of training, when every rank has drained its pipeline, each rank runs its stage
forward under ``no_grad`` (in ``eval()`` mode: no dropout) over one pass of the held-out data,
microbatch by microbatch: the first stage reads inputs, every stage receives what its producers
send and sends its outputs on, and the last stage computes the loss and, when targets are class
indices, the correct predictions. A stage of ``r`` replicas splits the data: microbatch ``u`` goes
to replica ``u % r`` of every stage, so each microbatch is evaluated once, on whichever replicas, and
the last stage's replicas sum their totals with one all-reduce.

The loss is the mean over samples of the criterion (each microbatch's loss weighted by its rows,
as training weights its microbatches), which for a criterion that averages over samples is the loss
of the unsplit model on the same data. Which weights: the weights after step ``N`` on every stage.
The synchronous schedules hold those at any step boundary; under ``pipedream`` the run drains its
pipeline at every evaluation step (as at a checkpoint), so every stage has applied the gradients of
exactly the minibatches before ``N`` (each computed on its stashed, possibly older, weights).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.executing.stage import Batches, StageRuntime

__all__ = ["EvalResult", "Evaluator", "class_hits", "eval_steps", "segments"]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation.

    Attributes:
        step: training steps taken before it (the weights after minibatch ``step - 1``).
        loss: mean loss over the held-out samples.
        accuracy: share of class targets predicted right (``-100`` targets ignored); None when the
            targets are not class indices of the output.
        samples: held-out samples evaluated.
    """

    step: int
    loss: float
    accuracy: float | None
    samples: int

    def record(self) -> dict[str, float | int | None]:
        """The metrics.json entry."""
        return {"step": self.step, "loss": self.loss, "accuracy": self.accuracy, "samples": self.samples}


def eval_steps(start: int, total: int, every: int) -> tuple[int, ...]:
    """Steps after which to evaluate: multiples of ``every`` after ``start`` (0: none), and ``total``."""
    found = set(range((start // every + 1) * every, total, every)) if every > 0 else set()
    return tuple(sorted(found | ({total} if total > start else set())))


def segments(start: int, total: int, boundaries: Sequence[int]) -> list[tuple[int, int]]:
    """(first step, steps) runs from ``start`` to ``total`` cut at every boundary between them."""
    edges = sorted({b for b in boundaries if start < b < total} | {total})
    out, first = [], start
    for edge in edges:
        if edge > first:
            out.append((first, edge - first))
            first = edge
    return out


def class_hits(output: torch.Tensor, target: torch.Tensor) -> tuple[int, int] | None:
    """(correct, counted) when ``target`` holds class indices of ``output``'s last dimension (its shape
    without that dimension); None for other targets (regression, a user loss's own format)."""
    if target.is_floating_point() or not output.is_floating_point() or output.shape[:-1] != target.shape:
        return None
    counted = target != -100
    correct = (output.argmax(-1) == target) & counted
    return int(correct.sum()), int(counted.sum())


@dataclass
class Evaluator:
    """Evaluates one rank's stages on ``batches`` (one pass, ``minibatches`` of them) when called.

    Attributes:
        rt: the rank's runtime (its stage, criterion, channels and groups).
        batches: held-out minibatches by index, identical on every rank that reads them.
        minibatches: minibatches per evaluation.
        hosted: under ``interleaved``, every stage the rank runs (its chunks, ``rt`` first); each
            unit goes through them in stage order, so every rank walks the units depth first, in
            the same order, and the one holding the last stage scores them.
    """

    rt: StageRuntime
    batches: Batches
    minibatches: int
    hosted: tuple[StageRuntime, ...] = ()

    @property
    def stages(self) -> tuple[StageRuntime, ...]:
        """The runtimes this rank evaluates, in stage order."""
        return self.hosted or (self.rt,)

    def _peer(self, stage: int, unit: int) -> int:
        ranks = self.rt.cfg.job.stage_ranks[stage]
        return ranks[unit % len(ranks)]

    def __call__(self, step: int) -> EvalResult | None:
        """Evaluate now; the last stage's first replica returns the result, every other rank None."""
        comm_seconds, training = self.rt.comm.seconds, [s.module.training for s in self.stages]
        for s in self.stages:
            s.module.eval()
        try:
            with torch.no_grad():
                totals = self._pass()
        finally:
            for s, mode in zip(self.stages, training, strict=True):
                s.module.train(mode)
        last = next((s for s in self.stages if s.cfg.is_last), None)
        if last is not None and last.groups.replicas is not None:
            last.comm.all_reduce_sum([totals], last.groups.replicas)
        self.rt.comm.seconds = comm_seconds  # training's communication time only
        if last is None or last.cfg.replica != 0:
            return None
        loss_sum, rows, correct, counted = totals.tolist()
        accuracy = correct / counted if counted > 0 else None
        return EvalResult(step, loss_sum / rows, accuracy, int(rows))

    def _pass(self) -> torch.Tensor:
        """This rank's microbatches of one pass: (loss x rows, rows, correct, counted) summed."""
        rt, m = self.rt, self.rt.cfg.job.microbatches
        device = rt.comm.device  # the totals' all-reduce runs on the rank's backend (nccl: a GPU tensor)
        replicas, totals = len(rt.cfg.replica_ranks), torch.zeros(4, dtype=torch.float64, device=device)
        first = any(s.cfg.is_first for s in self.stages)
        last = any(s.cfg.is_last for s in self.stages)
        for b in range(self.minibatches):
            units = [b * m + j for j in range(m) if (b * m + j) % replicas == rt.cfg.replica]
            if not units:
                continue
            inputs = tuple(t.to(device) for t in self.batches.inputs(b)) if first else ()
            target = self.batches.targets(b).to(device) if last else None
            for unit in units:
                for stage in self.stages:
                    named: dict[str, torch.Tensor] = {}
                    if stage.cfg.is_first:
                        named.update(
                            zip(stage.wiring.stage_inputs[0], _split(inputs, m, unit % m), strict=True)
                        )
                    outs = self._forward(stage, unit, named)
                    if stage.cfg.is_last and target is not None:
                        (part,) = _split((target,), m, unit % m)
                        totals += self._score(stage, outs, part)
                rt.comm.drain()  # (after all this rank's stages: one may wait for a later one's send)
        return totals

    def _forward(
        self, rt: StageRuntime, unit: int, named: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Receive the unit's inputs, run the stage and send its outputs; the caller waits until they
        are taken once the rank's stages have run the unit (one unit in flight per channel:
        pipelined, with bounded memory, and free of deadlock because a rank only ever waits for a
        later stage to take a unit it has already sent). Messages carry training's stream tags
        (``interleaved``: two ranks exchange several streams)."""
        me, producers = rt.cfg.stage, rt.producers
        if producers:
            tags = [rt._tag(k, me, False) for k in producers]
            got = rt.comm.recv([(self._peer(k, unit), rt.in_meta[k]) for k in producers], tags)
            for names, tensors in zip(producers.values(), got, strict=True):
                named.update(zip(names, tensors, strict=True))
        outs = rt.run_stage(named)
        messages = [(self._peer(k, unit), [outs[n] for n in names]) for k, names in rt.consumers.items()]
        if messages:
            rt.comm.send(messages, [rt._tag(me, k, False) for k in rt.consumers])
        return outs

    def _score(self, rt: StageRuntime, outs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        assert rt.criterion is not None
        output = outs[rt.wiring.loss_input]
        rows = target.shape[0]
        loss = float(rt.criterion(output, target))
        prediction = _prediction(output)
        hits = class_hits(prediction, target) if prediction is not None else None
        correct, counted = hits if hits is not None else (0, 0)
        return torch.tensor([loss * rows, rows, correct, counted], dtype=torch.float64, device=target.device)


def _prediction(output: Any) -> torch.Tensor | None:
    """The tensor of a model output that accuracy reads: itself, ``.logits``, ``["logits"]`` or the
    first element (the last stage returns the model's output as the model returns it)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output:
        return _prediction(output[0])
    return None


def _split(tensors: Sequence[torch.Tensor], microbatches: int, index: int) -> tuple[torch.Tensor, ...]:
    """Microbatch ``index`` of each minibatch tensor (along dim 0, as training splits them)."""
    return tuple(torch.tensor_split(t, microbatches)[index] for t in tensors)
