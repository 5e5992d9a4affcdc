"""Optimizer, learning-rate schedule and global gradient clipping of one stage.

Every stage builds its own optimizer over its own parameters, so a pipeline trains like the unsplit
model only if the settings that couple parameters are global: the learning-rate schedule counts
minibatches (the same count on every stage), and gradient clipping scales every stage by the norm of
the whole model's gradient, as ``torch.nn.utils.clip_grad_norm_`` does on one process.

What a schedule step is: one minibatch. Under 1f1b and gpipe a stage steps its optimizer once per
minibatch. Under pipedream a stage of r replicas steps once per round of r minibatches (applying
their mean gradient); the step uses the rate of the round's first minibatch and then advances the
schedule by the round's minibatches, so every stage follows the same rate curve over minibatches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.errors import RunError
from runtime.executing.comm import Comm
from runtime.packages.job_config import RankConfig
from runtime.schedule import get_schedule

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "Clip",
    "OptimSettings",
    "apply_settings",
    "clip_grads",
    "counted_params",
    "lr_factor",
    "make_optimizer",
    "make_scheduler",
    "parse_betas",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "linear", "cosine")

_CLIP_EPS = 1e-6
"""Added to the total norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does."""


@dataclass(frozen=True)
class OptimSettings:
    """The optimizer settings of a run, recorded in every checkpoint.

    Attributes:
        optimizer: sgd, adam or adamw (decoupled weight decay).
        lr: peak learning rate (the rate after warm-up).
        momentum: SGD momentum.
        nesterov: Nesterov momentum (SGD, needs momentum > 0).
        weight_decay: L2 penalty (sgd, adam) or decoupled decay (adamw), on every parameter.
        betas: Adam(W)'s moment decay rates.
        lr_schedule: constant, linear (to 0 at the last step) or cosine (to 0 at the last step).
        warmup_steps: minibatches of linear warm-up from 0 to ``lr`` before the schedule.
        clip_grad_norm: scale gradients so the whole model's L2 norm is at most this; None: no clipping.
    """

    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    clip_grad_norm: float | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise a RunError naming the first bad value and what to use instead."""
        if self.optimizer not in OPTIMIZERS:
            raise RunError(f"unknown --optimizer {self.optimizer!r}; choose {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise RunError(f"unknown --lr-schedule {self.lr_schedule!r}; choose {', '.join(LR_SCHEDULES)}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise RunError(f"--lr must be 0 or more, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise RunError(f"--weight-decay must be 0 or more, got {self.weight_decay}")
        if not 0 <= self.momentum < 1:
            raise RunError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise RunError("--nesterov needs --optimizer sgd and a --momentum above 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            shown = ",".join(map(str, self.betas))
            raise RunError(f"--betas must be two numbers in [0, 1) like 0.9,0.999, got {shown}")
        if self.warmup_steps < 0:
            raise RunError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        clip = self.clip_grad_norm
        if clip is not None and not (math.isfinite(clip) and clip > 0):
            raise RunError(f"--clip-grad-norm must be a positive finite number, got {clip}")

    def check_schedule(self, schedule: str) -> None:
        """Global clipping needs every stage's gradient of the same minibatch at the same moment."""
        if self.clip_grad_norm is not None and not get_schedule(schedule).flushes:
            raise RunError(
                "--clip-grad-norm needs a synchronous schedule: under pipedream the stages step at "
                "different times on gradients of different minibatches; use --schedule 1f1b or gpipe"
            )

    def record(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return asdict(self)


def parse_betas(text: str) -> tuple[float, float]:
    """``0.9,0.999`` -> (0.9, 0.999); a RunError names a bad value."""
    try:
        b1, b2 = (float(part) for part in text.split(","))
    except ValueError:
        raise RunError(f"--betas takes two numbers like 0.9,0.999, got {text!r}") from None
    return b1, b2


def make_optimizer(settings: OptimSettings, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer the settings name, over ``params``. A stage without trained weights (an
    activation alone, as a fine split for interleaved can make) gets one empty group: torch refuses an
    empty parameter list, and its step then does nothing."""
    s = settings
    trained: Any = [p for p in params if p.requires_grad] or [{"params": []}]
    if s.optimizer == "sgd":
        return torch.optim.SGD(
            trained, lr=s.lr, momentum=s.momentum, nesterov=s.nesterov, weight_decay=s.weight_decay
        )
    make = torch.optim.AdamW if s.optimizer == "adamw" else torch.optim.Adam
    return make(trained, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)


def lr_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """Multiplier of the peak rate at minibatch ``step`` (0-based) of ``total``: linear warm-up from 0
    over ``warmup`` steps, then constant, linear or cosine decay to 0 at ``total`` (the same curves
    as transformers' ``get_{constant,linear,cosine}_schedule_with_warmup``)."""
    if step < warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_scheduler(
    settings: OptimSettings, optimizer: torch.optim.Optimizer, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over minibatches; step it once per minibatch an optimizer step covered."""
    s = settings

    def factor(step: int) -> float:
        return lr_factor(step, s.lr_schedule, s.warmup_steps, total)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_settings(
    settings: OptimSettings,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
    """Put ``settings`` into an optimizer and schedule loaded from a checkpoint of other settings
    (a resume whose changes were accepted): a checkpoint's groups carry their rates, betas and decay,
    which would otherwise silently win. The rate of the next step is the new schedule's at its step."""
    for group in optimizer.param_groups:
        group["initial_lr"] = settings.lr
        group["weight_decay"] = settings.weight_decay
        if settings.optimizer == "sgd":
            group.update(momentum=settings.momentum, nesterov=settings.nesterov)
        else:
            group["betas"] = settings.betas
    if scheduler is not None:
        scheduler.base_lrs = [settings.lr] * len(optimizer.param_groups)
        factors = getattr(scheduler, "lr_lambdas", None) or [lambda _: 1.0] * len(scheduler.base_lrs)
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, factors, strict=True):
            group["lr"] = base * factor(scheduler.last_epoch)


@dataclass(frozen=True)
class Clip:
    """Global gradient-norm clipping as this rank takes part in it.

    Attributes:
        max_norm: the largest L2 norm the whole model's gradient may have.
        counted: names of this rank's parameters whose gradients it adds to the norm: each
            parameter of the model is counted by exactly one rank (replica 0 of its stage; a tied
            parameter by the first stage holding it).
        group: every rank of the job (each needs the total to scale its gradients).
    """

    max_norm: float
    counted: frozenset[str]
    group: dist.ProcessGroup


def counted_params(cfg: RankConfig, names: Iterable[str]) -> frozenset[str]:
    """The parameters among ``names`` (its stage's) this rank counts in the global norm (:class:`Clip`)."""
    if cfg.replica != 0:
        return frozenset()
    owner: dict[str, bool] = {}
    for tie in cfg.job.ties:
        first = min(stage for stage, _ in tie)
        for stage, name in tie:
            if stage == cfg.stage:
                owner[name] = stage == first
    return frozenset(n for n in names if owner.get(n, True))


def clip_grads(params: Mapping[str, nn.Parameter], clip: Clip, comm: Comm) -> float:
    """Scale this rank's gradients by ``max_norm / (total norm + 1e-6)`` when that is below 1, where
    the total norm is over the whole model's final gradients (after replica and tie sums).

    Returns:
        The whole model's gradient norm before clipping (the same on every rank).
    """
    grads = [p.grad for n, p in params.items() if n in clip.counted and p.grad is not None]
    total = torch.zeros(1, dtype=torch.float64, device=comm.device)
    for g in grads:
        total += g.detach().double().square().sum()
    comm.all_reduce_sum([total], clip.group)
    norm = float(total.sqrt())
    coef = min(1.0, clip.max_norm / (norm + _CLIP_EPS))
    for p in params.values():
        if p.grad is not None:
            p.grad.mul_(coef)
    return norm
