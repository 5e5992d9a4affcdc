"""Import a generated package and read its wiring: which stage produces and consumes which tensor.

The wiring comes from the package's own ``model(criterion)`` (PipeDream's list of
``(module, in_names, out_names)``), built on the meta device so no rank allocates the stages it
does not run. A rank then builds only its own stage with ``stage(k, seed)``.

PipeDream's own packages may put several modules on one stage (``module_to_stage_map``
``[0, 0, 1, 1, 1]``): such a stage runs its modules in order as one :class:`ModuleChain`, reading
what its modules read from other stages and returning what later stages (or the criterion) read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from runtime.errors import RunError

__all__ = ["ModuleChain", "Wiring", "build_stage", "import_package", "read_wiring", "reads_weights"]

Names = tuple[str, ...]


@dataclass(frozen=True)
class Wiring:
    """Tensor names in and out of every stage.

    Attributes:
        stage_inputs: per stage, its forward's positional inputs by name.
        stage_outputs: per stage, the names of what its forward returns.
        loss_input: the last stage output the criterion reads.
        stage_modules: per stage, the (input names, output names) of each of its modules, in
            ``model()`` order.
    """

    stage_inputs: tuple[Names, ...]
    stage_outputs: tuple[Names, ...]
    loss_input: str
    stage_modules: tuple[tuple[tuple[Names, Names], ...], ...] = ()

    def producer(self, name: str) -> int | None:
        """The stage whose forward returns ``name``; None for the model's own inputs."""
        for k, outs in enumerate(self.stage_outputs):
            if name in outs:
                return k
        return None

    def consumers(self, stage: int) -> dict[int, tuple[str, ...]]:
        """Later stages that read outputs of ``stage``, with the names each reads (in order)."""
        outs = set(self.stage_outputs[stage])
        found = {
            k: tuple(n for n in ins if n in outs)
            for k, ins in enumerate(self.stage_inputs)
            if k > stage and outs.intersection(ins)
        }
        return dict(sorted(found.items()))

    def producers(self, stage: int) -> dict[int, tuple[str, ...]]:
        """Earlier stages ``stage`` reads from, with the names it reads from each (in its input order)."""
        found: dict[int, list[str]] = {}
        for name in self.stage_inputs[stage]:
            k = self.producer(name)
            if k is not None and k < stage:  # stage 0 returns model inputs that later stages read
                found.setdefault(k, []).append(name)
        return {k: tuple(v) for k, v in sorted(found.items())}


