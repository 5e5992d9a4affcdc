"""What a checkpoint records of its run, and what a resumed run would change.

A resumed run is exact when it continues with everything the checkpoint's run had: the data (seed,
batch, microbatches, source), the schedule, the optimizer settings and the learning rate's horizon
(a linear or cosine decay ends at the run's last step, so another ``--steps`` moves every later
rate). :func:`compare` sorts the differences into three kinds:

- errors: nothing to train (the run would end at or before the checkpoint's step), another optimizer
  (its state does not fit), a checkpoint keyed per stage on another layout;
- changes: a run that is no longer the one it continues; refused unless the user accepts them
  (``--accept-changes``), and then each is named in one line;
- notes: another plan of the same model (other cuts, replicas, GPUs), which changes nothing but the
  random generator streams (each rank's belong to its place in the old layout).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from runtime.checkpoints import step_folders as checkpoint
from runtime.datasets.minibatches import make_batches
from runtime.datasets.user_data import DataSettings
from runtime.errors import RunError
from runtime.packages.job_config import JobConfig
from runtime.packages.load import import_package, read_wiring
from runtime.packages.tensor_names import ModelNames, TensorSpec, model_names
from runtime.settings.run_options import RunOptions

__all__ = ["Verdict", "check_model", "compare", "record", "resume_lines", "total_steps"]

_DATA = ("data", "seq_len", "tokenizer", "shuffle")


def record(options: RunOptions, job: JobConfig, total_steps: int, names: ModelNames) -> dict[str, Any]:
    """The run as ``meta.json`` records it (and as a resumed run is compared with)."""
    return {
        "model": job.model,
        "package": str(job.package),
        "fingerprint": checkpoint.package_fingerprint(job.package),
        "stage_ranks": [list(r) for r in job.stage_ranks],
        "keys": "original" if names.original else "per-stage",
        "seed": options.seed,
        "schedule": job.schedule,
        "microbatches": job.microbatches,
        "batch_size": job.batch_size,
        "precision": job.precision,
        **{k: getattr(options, k) for k in _DATA},
        "optim": options.optim.record(),
        "total_steps": total_steps,
    }


@dataclass(frozen=True)
class Verdict:
    """What resuming a checkpoint with a run's settings means.

    Attributes:
        errors: reasons it cannot resume at all.
        changes: differences that make it another run (allowed only when accepted).
        notes: what the user should hear anyway (another plan).
        same_layout: the same package layout: each rank's generator states are its own again.
    """

    errors: tuple[str, ...]
    changes: tuple[str, ...]
    notes: tuple[str, ...]
    same_layout: bool

    def lines(self, accept: bool) -> list[str]:
        """The lines to print before resuming.

        Raises:
            RunError: an error, or changes that were not accepted (one line naming them all).
        """
        if self.errors:
            raise RunError(self.errors[0])
        if self.changes and not accept:
            raise RunError(
                f"resuming would change the run: {'; '.join(self.changes)}; resume with the checkpoint's "
                "settings, pass --accept-changes to continue with these, or start a new --checkpoint-dir"
            )
        return [*self.notes, *(f"resuming with a change: {c}" for c in self.changes)]


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def _differs(a: Any, b: Any) -> bool:
    norm = [tuple(v) if isinstance(v, list | tuple) else v for v in (a, b)]
    return norm[0] != norm[1]


def _setting_changes(old: dict[str, Any], new: dict[str, Any], step: int) -> list[str]:
    """Each setting that differs, with what it changes."""
    why = {
        "seed": f"minibatches after step {step} are not the first run's",
        "microbatches": "gradients are summed in another order",
        "batch_size": "every later minibatch holds other samples",
        "schedule": "stages step in another order (the same gradients under 1f1b, gpipe and zb1p)",
        "precision": "the forwards compute in another precision",
        **dict.fromkeys(_DATA, f"minibatches after step {step} come from other data"),
    }
    out = [
        f"{_flag(k)} {_shown(old.get(k))} -> {_shown(new[k])} ({reason})"
        for k, reason in why.items()
        if k in old and _differs(old.get(k), new[k])
    ]
    old_optim, new_optim = old.get("optim") or {}, new["optim"]
    out += [
        f"{_flag(k)} {_shown(old_optim[k])} -> {_shown(v)} (the optimizer steps otherwise after step {step})"
        for k, v in new_optim.items()
        if k != "optimizer" and k in old_optim and _differs(old_optim[k], v)
    ]
    decays = {old_optim.get("lr_schedule"), new_optim["lr_schedule"]} - {"constant", None}
    if decays and "total_steps" in old and old["total_steps"] != new["total_steps"]:
        out.append(
            f"the learning rate's horizon {old.get('total_steps')} -> {new['total_steps']} steps (the "
            f"{'/'.join(sorted(decays))} decay ends at the last step, so every rate after step {step} moves)"
        )
    return out


def compare(old: dict[str, Any], new: dict[str, Any], step: int, where: Path) -> Verdict:
    """How resuming ``where`` (a checkpoint of ``step`` recording ``old``) with a run recording ``new``
    differs from the run that wrote it."""
    errors: list[str] = []
    if new["total_steps"] <= step:
        errors.append(
            f"{where} is at step {step} and this run ends at step {new['total_steps']}: nothing is left to "
            f"train; give --steps above {step} (--steps counts every step, the checkpoint's included)"
        )
    old_kind, new_kind = (old.get("optim") or {}).get("optimizer"), new["optim"]["optimizer"]
    if old_kind is not None and old_kind != new_kind:
        errors.append(
            f"{where} holds {old_kind}'s optimizer state, which {new_kind} cannot continue; resume with "
            f"--optimizer {old_kind}, or start a new --checkpoint-dir"
        )
    same = old.get("fingerprint") == new["fingerprint"]
    if not same and "per-stage" in (old.get("keys"), new["keys"]):
        errors.append(
            f"{where} is keyed per stage (the stages of {old.get('package')} do not hold the original "
            "model's names, and define no fqn_prefix(k)), so it resumes only on that package"
        )
    notes = []
    if not same:
        notes.append(
            f"{where} was written on another plan ({_layout(old.get('stage_ranks'))}); resuming on "
            f"{_layout(new['stage_ranks'])}: weights and optimizer state load by name, and the random "
            "generators (dropout) restart from --seed and the step"
        )
    return Verdict(tuple(errors), tuple(_setting_changes(old, new, step)), tuple(notes), same)


def _layout(stage_ranks: Any) -> str:
    if not isinstance(stage_ranks, list):
        return "an unrecorded layout"
    ranks = len({r for rs in stage_ranks for r in rs})
    widths = "x".join(str(len(rs)) for rs in stage_ranks)
    return f"{len(stage_ranks)} stages on {ranks} ranks, replicas {widths}"


def check_model(saved: dict[str, TensorSpec], names: ModelNames, where: Path) -> None:
    """The checkpoint holds this model's weights: every name (or another name of its tensor) with
    its shape, and no name the model lacks.

    Raises:
        RunError: naming the first tensor that is missing, extra or of another shape.
    """
    wanted = names.all_tensors()
    for key, (shape, _) in wanted.items():
        found = next((c for c in names.candidates(key) if c in saved), None)
        if found is None:
            raise RunError(f"{where} holds no {key!r}: it was written for another model than this package's")
        if tuple(saved[found][0]) != tuple(shape):
            raise RunError(
                f"{where} holds {key!r} of shape {tuple(saved[found][0])}, this package's is {tuple(shape)}: "
                "it was written for another model (or another config of it)"
            )
    known = {c for key in wanted for c in names.candidates(key)}
    extra = sorted(set(saved) - known)
    if extra:
        raise RunError(f"{where} holds {extra[0]!r}, which this package's model does not have: another model")


def total_steps(options: RunOptions, job: JobConfig, package: ModuleType) -> int:
    """The run's last step: ``--steps``, or ``--epochs`` times the data's minibatches per epoch."""
    if options.steps is not None:
        return options.steps
    names = read_wiring(package, job.stages, job.module_stages).stage_inputs[0]
    settings = DataSettings.of(options, job)
    data = make_batches(options.data, package, names, job.batch_size, options.seed, options.shuffle, settings)
    return (options.epochs or 1) * data.steps_per_epoch


def resume_lines(options: RunOptions, job: JobConfig, step: int) -> list[str]:
    """What resuming ``step`` of ``--checkpoint-dir`` with ``options`` means, checked before any rank
    starts: the lines to print (another plan, accepted changes).

    Raises:
        RunError: another model, nothing left to train, another optimizer, or changes not accepted.
    """
    root = Path(options.checkpoint_dir or "")
    where = checkpoint.step_dir(root, step)
    before = set(sys.modules)
    try:
        package = import_package(job.package)
        names = model_names(package, job)
        new = record(options, job, total_steps(options, job, package), names)
    finally:  # the ranks import their own
        for name in set(sys.modules) - before:
            if name.startswith("pipeplan_pkg_"):
                del sys.modules[name]
    check_model(checkpoint.saved_tensors(root, step), names, where)
    return compare(checkpoint.read_meta(root, step), new, step, where).lines(options.accept_changes)
