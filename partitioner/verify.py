"""Check a generated package against its own unsplit model before spending cluster time on it.

One process, one minibatch: build ``full_model(seed)`` and every ``stage(k, seed)``, check the initial
parameters are equal, push the batch through the original model and through the stage chain (wired by
the names ``model(criterion)`` declares), and compare the output, the loss and every parameter gradient.
Tied parameters split across stages are compared as the sum of their copies' gradients, which is what
the runtime's all-reduce of tied gradients produces.

Tolerance: float32, ``|a - b| <= atol + rtol * |b|`` elementwise with rtol=1e-4, atol=1e-5 (the chain
runs the same kernels in the same order, so fx-traced packages usually match bit for bit; aten graphs
from torch.export differ from eager modules by rounding).

Example:
    >>> report = verify_package(Path("models/vgg16/gpus=4"))  # doctest: +SKIP
    >>> report.ok
    True
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from partitioner.errors import PackageError, PipeplanError
from partitioner.plan import Plan, load_plan, mp_conf

__all__ = ["ATOL", "RTOL", "StageCheck", "VerifyReport", "load_package", "newest_package", "verify_package"]

RTOL = 1e-4
ATOL = 1e-5
_REQUIRED = ("__init__.py", "_source.py", "_stagekit.py", "mp_conf.json", "plan.json")


@dataclass(frozen=True)
class StageCheck:
    """How one stage compares with the same layers inside the full model.

    Attributes:
        index: stage position.
        params: parameter elements the stage holds.
        tensors: parameter tensors the stage holds.
        in_names: tensors it reads (as the stage's code names them).
        out_names: tensors it returns (as the stage's code names them).
        init_error: max |stage - full model| over its initial parameters.
        grad_error: max |stage - full model| over its parameter gradients.
        ok: init equal and gradients within tolerance.
    """

    index: int
    params: int
    tensors: int
    in_names: tuple[str, ...]
    out_names: tuple[str, ...]
    init_error: float
    grad_error: float
    ok: bool


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify_package`."""

    package: Path
    model: str
    batch_size: int
    seed: int
    stages: tuple[StageCheck, ...]
    loss: float
    loss_error: float
    output_error: float
    rtol: float
    atol: float
    ok: bool
    ties: tuple[str, ...] = ()


def newest_package(root: Path = Path("models")) -> Path:
    """The most recently written package under ``root``: what ``pipeplan verify`` checks by default."""
    found = [p.parent for p in Path(root).glob("**/mp_conf.json") if (p.parent / "__init__.py").exists()]
    if not found:
        raise PackageError(
            f"no package under {root}/; write one with `pipeplan partition` or name its folder"
        )
    return max(found, key=lambda p: (p / "mp_conf.json").stat().st_mtime)


def load_package(folder: Path) -> tuple[ModuleType, Plan, dict[str, Any]]:
    """Import a package folder and read its plan and mp_conf; PackageError says what is missing or wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PackageError(f"{folder} is not a folder; name a package written by `pipeplan partition`")
    missing = [name for name in _REQUIRED if not (folder / name).is_file()]
    if missing and not (folder / "__init__.py").exists() and (folder / "plan.json").is_file():
        raise PackageError(
            f"{folder} holds a plan but no stage code (missing {', '.join(missing)}): plans from a PipeDream "
            "graph.txt have no model to verify; profile the model itself with `pipeplan profile`"
        )
    if missing:
        raise PackageError(
            f"{folder} is not a complete package: missing {', '.join(missing)}; re-run partition"
        )
    try:
        plan = load_plan(folder / "plan.json")
        conf = json.loads((folder / "mp_conf.json").read_text(encoding="utf-8"))
    except (PipeplanError, ValueError) as exc:
        raise PackageError(f"{folder}: {exc}") from exc
    absent = [f"stage{s.index}.py" for s in plan.stages if not (folder / f"stage{s.index}.py").is_file()]
    if absent:
        raise PackageError(f"{folder} is missing {', '.join(absent)} for its {len(plan.stages)}-stage plan")
    package = _import(folder)
    _check_consistent(folder, package, plan, conf)
    return package, plan, conf


def _import(folder: Path) -> ModuleType:
    path = folder.resolve()
    name = "pipeplan_verify_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]  # a package re-written in place must be re-imported
    spec = importlib.util.spec_from_file_location(
        name, path / "__init__.py", submodule_search_locations=[str(path)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise PackageError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _check_consistent(folder: Path, package: ModuleType, plan: Plan, conf: Mapping[str, Any]) -> None:
    """The plan, mp_conf.json and the package's own model() must describe the same pipeline."""
    arch = package.arch()
    if plan.model and plan.model != arch:
        raise PackageError(f"{folder}/plan.json is for model {plan.model!r} but the package builds {arch!r}")
    with torch.device("meta"):
        entries = package.model(package.criterion())
    if len(entries) != len(plan.stages) + 1:
        raise PackageError(
            f"{folder}: model() has {len(entries) - 1} stages, plan.json {len(plan.stages)}; re-run partition"
        )
    expected = mp_conf(plan.stages)
    if list(conf.get("module_to_stage_map", [])) != expected["module_to_stage_map"]:
        raise PackageError(
            f"{folder}/mp_conf.json module_to_stage_map does not match model()'s {len(entries)} entries"
        )
    if dict(conf.get("stage_to_rank_map", {})) != expected["stage_to_rank_map"]:
        raise PackageError(f"{folder}/mp_conf.json stage_to_rank_map does not match plan.json's stage ranks")


def run_batch_sizes(folder: Path) -> tuple[int, ...]:
    """The batch sizes one forward of the package runs at: a microbatch (what each rank runs under the
    plan's microbatches and replicas) and the whole minibatch; a static-shape package only its own."""
    _, plan, _ = load_package(folder)
    static = plan.extra.get("static_batch_size")
    if static:
        return (int(static),)
    batch = plan.batch_size or 2
    micro = max(1, batch // max(1, plan.microbatches))
    return tuple(dict.fromkeys((micro, batch)))


def verify_package(
    folder: Path, seed: int = 0, batch_size: int | None = None, rtol: float = RTOL, atol: float = ATOL
) -> VerifyReport:
    """Compare the package's stage chain with its full model on one minibatch (see the module docstring)."""
    package, plan, _ = load_package(folder)
    static = plan.extra.get("static_batch_size")
    if static and batch_size and batch_size != static:
        raise PackageError(f"{folder} was exported with static shapes for batch {static}, not {batch_size}")
    batch = batch_size or static or plan.batch_size or 2
    inputs = package.example_inputs(batch)
    targets = package.example_targets(batch)
    criterion = package.criterion()
    reference = package.full_model(seed).train()
    entries = package.model(criterion, seed)
    stages: list[nn.Module] = [e[0].train() for e in entries[:-1]]
    init_errors = [_max_error(_pairs(reference, stage)) for stage in stages]
    from partitioner.stagekit import loss_input

    torch.manual_seed(seed)
    if plan.extra.get("keyword_inputs"):  # called by the model's own argument names (Hugging Face)
        names = [str(spec["name"]) for spec in plan.extra["inputs"]]
        ref_output = reference(**dict(zip(names, inputs.values(), strict=True)))
    else:
        ref_output = reference(*inputs.values())
    ref_loss = criterion(ref_output, targets)  # the loss reads the output as the model returns it
    ref_loss.backward()
    ref_out = loss_input(ref_output)
    torch.manual_seed(seed)
    output, loss, sent, received = _run_chain(entries, inputs, targets)
    out = loss_input(output)
    _backward_chain(loss, sent, received)
    grads = _stage_grads(stages, plan)
    ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    checks = []
    code_names = dict(getattr(package, "TENSOR_NAMES", {}))  # PipeDream's name -> the stage code's
    for k, stage in enumerate(stages):
        pairs = [(grads[k][n], ref_grads[n]) for n in grads[k]]
        grad_error = _max_error(pairs)
        ok = init_errors[k] == 0.0 and all(_close(a, b, rtol, atol) for a, b in pairs)
        params = list(stage.parameters())
        checks.append(
            StageCheck(
                k,
                sum(p.numel() for p in params),
                len(params),
                tuple(code_names.get(n, n) for n in entries[k][1]),
                tuple(code_names.get(n, n) for n in entries[k][2]),
                init_errors[k],
                grad_error,
                ok,
            )
        )
    loss_ok = _close(loss.detach(), ref_loss.detach(), rtol, atol) and _close(
        out.detach(), ref_out.detach(), rtol, atol
    )
    return VerifyReport(
        package=Path(folder),
        model=package.arch(),
        batch_size=batch,
        seed=seed,
        stages=tuple(checks),
        loss=float(ref_loss.detach()),
        loss_error=float((loss - ref_loss).detach().abs()),
        output_error=_max_error([(out.detach(), ref_out.detach())]),
        rtol=rtol,
        atol=atol,
        ok=loss_ok and all(c.ok for c in checks),
        ties=tuple(
            f"{t.name} held by " + ", ".join(f"stage {k} as {n}" for k, n in t.members) for t in plan.ties
        ),
    )


Tensors = dict[str, torch.Tensor]


def _run_chain(
    entries: Sequence[tuple[nn.Module, list[str], list[str]]],
    inputs: Mapping[str, torch.Tensor],
    targets: torch.Tensor,
) -> tuple[Any, torch.Tensor, list[Tensors], list[Tensors]]:
    """Run the stages in order, as the runtime does: tensors routed by name, and every stage reading
    its inputs as fresh autograd leaves (what it receives on its rank); (the last stage's output as
    the criterion reads it, loss, what each stage returned, what each stage read)."""
    env: Tensors = dict(inputs)
    sent: list[Tensors] = []
    received: list[Tensors] = []
    for module, in_names, out_names in entries[:-1]:
        missing = [n for n in in_names if n not in env]
        if missing:
            raise PackageError(f"{type(module).__name__} reads {missing}, which no earlier stage returns")
        leaves = {n: env[n].detach().requires_grad_(env[n].requires_grad) for n in in_names}
        try:
            result = module(*leaves.values())
        except Exception as exc:
            raise PackageError(f"{type(module).__name__} failed on its received inputs: {exc}") from exc
        results = (result,) if len(out_names) == 1 else tuple(result)
        if len(results) != len(out_names):
            raise PackageError(
                f"{type(module).__name__} returns {len(results)} tensors, declares {len(out_names)}"
            )
        env.update(zip(out_names, results, strict=True))
        sent.append(dict(zip(out_names, results, strict=True)))
        received.append(leaves)
    criterion, loss_in, _ = entries[-1]
    return env[loss_in[0]], criterion(env[loss_in[0]], targets), sent, received


def _backward_chain(loss: torch.Tensor, sent: list[Tensors], received: list[Tensors]) -> None:
    """Backward stage by stage from the last: a stage's output gradient is the sum of the gradients of
    every later stage's leaf of that tensor, as the runtime sends them back."""
    loss.backward()  # type: ignore[no-untyped-call]
    for k in reversed(range(len(sent))):
        outputs, grads = [], []
        for name, tensor in sent[k].items():
            parts = [g for r in received[k + 1 :] if name in r and (g := r[name].grad) is not None]
            if parts and tensor.requires_grad:
                outputs.append(tensor)
                grads.append(torch.stack(parts).sum(0))
        if outputs:
            torch.autograd.backward(outputs, grads)


def _stage_grads(stages: Sequence[nn.Module], plan: Plan) -> list[dict[str, torch.Tensor | None]]:
    """Each stage's gradients by name; tied copies are summed, as the runtime's all-reduce does."""
    grads = [{n: p.grad for n, p in stage.named_parameters()} for stage in stages]
    for tie in plan.ties:
        parts = [grads[k].get(name) for k, name in tie.members]
        present = [g for g in parts if g is not None]
        total = torch.stack(present).sum(0) if present else None
        for k, name in tie.members:
            if name in grads[k]:
                grads[k][name] = total
    return grads


def _pairs(reference: nn.Module, stage: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    ref: dict[str, torch.Tensor] = dict(reference.named_parameters(remove_duplicate=False))
    ref.update(reference.named_buffers(remove_duplicate=False))
    for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
        if name not in ref:
            raise PackageError(
                f"a stage holds {name!r}, which the full model does not have; re-run partition"
            )
        yield tensor.detach(), ref[name].detach()


def _as_tensor(t: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor:
    if t is not None:
        return t.detach().float()
    return torch.zeros(like.shape) if like is not None else torch.zeros(())


def _max_error(pairs: Any) -> float:
    worst = 0.0
    for a, b in pairs:
        x, y = _as_tensor(a, b), _as_tensor(b, a)
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            worst = max(worst, float((x - y).abs().max()))
    return worst


def _close(a: torch.Tensor | None, b: torch.Tensor | None, rtol: float, atol: float) -> bool:
    x, y = _as_tensor(a, b), _as_tensor(b, a)
    return x.shape == y.shape and bool(torch.allclose(x, y, rtol=rtol, atol=atol))