def import_package(folder: str | Path, fresh: bool = False) -> ModuleType:
    """Import the package in ``folder`` under a private name (its stage modules import relatively):
    the one importer of a package folder (ranks, verify, export). Imported once per process, or
    again with ``fresh`` (a package re-written in place, as ``verify`` may see)."""
    path = Path(folder).resolve()
    init = path / "__init__.py"
    if not init.exists():
        raise RunError(f"{path} has no __init__.py; it is not a package written by `pipeplan partition`")
    name = "pipeplan_pkg_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if fresh:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(path)])
    if spec is None or spec.loader is None:
        raise RunError(f"cannot import the package in {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        missing = getattr(exc, "name", None) or ""
        if isinstance(exc, ModuleNotFoundError) and missing.startswith(name + "."):
            lost = path / (missing.removeprefix(name + ".").replace(".", "/") + ".py")
            raise RunError(f"{lost} is missing; regenerate the package with `pipeplan partition`") from exc
        raise RunError(f"importing {init} failed: {type(exc).__name__}: {exc}") from exc
    for attr in ("model", "criterion"):
        if not callable(getattr(module, attr, None)):
            raise RunError(f"{init} does not define {attr}(); regenerate it with `pipeplan partition`")
    return module


def read_wiring(package: ModuleType, stages: int, module_stages: Sequence[int] = ()) -> Wiring:
    """Build ``model(criterion)`` on the meta device and read its names; check it matches mp_conf.

    ``module_stages`` is mp_conf.json's ``module_to_stage_map``; empty means one module per stage.
    """
    with torch.device("meta"):
        entries = package.model(package.criterion())
    owners = tuple(module_stages) or (*range(stages), stages - 1)
    if len(entries) != len(owners):
        raise RunError(
            f"model() returns {len(entries)} entries, mp_conf.json's module_to_stage_map has {len(owners)}"
        )
    if not all(isinstance(e[0], nn.Module) for e in entries[:-1]):
        raise RunError("model() must return modules as the first element of each entry")
    loss_ins = [str(n) for n in entries[-1][1]]
    if len(loss_ins) != 1:
        raise RunError(f"the criterion must read exactly one output of the last stage, reads {loss_ins}")
    modules = tuple(
        tuple(
            (tuple(str(n) for n in e[1]), tuple(str(n) for n in e[2]))
            for e, owner in zip(entries[:-1], owners, strict=False)
            if owner == k
        )
        for k in range(stages)
    )
    ins = tuple(_stage_reads(group) for group in modules)
    outs = tuple(_stage_returns(modules, ins, k, loss_ins[0]) for k in range(stages))
    if loss_ins[0] not in outs[-1]:
        raise RunError(f"the criterion must read exactly one output of the last stage, reads {loss_ins}")
    wiring = Wiring(ins, outs, loss_ins[0], modules)
    for k in range(1, stages):
        external = [n for n in ins[k] if wiring.producer(n) is None]
        if external:
            raise RunError(f"stage {k} reads model inputs {external}; only the first stage may read inputs")
    return wiring


def _stage_reads(group: Sequence[tuple[Names, Names]]) -> Names:
    """What a stage reads from outside: its one module's inputs, or those of its modules that no
    earlier module of the stage returns (each once, in order of first use)."""
    if len(group) == 1:
        return group[0][0]
    made: set[str] = set()
    reads: list[str] = []
    for ins, outs in group:
        reads += [n for n in ins if n not in made and n not in reads]
        made.update(outs)
    return tuple(reads)


def _stage_returns(
    modules: Sequence[Sequence[tuple[Names, Names]]], ins: Sequence[Names], k: int, loss: str
) -> Names:
    """What stage ``k`` returns: its one module's outputs, or those of its modules that a later
    stage or the criterion reads (each once, in order of production)."""
    group = modules[k]
    if len(group) == 1:
        return group[0][1]
    later = {n for j in range(k + 1, len(modules)) for n in ins[j]} | (
        {loss} if k == len(modules) - 1 else set()
    )
    made: list[str] = []
    for _, outs in group:
        made += [n for n in outs if n in later and n not in made]
    return tuple(made)


class ModuleChain(nn.Module):
    """Several modules of one stage played in order, tensors routed by name, as one stage module."""

    def __init__(
        self, modules: Sequence[nn.Module], wires: Sequence[tuple[Names, Names]], ins: Names, outs: Names
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self.wires, self.ins, self.outs = tuple(wires), ins, outs

    def forward(self, *inputs: Any) -> Any:
        env = dict(zip(self.ins, inputs, strict=True))
        for module, (ins, outs) in zip(self.parts, self.wires, strict=True):
            result = module(*(env[n] for n in ins))
            env.update(zip(outs, (result,) if len(outs) == 1 else tuple(result), strict=True))
        found = tuple(env[n] for n in self.outs)
        return found[0] if len(found) == 1 else found


def build_stage(
    package: ModuleType,
    wiring: Wiring,
    stage: int,
    module_stages: Sequence[int] = (),
    seed: int = 0,
    device: str | torch.device = "cpu",
    weights: str | None = None,
) -> nn.Module:
    """This rank's stage module: ``stage(k, seed)`` where the package has it and the stage is one
    module (only the stage's tensors are made, or read from ``weights``); otherwise the stage's
    entries of ``model(criterion)`` (built under ``seed``, the whole model, as PipeDream's runtime
    does), chained."""
    single = not wiring.stage_modules or len(wiring.stage_modules[stage]) == 1
    if single and callable(getattr(package, "stage", None)):
        extra = {"weights": weights} if weights else {}
        built = package.stage(stage, seed=seed, device=str(device), **extra)
        return built.to(device)  # type: ignore[no-any-return]
    if weights:
        raise RunError("--weights needs a package written by `pipeplan partition` (its stage(k) builds one)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        entries = package.model(package.criterion())
    stages = len(wiring.stage_inputs)
    owners = tuple(module_stages) or (*range(stages), stages - 1)
    mine = [e[0] for e, owner in zip(entries[:-1], owners, strict=False) if owner == stage]
    if single:
        return mine[0].to(device)  # type: ignore[no-any-return]
    wires = wiring.stage_modules[stage]
    return ModuleChain(mine, wires, wiring.stage_inputs[stage], wiring.stage_outputs[stage]).to(device)


def reads_weights(package: ModuleType) -> bool:
    """Whether the package's ``stage(k, ...)`` takes ``weights`` (packages written before it did not)."""
    import inspect

    stage = getattr(package, "stage", None)
    return callable(stage) and "weights" in inspect.signature(stage).parameters
