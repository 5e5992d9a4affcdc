"""The original model's name of every tensor a stage holds: what a checkpoint is keyed by.

A checkpoint keyed by these names (fully qualified names, FQNs: ``features.3.weight``) does not depend
on the plan that wrote it: another cut, other replica counts, another schedule or number of GPUs
hold the same tensors under the same names, only spread over other stages. pipeplan's generated
stages keep the original module paths (``runtime.building.stage_init.populate``), so a stage's own
``state_dict`` names already are the original ones. A package written by hand may say where its
stages sit in its model with ``fqn_prefix(k)`` (a string put before stage ``k``'s names); one whose
stages reuse names without it (PipeDream's, whose stages are numbered module lists) is keyed per
stage, ``stage<k>.<name>``, and its checkpoints resume on its own layout only.

A tied tensor (GPT-2's token embedding and LM head) has several names. A stage holding all of them
keeps one tensor and one optimizer state, under its first name; stages holding one each keep copies
that the tie's all-reduce keeps equal. :attr:`ModelNames.aliases` lets a checkpoint written one way
load the other way.

Everything here is computed on the meta device: no rank allocates another stage's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from runtime.packages.job_config import JobConfig
from runtime.packages.load import ModuleChain, Wiring, read_wiring

__all__ = ["ModelNames", "TensorSpec", "model_names", "stage_modules"]

TensorSpec = tuple[tuple[int, ...], str]
"""A tensor's shape and dtype name (``float32``), as a checkpoint's metadata records them."""


@dataclass(frozen=True)
class ModelNames:
    """Checkpoint names of a package's stages.

    Attributes:
        prefixes: per stage, what goes before its state_dict names ("" for generated packages).
        tensors: per stage, its state_dict names (its own, without the prefix) with shape and dtype.
        aliases: per checkpoint name of a tied tensor, every other name of the same tensor.
        original: whether the names are the original model's (False: keyed per stage, this layout only).
    """

    prefixes: tuple[str, ...]
    tensors: tuple[dict[str, TensorSpec], ...]
    aliases: dict[str, tuple[str, ...]]
    original: bool = True

    def key(self, stage: int, name: str) -> str:
        """The checkpoint name of ``name`` of ``stage``."""
        return self.prefixes[stage] + name

    def all_tensors(self) -> dict[str, TensorSpec]:
        """Every checkpoint name of the model's weights and buffers, with shape and dtype."""
        return {self.key(k, n): spec for k, held in enumerate(self.tensors) for n, spec in held.items()}

    def candidates(self, key: str) -> tuple[str, ...]:
        """``key`` and then the other names of its tensor: where a checkpoint may hold it."""
        return (key, *self.aliases.get(key, ()))


def stage_modules(package: ModuleType, wiring: Wiring, module_stages: Sequence[int]) -> list[nn.Module]:
    """Every stage's module on the meta device, named as :func:`runtime.packages.load.build_stage` names
    it."""
    stages = len(wiring.stage_inputs)
    with torch.device("meta"):
        entries = package.model(package.criterion())
    owners = tuple(module_stages) or (*range(stages), stages - 1)
    out: list[nn.Module] = []
    for k in range(stages):
        mine = [e[0] for e, owner in zip(entries[:-1], owners, strict=False) if owner == k]
        single = len(mine) == 1
        out.append(
            mine[0]
            if single
            else ModuleChain(mine, wiring.stage_modules[k], wiring.stage_inputs[k], wiring.stage_outputs[k])
        )
    return out


def _specs(module: nn.Module) -> dict[str, TensorSpec]:
    return {
        name: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in module.state_dict(keep_vars=True).items()
    }


def _shared(module: nn.Module) -> list[list[str]]:
    """Groups of a module's parameter names that are one tensor (a tie inside one stage)."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _prefixes(
    package: ModuleType, tensors: Sequence[dict[str, TensorSpec]], job: JobConfig
) -> tuple[tuple[str, ...], bool]:
    """The package's ``fqn_prefix(k)``; else "" unless two stages hold one name that is not a tie
    (then ``stage<k>.``, and False: the names are not the original model's)."""
    given = getattr(package, "fqn_prefix", None)
    if callable(given):
        return tuple(str(given(k)) for k in range(len(tensors))), True
    tied = {(s, n) for tie in job.ties for s, n in tie}
    seen: dict[str, int] = {}
    for k, held in enumerate(tensors):
        for name in held:
            if name in seen and seen[name] != k and not {(seen[name], name), (k, name)} <= tied:
                return tuple(f"stage{j}." for j in range(len(tensors))), False
            seen.setdefault(name, k)
    return ("",) * len(tensors), True


def model_names(package: ModuleType, job: JobConfig) -> ModelNames:
    """The checkpoint names of ``package``'s stages under ``job``'s plan (built on the meta device)."""
    wiring = read_wiring(package, job.stages, job.module_stages)
    modules = stage_modules(package, wiring, job.module_stages)
    tensors = tuple(_specs(m) for m in modules)
    prefixes, original = _prefixes(package, tensors, job)
    groups = [[prefixes[k] + n for n in g] for k, m in enumerate(modules) for g in _shared(m)]
    groups += [[prefixes[s] + n for s, n in tie] for tie in job.ties]
    aliases: dict[str, set[str]] = {}
    for group in groups:  # a name in two groups (a tie inside a stage and across stages) joins them
        joined = set(group).union(*(aliases.get(n, set()) for n in group))
        for name in joined:
            aliases[name] = joined
    return ModelNames(prefixes, tensors, {n: tuple(sorted(g - {n})) for n, g in aliases.items()}, original)
