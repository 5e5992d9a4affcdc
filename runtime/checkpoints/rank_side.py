"""A rank's side of checkpoints: resume at start-up, save at segment ends, wait at the end.

Every rank computes the checkpoint names of the package's stages on the meta device
(:mod:`runtime.packages.tensor_names`), writes its share of each step with
:class:`runtime.checkpoints.step_folders.Saver` and, on ``--resume``, loads what its own stages hold
(:mod:`runtime.checkpoints.train_state`), whatever plan wrote it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from runtime.checkpoints import resume_settings as resume
from runtime.checkpoints import step_folders as checkpoint
from runtime.checkpoints import train_state
from runtime.executing.comm import peer_errors
from runtime.executing.optimizer import apply_settings
from runtime.executing.stage import StageRuntime
from runtime.packages.load import import_package
from runtime.packages.tensor_names import ModelNames, model_names
from runtime.settings.run_options import RunOptions

__all__ = ["WRITE_TIMEOUT_S", "RankCheckpoints"]

log = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 1800.0
"""The least time a rank waits in a checkpoint's collectives: DCP's last one waits for the slowest
rank's write, which for a large stage takes far longer than a training message."""


@dataclass
class RankCheckpoints:
    """Checkpoints of one rank.

    Attributes:
        options: the run's options (``checkpoint_dir`` is set).
        hosted: the stages this rank runs (several under interleaved and zbv).
        names: checkpoint names of every stage of the package.
        saver: writes this rank's share of a step.
        total: the run's last step (recorded; a resume compares its learning-rate horizon).
    """

    options: RunOptions
    hosted: tuple[StageRuntime, ...]
    names: ModelNames
    saver: checkpoint.Saver
    total: int

    @classmethod
    def open(
        cls,
        options: RunOptions,
        hosted: tuple[StageRuntime, ...],
        total: int,
        on_saved: Callable[[int, float], None] | None = None,
    ) -> RankCheckpoints | None:
        """The rank's checkpoints; None without ``--checkpoint-dir``. Every rank calls it at the same
        point: it creates the gloo group that checkpoints are planned over."""
        if not options.checkpoint_dir:
            return None
        rt = hosted[0]
        names = model_names(import_package(rt.cfg.job.package), rt.cfg.job)
        with peer_errors("creating the checkpoint group"):
            group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=max(options.timeout, WRITE_TIMEOUT_S))
            )
        saver = checkpoint.Saver(
            Path(options.checkpoint_dir),
            rt.cfg.rank,
            group,
            resume.record(options, rt.cfg.job, total, names),
            background=options.checkpoint_async,
            keep=options.keep_checkpoints,
            pin_every=options.pin_every,
            on_saved=on_saved,
        )
        return cls(options, hosted, names, saver, total)

    @property
    def root(self) -> Path:
        return self.saver.root

    def _resume_step(self) -> int | None:
        """The launcher's choice, or rank 0's for ranks torchrun started (which then also refuses
        what the launcher would have refused)."""
        options, rt = self.options, self.hosted[0]
        found: list[int | None] = [options.resume_step or None]
        if options.resume and options.resume_step is None and rt.cfg.rank == 0:
            found = [checkpoint.resume_point(self.root).step]
            if found[0] is not None:
                old = checkpoint.read_meta(self.root, found[0])
                where = checkpoint.step_dir(self.root, found[0])
                verdict = resume.compare(old, self.saver.meta, found[0], where)
                for line in verdict.lines(options.accept_changes):
                    log.warning("%s", line)
        with peer_errors("agreeing on the step to resume"):
            dist.broadcast_object_list(found, src=0, group=self.saver.group)
        return found[0]

    def resume(self) -> tuple[int, Callable[[], None]]:
        """0, or the step resumed after with this rank's stages, optimizers, learning-rate schedule
        and loss scale loaded; and what sets the rank's random generators once it is set up (the
        checkpoint's states on the layout that wrote them, else the seed and the step)."""
        step = self._resume_step()
        if step is None:
            return 0, lambda: None
        rt = self.hosted[0]
        same = checkpoint.read_meta(self.root, step).get("fingerprint") == self.saver.meta["fingerprint"]
        held = [train_state.Held(each.cfg.stage, each.module, each.optimizer) for each in self.hosted]
        with peer_errors("loading a checkpoint"):
            loaded, rng = train_state.load(
                checkpoint.step_dir(self.root, step), self.names, held, rt.cfg.rank, self.saver.group,
                rt.scheduler, rt.scaler, rng=same,
            )  # fmt: skip
        for each in self.hosted[1:]:
            if each.scheduler is not None and rt.scheduler is not None:
                each.scheduler.load_state_dict(rt.scheduler.state_dict())
        if self.options.accept_changes:
            settings = self.options.optim
            for each in self.hosted:
                apply_settings(settings, each.optimizer, each.scheduler)
        seed = self.options.seed
        if rng is not None:
            return loaded, lambda: train_state.set_rng(rng)
        return loaded, lambda: train_state.reseed(seed, loaded, rt.cfg.rank)

    def save(self, step: int) -> None:
        """Every rank's generator states; each stage's weights and optimizer state (its first
        replica); rank 0's schedule, loss scale and step: one DCP checkpoint, written together."""
        rt = self.hosted[0]
        held = [
            train_state.Held(each.cfg.stage, each.module, each.optimizer, writes=_writes(each))
            for each in self.hosted
        ]
        self.saver.save(
            step, train_state.rank_entries(self.names, held, rt.cfg.rank, step, rt.scheduler, rt.scaler)
        )

    def close(self) -> None:
        """Wait for a checkpoint still being written in the background."""
        self.saver.close()


def _writes(rt: StageRuntime) -> bool:
    """Whether this rank writes its stage's weights and optimizer state: the first copy (each tensor
    rank its DTensor shards; DCP keeps one of the whole tensors they all hold), or every copy of a
    stage whose copies shard them."""
    return rt.cfg.replica == 0 or rt.cfg.layout.shard != "none"
