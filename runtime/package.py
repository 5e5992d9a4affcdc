"""Import a generated package and read its wiring: which stage produces and consumes which tensor.

The wiring comes from the package's own ``model(criterion)`` (PipeDream's list of
``(module, in_names, out_names)``), built on the meta device so no rank allocates the stages it
does not run. A rank then builds only its own stage with ``stage(k, seed)``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from runtime.errors import RunError

__all__ = ["Wiring", "import_package", "read_wiring"]


@dataclass(frozen=True)
class Wiring:
    """Tensor names in and out of every stage.

    Attributes:
        stage_inputs: per stage, its forward's positional inputs by name.
        stage_outputs: per stage, the names of what its forward returns.
        loss_input: the last stage output the criterion reads.
    """

    stage_inputs: tuple[tuple[str, ...], ...]
    stage_outputs: tuple[tuple[str, ...], ...]
    loss_input: str

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
            if k is not None:
                found.setdefault(k, []).append(name)
        return {k: tuple(v) for k, v in sorted(found.items())}


def import_package(folder: str | Path) -> ModuleType:
    """Import the package in ``folder`` under a private name (its stage modules import relatively)."""
    path = Path(folder).resolve()
    init = path / "__init__.py"
    if not init.exists():
        raise RunError(f"{path} has no __init__.py; it is not a package written by `pipeplan partition`")
    name = "pipeplan_pkg_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
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
    for attr in ("stage", "model", "criterion", "example_inputs", "example_targets"):
        if not callable(getattr(module, attr, None)):
            raise RunError(f"{init} does not define {attr}(); regenerate it with `pipeplan partition`")
    return module


def read_wiring(package: ModuleType, stages: int) -> Wiring:
    """Build ``model(criterion)`` on the meta device and read its names; check it matches mp_conf."""
    with torch.device("meta"):
        entries = package.model(package.criterion())
    if len(entries) != stages + 1:
        raise RunError(f"model() returns {len(entries)} entries, mp_conf.json expects {stages} stages + loss")
    ins = tuple(tuple(str(n) for n in e[1]) for e in entries[:-1])
    outs = tuple(tuple(str(n) for n in e[2]) for e in entries[:-1])
    loss_ins = [str(n) for n in entries[-1][1]]
    if len(loss_ins) != 1 or loss_ins[0] not in outs[-1]:
        raise RunError(f"the criterion must read exactly one output of the last stage, reads {loss_ins}")
    wiring = Wiring(ins, outs, loss_ins[0])
    for k in range(1, stages):
        external = [n for n in ins[k] if wiring.producer(n) is None]
        if external:
            raise RunError(f"stage {k} reads model inputs {external}; only the first stage may read inputs")
    if not isinstance(entries[0][0], nn.Module):
        raise RunError("model() must return modules as the first element of each entry")
    return wiring
