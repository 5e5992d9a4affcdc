"""Check a generated package against its own unsplit model before spending cluster time on it.

One minibatch, one stage at a time, so the check needs the memory of a stage and never of the model
(a 70B model is verified where it could never be built):

1. the chain forward: each ``stage(k, seed)`` is built, run on what the earlier stages returned (as
   fresh autograd leaves, as a rank receives them) and dropped; only the tensors between stages stay;
2. for each stage from the last: it is built again, its tensors compared with the same tensors of the
   original model (``_stagekit.Original``, made one at a time), its forward run again from the kept
   inputs (the same random state: dropout agrees) and its backward from the gradients the later
   stages sent; then the original model's own ``forward`` runs once more with this stage's parameters
   as its leaves and every other weight made when read and dropped after
   (:mod:`partitioner.verification.streamed`), and each parameter's gradient is compared with the stage's as
   it arrives.

Tied parameters split across stages are compared as the sum of their copies' gradients, which is what
the runtime's all-reduce of tied gradients produces. The original's output and loss are compared with
the chain's. Memory: a stage's weights and gradients, the tensors between stages and one forward's
activations.

Tolerance: float32, ``|a - b| <= atol + rtol * |b|`` elementwise with rtol=1e-4, atol=1e-5 (the chain
runs the same kernels in the same order, so fx-traced packages usually match bit for bit; aten graphs
from torch.export differ from eager modules by rounding).

Example:
    >>> report = verify_package(Path("models/vgg16/gpus=4"))  # doctest: +SKIP
    >>> report.ok
    True
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from partitioner.errors import PackageError, PipeplanError
from partitioner.plan import Plan, load_plan, mp_conf
from partitioner.verification.streamed import Streamed
from runtime.building.stage_init import loss_input
from runtime.errors import RunError
from runtime.packages.load import import_package

__all__ = ["ATOL", "RTOL", "StageCheck", "VerifyReport", "load_package", "verify_package"]

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
    """The package, imported afresh (it may have been re-written in place) by the runtime's importer."""
    try:
        return import_package(folder, fresh=True)
    except RunError as exc:
        raise PackageError(str(exc)) from exc


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
    folder: Path,
    seed: int = 0,
    batch_size: int | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
    progress: Callable[[str, int, int], None] = lambda *_: None,
) -> VerifyReport:
    """Compare the package's stages with its original model on one minibatch (see the module
    docstring). ``progress(what, stages done, stages)`` is called as each phase starts: a large
    model's check takes minutes."""
    package, plan, _ = load_package(folder)
    static = plan.extra.get("static_batch_size")
    if static and batch_size and batch_size != static:
        raise PackageError(f"{folder} was exported with static shapes for batch {static}, not {batch_size}")
    batch = batch_size or static or plan.batch_size or 2
    original = _original(package, folder, seed)
    criterion = package.criterion()
    with torch.device("meta"):
        entries = package.model(criterion)
    chain = _Chain(package, [(list(e[1]), list(e[2])) for e in entries[:-1]], seed, criterion)
    inputs = package.example_inputs(batch)
    targets = package.example_targets(batch)
    progress(f"forward through the stages at batch {batch}", 0, len(chain.wiring))
    output, loss = chain.forward(inputs, targets)
    reference = _Reference(Streamed(original), plan, criterion, targets, seed, rtol, atol)
    call = _caller(plan, inputs)
    results: dict[int, tuple[int, int, float]] = {}
    for k in reversed(range(len(chain.wiring))):
        progress(f"checking stage {k}'s gradients at batch {batch}", len(results), len(chain.wiring))
        module = package.stage(k, seed).train()
        init_error = _max_error(_init_pairs(module, original))
        params = dict(module.named_parameters())
        results[k] = (sum(p.numel() for p in params.values()), len(params), init_error)
        chain.backward(k, module)
        grads = {name: p.grad for name, p in params.items()}
        for p in params.values():
            p.grad = None
        del module
        reference.check(k, params, grads, call)
        del params, grads
    ref_output, ref_loss = reference.output, reference.loss
    assert ref_output is not None and ref_loss is not None
    out, ref_out = loss_input(output).detach(), ref_output
    code_names = dict(getattr(package, "TENSOR_NAMES", {}))  # PipeDream's name -> the stage code's
    checks = tuple(
        StageCheck(
            k,
            results[k][0],
            results[k][1],
            tuple(code_names.get(n, n) for n in chain.wiring[k][0]),
            tuple(code_names.get(n, n) for n in chain.wiring[k][1]),
            results[k][2],
            reference.errors.get(k, 0.0),
            results[k][2] == 0.0 and k not in reference.mismatched,
        )
        for k in range(len(chain.wiring))
    )
    loss_ok = _close(loss, ref_loss, rtol, atol) and _close(out, ref_out, rtol, atol)
    return VerifyReport(
        package=Path(folder),
        model=package.arch(),
        batch_size=batch,
        seed=seed,
        stages=checks,
        loss=float(ref_loss),
        loss_error=float((loss - ref_loss).abs()),
        output_error=_max_error([(out, ref_out)]),
        rtol=rtol,
        atol=atol,
        ok=loss_ok and all(c.ok for c in checks),
        ties=tuple(
            f"{t.name} held by " + ", ".join(f"stage {k} as {n}" for k, n in t.members) for t in plan.ties
        ),
    )


