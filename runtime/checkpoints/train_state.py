"""A rank's training state as torch.distributed.checkpoint (DCP) entries, and loading it back.

One checkpoint holds, under names that do not depend on the plan (:mod:`runtime.packages.tensor_names`):

- ``model.<fqn>``: every weight and buffer (a stage's first replica writes them);
- ``optimizer.state.<fqn>.<key>`` and ``optimizer.param_groups.<fqn>.<key>``: the optimizer's state
  and settings per parameter, the flattened form torch's ``get_optimizer_state_dict`` documents for
  pipeline parallelism (torchtitan's too), so a parameter's moments follow it to whatever stage holds
  it next;
- ``lr_scheduler``, ``loss_scale`` and ``train_state`` (the step): the same on every rank, written by
  rank 0;
- ``rng.rank<R>``: rank R's random generator states (its dropout draws).

Each rank asks DCP for what its own stages hold, so a checkpoint of one plan loads on another:
other cuts, replica counts, schedule or number of GPUs. The data position is the step (minibatches
are addressed by step). The generator states are restored only on the layout that wrote them: on
another, a rank's draws are another rank's, and the generators start from the seed and the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from runtime.checkpoints import safe_read
from runtime.errors import RunError
from runtime.executing.loss_scale import LossScaler
from runtime.packages.tensor_names import ModelNames

__all__ = [
    "Held",
    "load",
    "rank_entries",
    "reseed",
    "rng_entries",
    "set_rng",
    "shared_entries",
    "stage_entries",
]

_PG = "param_groups"


@dataclass(frozen=True)
class Held:
    """One stage a rank trains: what of it goes into a checkpoint.

    Attributes:
        stage: its index.
        module: its weights and buffers.
        optimizer: its optimizer (one parameter group).
        writes: whether this rank writes the stage's weights and optimizer state (its first replica).
    """

    stage: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    writes: bool = True


def _optimizer(held: Held) -> dict[str, Any]:
    """torch's FQN-keyed optimizer state dict (state created by a no-op step if the optimizer has
    none yet, which is what loading needs: a template of every entry)."""
    return dict(get_optimizer_state_dict(held.module, held.optimizer))


def stage_entries(names: ModelNames, held: Held) -> dict[str, Any]:
    """A stage's weights, buffers and optimizer state under their checkpoint names."""
    out: dict[str, Any] = {
        f"model.{names.key(held.stage, n)}": t for n, t in held.module.state_dict().items()
    }
    nested = _optimizer(held)
    for fqn, state in nested["state"].items():
        for k, v in state.items():
            out[f"optimizer.state.{names.key(held.stage, fqn)}.{k}"] = v
    for group in nested[_PG]:
        for fqn in group["params"]:
            for k, v in group.items():
                if k != "params":
                    out[f"optimizer.{_PG}.{names.key(held.stage, fqn)}.{k}"] = v
    return out


def _scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The schedule's position (its ``lr_lambdas`` are functions, rebuilt from the settings)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def shared_entries(
    step: int, scheduler: torch.optim.lr_scheduler.LRScheduler | None, scaler: LossScaler | None
) -> dict[str, Any]:
    """What every rank holds alike: the step, the learning-rate schedule, fp16's loss scale."""
    out: dict[str, Any] = {"train_state": {"step": step}}
    if scheduler is not None:
        out["lr_scheduler"] = _scheduler_state(scheduler)
    if scaler is not None:
        out["loss_scale"] = scaler.state_dict()
    return out


def _rng_now() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def rng_entries(rank: int) -> dict[str, Any]:
    """This rank's generator states."""
    return {f"rng.rank{rank}": _rng_now()}


def rank_entries(
    names: ModelNames,
    held: Sequence[Held],
    rank: int,
    step: int,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    scaler: LossScaler | None,
) -> dict[str, Any]:
    """Everything rank ``rank`` writes at ``step``."""
    out = rng_entries(rank)
    for each in held:
        if each.writes:
            out.update(stage_entries(names, each))
    if rank == 0:
        out.update(shared_entries(step, scheduler, scaler))
    return out


def reseed(seed: int, step: int, rank: int) -> None:
    """Generators of a rank resumed on another layout: a function of the seed, the step and the rank."""
    torch.manual_seed((seed * 1_000_003 + step) * 4099 + rank)


