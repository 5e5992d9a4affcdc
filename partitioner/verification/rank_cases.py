"""What each 3D stage's ranks are given and held to, made by the plain stages in one process.

A 3D stage's ``d`` copies each run their own share of a minibatch (the runtime hands a copy its
microbatches), and its ``t`` tensor ranks of a copy run that share together. So the minibatch is
split into ``d`` parts as the runtime splits it (every input along its first dimension), and for
each part the plain stages run as :class:`~partitioner.verification.verify._Chain` runs them (each
built by the package's ``stage(k, seed)``, fed fresh leaves, its backward from the gradients the
later stages sent): what a stage read, under which random state, the gradients its outputs got
(or, for the last stage, the part's targets), what it returned and its inputs' gradients are
written for that copy, one file each, and its parameters' gradients summed over the parts (what
the copies' summed collectives give) in one more file. A rank then reads only its own stage's
files, so the check holds one stage's tensors at a time on either side.

The plain stages are the original model's layers: the one-process check
(:func:`partitioner.verification.verify.verify_package`) holds their tensors and gradients to the
original model's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from partitioner.verification.verify import _Chain
from runtime.building.stage_init import loss_input

__all__ = ["case_file", "grads_file", "write_cases"]

StageNames = list[tuple[list[str], list[str]]]  # (each stage's input and output names)


def case_file(folder: Path, stage: int, copy: int) -> Path:
    """Where copy ``copy`` of stage ``stage`` finds its inputs and what it is held to."""
    return Path(folder) / f"stage{stage}-copy{copy}.pt"


def grads_file(folder: Path, stage: int) -> Path:
    """Where stage ``stage``'s parameter gradients, summed over its copies' parts, are kept."""
    return Path(folder) / f"stage{stage}-grads.pt"


def part(values: Mapping[str, Any], parts: int, i: int) -> dict[str, Any]:
    """Part ``i`` of ``parts`` of every batch-first tensor, as the runtime splits a minibatch."""
    return {
        n: torch.tensor_split(v, parts)[i] if isinstance(v, torch.Tensor) else v for n, v in values.items()
    }


def write_cases(
    package: ModuleType,
    wiring: StageNames,
    seed: int,
    criterion: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    targets: torch.Tensor,
    copies: Mapping[int, int],
    folder: Path,
) -> None:
    """The files of every stage in ``copies`` (stage -> its ``d``) under ``folder``: one chain of the
    plain stages per part, for each ``d`` the stages have."""
    for d in sorted(set(copies.values())):
        wanted = {k for k, c in copies.items() if c == d}
        for i in range(d):
            ins, ys = part(inputs, d, i), torch.tensor_split(targets, d)[i]
            _one_part(package, wiring, seed, criterion, ins, ys, wanted, i, folder)


def _one_part(
    package: ModuleType,
    wiring: StageNames,
    seed: int,
    criterion: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    targets: torch.Tensor,
    wanted: set[int],
    copy: int,
    folder: Path,
) -> None:
    """The plain stages forward and backward on one part; each stage of ``wanted`` written as it is
    done (every stage's backward runs: the earlier ones need the gradients it sends)."""
    chain = _Chain(package, wiring, seed, criterion)
    chain.forward(inputs, targets)
    last = len(wiring) - 1
    for k in reversed(range(len(wiring))):
        outs = wiring[k][1]
        sent = {n: chain.grads[n] for n in outs if n in chain.grads}  # (before this stage adds its own)
        module = package.stage(k, seed).train()
        leaves, results = chain.backward(k, module)
        if k in wanted:
            case: dict[str, Any] = {
                "inputs": {n: _plain(v) for n, v in leaves.items()},
                "needs_grad": [
                    n for n, v in leaves.items() if isinstance(v, torch.Tensor) and v.requires_grad
                ],
                "rng": chain.states[k],
                "outputs": _outputs(outs, results, k == last),
                "input_grads": {n: v.grad for n, v in leaves.items() if getattr(v, "grad", None) is not None},
            }
            case["targets" if k == last else "output_grads"] = targets if k == last else sent
            torch.save(case, case_file(folder, k, copy))
            _add_grads(grads_file(folder, k), module)
        del module, leaves, results


def _plain(value: Any) -> Any:
    """A stage input as a file keeps it: tensors detached (whether it needs a gradient is listed)."""
    return value.detach() if isinstance(value, torch.Tensor) else value


def _outputs(names: list[str], results: tuple[Any, ...], last: bool) -> dict[str, torch.Tensor]:
    """The tensors a stage returned, by name; the last stage's as the loss reads it."""
    if last:
        return {names[0]: loss_input(results[0]).detach()}
    return {n: r.detach() for n, r in zip(names, results, strict=True) if isinstance(r, torch.Tensor)}


def _add_grads(path: Path, module: nn.Module) -> None:
    """The stage's parameter gradients added to those of the parts before (a missing one is zero)."""
    grads = {n: p.grad.detach() for n, p in module.named_parameters() if p.grad is not None}
    if path.exists():
        before: dict[str, torch.Tensor] = torch.load(path, weights_only=True)
        for n, g in before.items():
            grads[n] = grads[n] + g if n in grads else g
    torch.save(grads, path)