Tensors = dict[str, Any]


def _original(package: ModuleType, folder: Path, seed: int) -> Any:
    """The package's original model, without its tensors (its own ``_stagekit.Original``)."""
    kit, source = getattr(package, "_stagekit", None), getattr(package, "_source", None)
    if kit is None or source is None or not hasattr(kit, "Original"):
        raise PackageError(f"{folder} predates stage-by-stage verification; re-run `pipeplan partition`")
    return kit.Original(source.factory(), seed, source.WEIGHTS, source.INIT)


def _caller(plan: Plan, inputs: Mapping[str, torch.Tensor]) -> Callable[[nn.Module], Any]:
    """How the original model is called: by its inputs' names (Hugging Face) or by position."""
    if plan.extra.get("keyword_inputs"):
        names = [str(spec["name"]) for spec in plan.extra["inputs"]]
        by_name = dict(zip(names, inputs.values(), strict=True))
        return lambda model: model(**by_name)
    return lambda model: model(*inputs.values())


def _leaf(t: Any) -> Any:
    """What a rank receives: the tensor detached, needing a gradient where its sender's did."""
    return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


class _Chain:
    """The stages run one at a time: a forward keeping what crosses stages, then backward stage by
    stage (each recomputing its forward from its kept inputs, under the random state of the first)."""

    def __init__(
        self, package: ModuleType, wiring: list[tuple[list[str], list[str]]], seed: int, criterion: nn.Module
    ) -> None:
        self.package, self.wiring, self.seed, self.criterion = package, wiring, seed, criterion
        self.env: Tensors = {}
        self.states: list[torch.Tensor] = []
        self.grads: Tensors = {}
        self.targets: torch.Tensor | None = None

    def _run(self, k: int, module: nn.Module) -> tuple[dict[str, torch.Tensor], tuple[Any, ...]]:
        ins, outs = self.wiring[k]
        missing = [n for n in ins if n not in self.env]
        if missing:
            raise PackageError(f"stage {k} reads {missing}, which no earlier stage returns")
        leaves = {n: _leaf(self.env[n]) for n in ins}
        try:
            result = module(*leaves.values())
        except Exception as exc:
            raise PackageError(f"stage {k} failed on its received inputs: {exc}") from exc
        results = (result,) if len(outs) == 1 else tuple(result)
        if len(results) != len(outs):
            raise PackageError(f"stage {k} returns {len(results)} tensors, declares {len(outs)}")
        return leaves, results

    def forward(self, inputs: Mapping[str, torch.Tensor], targets: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """(the last stage's output, the loss), every stage built and dropped in turn."""
        self.env, self.targets = dict(inputs), targets
        torch.manual_seed(self.seed)
        for k in range(len(self.wiring)):
            self.states.append(torch.get_rng_state())
            module = self.package.stage(k, self.seed).train()
            _, results = self._run(k, module)
            self.env.update({n: _detached(r) for n, r in zip(self.wiring[k][1], results, strict=True)})
            del module, results
        output = self.env[self.wiring[-1][1][0]]
        with torch.no_grad():
            return output, self.criterion(output, targets).detach()

    def backward(self, k: int, module: nn.Module) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """Stage ``k``'s backward; its parameters' ``.grad`` are set, its inputs' gradients kept.
        Returns its inputs as the leaves it read (each with its own ``.grad``) and its results (the
        check on ranks holds a 3D stage to them: :mod:`partitioner.verification.rank_cases`)."""
        torch.set_rng_state(self.states[k])
        leaves, results = self._run(k, module)
        if k == len(self.wiring) - 1:
            self.criterion(results[0], self.targets).backward()
        else:
            pairs = [
                (r, self.grads[n])
                for n, r in zip(self.wiring[k][1], results, strict=True)
                if n in self.grads and isinstance(r, torch.Tensor) and r.requires_grad
            ]
            if pairs:
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        for name, leaf in leaves.items():
            grad = getattr(leaf, "grad", None)
            if grad is not None:
                self.grads[name] = self.grads[name] + grad if name in self.grads else grad
        return leaves, results


def _detached(value: Any) -> Any:
    """A stage's result kept between stages: tensors detached, still marked as needing a gradient."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


class _Reference:
    """The original model's forward and backward, once per stage with that stage's parameters as
    its leaves; compares each parameter's gradient with the stage's as it arrives, then drops it."""

    def __init__(
        self,
        streamed: Streamed,
        plan: Plan,
        criterion: nn.Module,
        targets: torch.Tensor,
        seed: int,
        rtol: float,
        atol: float,
    ) -> None:
        self.streamed, self.criterion, self.targets, self.seed = streamed, criterion, targets, seed
        self.rtol, self.atol = rtol, atol
        self.output: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.errors: dict[int, float] = {}
        self.mismatched: set[int] = set()
        canonical = streamed.original.canonical
        self.holders: dict[str, list[int]] = {}  # a tied weight's canonical name -> the stages holding it
        for tie in plan.ties:
            for stage, name in tie.members:
                self.holders.setdefault(canonical.get(name, name), []).append(stage)
        self.tied_chain: dict[str, torch.Tensor | None] = {}
        self.tied_reference: dict[str, torch.Tensor | None] = {}
        self.tied_seen: dict[str, list[int]] = {}

    def check(
        self, k: int, params: Mapping[str, nn.Parameter], grads: Mapping[str, torch.Tensor | None], call: Any
    ) -> None:
        """One pass of the original model for stage ``k``; ``grads`` are the stage's own."""
        reached: set[str] = set()
        handles = [
            param.register_post_accumulate_grad_hook(self._hook(k, name, grads.get(name), reached))  # type: ignore[no-untyped-call]
            for name, param in params.items()
            if param.requires_grad  # a frozen weight (whisper's positions) gets no gradient to compare
        ]
        torch.manual_seed(self.seed)
        try:
            with self.streamed.resident(params), self.streamed.running():
                output = call(self.streamed.model)
            loss = self.criterion(output, self.targets)
            if loss.requires_grad:  # else no parameter of this stage needs a gradient
                loss.backward()
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise PackageError(
                f"the original model failed on the minibatch: {type(exc).__name__}: {first}"
            ) from exc
        finally:
            for handle in handles:
                handle.remove()
        if self.output is None:  # what the loss reads, without the graph behind it
            self.output, self.loss = loss_input(output).detach(), loss.detach()
        for name in params.keys() - reached:  # parameters the original's loss does not reach
            self._arrived(k, name, grads.get(name), None)

    def _hook(
        self, k: int, name: str, mine: torch.Tensor | None, reached: set[str]
    ) -> Callable[[torch.Tensor], None]:
        def compare(param: torch.Tensor) -> None:
            reached.add(name)
            self._arrived(k, name, mine, param.grad)
            param.grad = None

        return compare

    def _arrived(self, k: int, name: str, mine: torch.Tensor | None, theirs: torch.Tensor | None) -> None:
        tie = self.streamed.original.canonical.get(name, name)
        if tie in self.holders:
            self._tied(k, tie, mine, theirs)
        else:
            self._compare(k, mine, theirs)

    def _compare(self, k: int, mine: torch.Tensor | None, theirs: torch.Tensor | None) -> None:
        self.errors[k] = max(self.errors.get(k, 0.0), _max_error([(mine, theirs)]))
        if not _close(mine, theirs, self.rtol, self.atol):
            self.mismatched.add(k)

    def _tied(self, k: int, tie: str, mine: torch.Tensor | None, theirs: torch.Tensor | None) -> None:
        """A tied weight: the sum of its holders' gradients against the original's, once all are in."""
        if mine is not None:
            before = self.tied_chain.get(tie)
            self.tied_chain[tie] = mine.detach().clone() if before is None else before + mine
        if theirs is not None:
            self.tied_reference[tie] = theirs.detach().clone()
        self.tied_seen.setdefault(tie, []).append(k)
        if sorted(self.tied_seen[tie]) == sorted(self.holders[tie]):
            for holder in self.holders[tie]:
                self._compare(holder, self.tied_chain.get(tie), self.tied_reference.get(tie))


def _init_pairs(stage: nn.Module, original: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each of the stage's tensors and the original model's, made one at a time."""
    for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
        if name not in original.slots:
            raise PackageError(f"a stage holds {name!r}, which the full model lacks; re-run partition")
        canonical = original.canonical[name]
        yield tensor.detach(), original.values([name])[canonical]


_CHUNK = 1 << 20  # elements compared at a time: the temporaries of a comparison stay small


def _flat(t: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor:
    """A tensor as a flat float view for comparing; a missing gradient is zeros shaped like the other."""
    if t is not None:
        return t.detach().reshape(-1)
    return torch.zeros(like.numel() if like is not None else 1)


def _shapes_differ(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape != b.shape


def _max_error(pairs: Any) -> float:
    """The largest |a - b| over pairs (inf where shapes differ), a chunk at a time."""
    worst = 0.0
    for a, b in pairs:
        if _shapes_differ(a, b):
            return float("inf")
        if a is not None and b is not None and torch.equal(a, b):
            continue
        x, y = _flat(a, b), _flat(b, a)
        for start in range(0, x.numel(), _CHUNK):
            part = (x[start : start + _CHUNK].float() - y[start : start + _CHUNK].float()).abs()
            worst = max(worst, float(part.max()))
    return worst


def _close(a: torch.Tensor | None, b: torch.Tensor | None, rtol: float, atol: float) -> bool:
    """``|a - b| <= atol + rtol * |b|`` everywhere, a chunk at a time."""
    if _shapes_differ(a, b):
        return False
    if a is not None and b is not None and torch.equal(a, b):
        return True
    x, y = _flat(a, b), _flat(b, a)
    return all(
        torch.allclose(x[i : i + _CHUNK].float(), y[i : i + _CHUNK].float(), rtol=rtol, atol=atol)
        for i in range(0, x.numel(), _CHUNK)
    )