@dataclass
class _Request:
    """What one rank asks of a checkpoint: ``entries`` by checkpoint name (DCP fills tensors in place
    and replaces other values), plus ``copies`` (target, source name) where two targets read one name
    (a tie read twice)."""

    present: frozenset[str]
    entries: dict[str, Any]
    copies: list[tuple[torch.Tensor, str]]

    def tensor(self, candidates: Iterable[str], target: torch.Tensor, what: str) -> None:
        found = next((c for c in candidates if c in self.present), None)
        if found is None:
            raise RunError(f"the checkpoint holds no {what}; it was written for another model")
        if found in self.entries:
            self.copies.append((target, found))
        else:
            self.entries[found] = target

    def value(self, candidates: Iterable[str], template: Any) -> str | None:
        found = next((c for c in candidates if c in self.present), None)
        if found is not None:
            self.entries.setdefault(found, template)
        return found


def _ask_stage(request: _Request, names: ModelNames, held: Held) -> tuple[dict[str, Any], dict[str, str]]:
    """Ask for a stage's weights, optimizer state and group settings; returns the optimizer state
    dict to fill and, per group setting, the checkpoint name it comes from."""
    for n, t in held.module.state_dict().items():
        key = names.key(held.stage, n)
        request.tensor([f"model.{c}" for c in names.candidates(key)], t, f"weights for {key!r}")
    nested = _optimizer(held)
    for fqn, state in nested["state"].items():
        cands = names.candidates(names.key(held.stage, fqn))
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                raise RunError(
                    f"optimizer state {fqn}.{k} is not a tensor; pipeplan checkpoints tensors only"
                )
            request.tensor([f"optimizer.state.{c}.{k}" for c in cands], v, f"optimizer state {k} of {fqn!r}")
    settings: dict[str, str] = {}
    for group in nested[_PG][:1]:  # a stage's optimizer has one group
        cands = names.candidates(names.key(held.stage, group["params"][0])) if group["params"] else ()
        for k in (k for k in group if k != "params"):
            found = request.value([f"optimizer.{_PG}.{c}.{k}" for c in cands], group[k])
            if found is not None:
                settings[k] = found
    return nested, settings


def load(
    path: Path,
    names: ModelNames,
    held: Sequence[Held],
    rank: int,
    group: dist.ProcessGroup | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    scaler: LossScaler | None,
    rng: bool,
) -> tuple[int, dict[str, torch.Tensor] | None]:
    """Load this rank's stages, optimizers, schedule and loss scale from the DCP checkpoint at
    ``path`` (every rank calls this together); returns the checkpoint's step and, with ``rng``, this
    rank's generator states (for :func:`set_rng` once the rank is set up)."""
    present = frozenset(safe_read.read_metadata(path).state_dict_metadata)
    request = _Request(present, {}, [])
    asked = [_ask_stage(request, names, each) for each in held]
    wanted: dict[str, Any] = {**request.entries, "train_state": {"step": 0}}
    if scheduler is not None and any(k.startswith("lr_scheduler.") for k in present):
        wanted["lr_scheduler"] = _scheduler_state(scheduler)
    if scaler is not None and any(k.startswith("loss_scale.") for k in present):
        wanted["loss_scale"] = scaler.state_dict()
    if rng:
        wanted[f"rng.rank{rank}"] = _rng_now()
    safe_read.load(wanted, path, group)
    with torch.no_grad():
        for target, source in request.copies:
            target.copy_(wanted[source])
    for each, (nested, settings) in zip(held, asked, strict=True):
        for values in nested[_PG][:1]:
            values.update({k: wanted[found] for k, found in settings.items()})
        set_optimizer_state_dict(each.module, each.optimizer, nested)
    if "lr_scheduler" in wanted and scheduler is not None:
        scheduler.load_state_dict({**wanted["lr_scheduler"], "lr_lambdas": [None] * len(scheduler.base_lrs)})
    if "loss_scale" in wanted and scaler is not None:
        scaler.load_state_dict(wanted["loss_scale"])
    return int(wanted["train_state"]["step"]), wanted[f"rng.rank{rank}"] if rng else None


def set_rng(states: Mapping[str, torch.Tensor]) -> None:
    """Restore generator states :func:`load` returned."""
    torch.set_rng_state(states["cpu"])
    cuda = [states[k] for k in sorted((k for k in states if k.startswith("cuda")), key=lambda k: int(k[4:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
