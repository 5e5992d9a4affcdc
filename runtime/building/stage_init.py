"""Build one pipeline stage's tensors, identical to the full model's, without building the full model.

This file is copied verbatim into every generated package (as ``_stagekit.py``), so it imports only
torch, the standard library and pipeplan's ``runtime``: a cluster node needs those and the user's model
code, never ``partitioner`` (a built-in model's source travels in the package as ``_model.py``).

A stage's initial tensors come from one of three sources (:class:`Original`); a rank materialises
its own stage's tensors and no others:

- ``exact``: as ``torch.manual_seed(seed); factory()`` makes them. The factory runs once with its
  large tensors deferred (:mod:`runtime.building.deferred_init`: no storage, what is done to them recorded,
  the random generator advanced as a real build advances it); the stage's tensors are then replayed.
  Memory: the stage, the model's small tensors and one scratch tensor; time: the model's random
  draws once, then the stage's.
- ``seeded`` (per module): the architecture is built with its parameters on the meta device (buffers,
  and the parameters of modules that cannot re-initialise themselves, stay real with their
  constructor's values under ``torch.manual_seed(seed)``: keep those small); each module owning
  parameters is materialised alone and re-initialised by its ``reset_parameters()`` (and the Hugging
  Face root's ``_init_weights``) under a seed derived from ``(seed, module path)``. A tensor then
  depends only on (seed, its module's path), so no rank draws the rest of the model.
- a checkpoint (``weights``): a ``torch.save(model.state_dict())`` file (memory-mapped), a
  ``.safetensors`` file or a ``save_pretrained`` folder (sharded, ``model.safetensors.index.json``):
  only the stage's tensors are read (:mod:`runtime.building.weight_files`).

``full_model(seed)`` and every ``stage(k, seed)`` agree exactly, whatever the source.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from runtime.building.deferred_init import Deferred, build_deferred
from runtime.building.weight_files import read_tensors
from runtime.files.user_code import file_attr

__all__ = [
    "Original",
    "build_meta",
    "criterion",
    "derive_seed",
    "factory_from_spec",
    "full_model",
    "loss_input",
    "make_inputs",
    "make_targets",
    "populate",
    "synthetic_example",
]


def derive_seed(seed: int, path: str) -> int:
    """A 63-bit seed from (seed, module path): stable across processes, Python versions and machines."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def factory_from_spec(spec: str) -> Callable[[], nn.Module]:
    """The zero-argument factory of ``torchvision:NAME``, ``pkg.mod:fn`` or ``file.py:fn``.

    Built-in (zoo) models are not resolved here: a package carries their source as ``_model.py``.
    """
    if spec.startswith("hf:"):
        return importlib.import_module("runtime.building.hugging_face").factory(spec)  # type: ignore[no-any-return]
    if ":" not in spec:
        raise ValueError(f"{spec!r} is not a model spec a package can load; expected module:function")
    where, name = spec.rsplit(":", 1)
    if where == "torchvision":
        models = importlib.import_module("torchvision.models")
        return models.get_model_builder(name)  # type: ignore[no-any-return]
    if where.endswith(".py"):
        return file_attr(where, name, "model file")  # type: ignore[no-any-return]
    return getattr(importlib.import_module(where), name)  # type: ignore[no-any-return]


def _is_hf(module: nn.Module) -> bool:
    """A Hugging Face model: its ``_init_weights(module)`` knows how every one of its modules starts."""
    return callable(getattr(module, "_init_weights", None)) and any(
        c.__module__.startswith("transformers.") for c in type(module).__mro__
    )


def _reinitialisable(module: nn.Module) -> bool:
    """Whether the module can re-create its parameters later (so they may start on the meta device)."""
    return callable(getattr(module, "reset_parameters", None)) or type(module).__module__.startswith(
        "transformers."
    )


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Register parameters of re-initialisable modules on the meta device (buffers stay real).

    ``nn.Module.register_parameter`` is swapped for the duration of the block (the technique of
    accelerate's ``init_empty_weights``); it is restored even if the factory raises.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta" and _reinitialisable(module):
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def exact_model(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """The model exactly as ``torch.manual_seed(seed); factory()`` builds it (the caller's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _unwrap(factory())


def _unwrap(made: Any) -> nn.Module:
    """A factory may return (module, example inputs); training never reads a Hugging Face KV cache."""
    module: nn.Module = made[0] if isinstance(made, tuple) else made
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
    return module


def build_meta(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """The architecture with re-initialisable parameters on meta; the caller's RNG state is untouched."""
    with torch.random.fork_rng(devices=[]), _parameters_on_meta():
        torch.manual_seed(seed)
        return _unwrap(factory())


def _tensor_slots(root: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every parameter and buffer name (aliases included) -> (owning module, attribute name)."""
    slots: dict[str, tuple[nn.Module, str]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name in list(module._parameters) + list(module._buffers):
            if _store(module, name)[name] is not None:
                slots.setdefault(prefix + name, (module, name))
    return slots


def _canonical_names(root: nn.Module) -> dict[str, str]:
    """Tensor name -> the first name of the same tensor (tied weights share one canonical name)."""
    first: dict[int, str] = {}
    canonical: dict[str, str] = {}
    named = list(root.named_parameters(remove_duplicate=False)) + list(
        root.named_buffers(remove_duplicate=False)
    )
    for name, tensor in named:
        canonical[name] = first.setdefault(id(tensor), name)
    return canonical


def _store(module: nn.Module, attr: str) -> dict[str, Any]:
    """The dict that holds a module's parameter or buffer ``attr`` (assigning there keeps ties exact)."""
    return module._parameters if attr in module._parameters else module._buffers


def _initialised(module: nn.Module, path: str, seed: int, root: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own tensors re-initialised under (seed, path) on the CPU; the module keeps its meta
    tensors (they are put back), so asking again costs the init again but holds nothing."""
    stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
    kept = [dict(store) for store in stores]
    for store in stores:
        for name, tensor in store.items():
            if tensor is not None and tensor.device.type == "meta":
                real = torch.zeros(tensor.shape, dtype=tensor.dtype)
                is_param = isinstance(tensor, nn.Parameter)
                store[name] = nn.Parameter(real, tensor.requires_grad) if is_param else real
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(derive_seed(seed, path))
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            if _is_hf(root) and type(module).__module__.startswith(("transformers.", "torch.nn.")):
                root._init_weights(module)  # type: ignore[operator]
        return {name: t.detach() for store in stores for name, t in store.items() if t is not None}
    finally:
        for store, old in zip(stores, kept, strict=True):
            store.clear()
            store.update(old)


class Original:
    """The unsplit model built without its tensors, and any of its tensors' initial values by name.

    Example:
        >>> original = Original(factory, seed=0, init="exact")  # doctest: +SKIP
        >>> original.materialise(original.stage_names(["features.3"], []), "cuda")  # doctest: +SKIP

    Attributes:
        root: the model: tensors not yet materialised are on the meta device (seeded, checkpoint) or
            deferred (exact); small ones hold their values.
    """

    def __init__(
        self,
        factory: Callable[[], nn.Module],
        seed: int = 0,
        weights: str | None = None,
        init: str = "seeded",
    ) -> None:
        folder = getattr(factory, "pretrained", None)  # an hf: checkpoint folder: read as weights
        if folder and not weights:
            factory, weights = factory.from_config, folder  # type: ignore[attr-defined]
        self.seed, self.weights = seed, weights
        self.deferred: Deferred | None = None
        if init == "exact" and not weights:
            self.deferred = build_deferred(lambda: _unwrap(factory()), seed)
            self.root = self.deferred.module
        else:
            self.root = build_meta(factory, seed)
        self.slots = _tensor_slots(self.root)
        self.canonical = _canonical_names(self.root)
        self.parameters = {n for n, _ in self.root.named_parameters(remove_duplicate=False)}

    def stage_names(self, modules: Iterable[str], tensors: Iterable[str]) -> list[str]:
        """Every tensor name of the submodules ``modules`` plus the single ``tensors`` (aliases kept)."""
        modules = list(modules)
        names = [
            f"{m}.{n}"
            for m in modules
            for n, _ in [
                *self.root.get_submodule(m).named_parameters(remove_duplicate=False),
                *self.root.get_submodule(m).named_buffers(remove_duplicate=False),
            ]
        ]
        inside = tuple(f"{m}." for m in modules)
        return names + [t for t in tensors if not t.startswith(inside)]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in ``root`` as it is now (meta, deferred or real)."""
        module, attr = self.slots[name]
        return _store(module, attr)[attr]  # type: ignore[no-any-return]

    def values(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Initial values on the CPU of the named tensors, by canonical name; ``root`` is unchanged."""
        order = {name: i for i, name in enumerate(self.canonical)}
        wanted = sorted({self.canonical[n] for n in names}, key=order.__getitem__)
        if self.weights:
            return self._read(wanted)
        if self.deferred is not None:
            replayed = self.deferred.materialise([self.tensor(n) for n in wanted])
            return dict(zip(wanted, replayed, strict=True))
        found = {n: self.tensor(n) for n in wanted if self.tensor(n).device.type != "meta"}
        owners: dict[str, list[str]] = {}
        for name in wanted:
            if name not in found:
                owners.setdefault(name.rpartition(".")[0], []).append(name)
        for path, inside in owners.items():
            made = _initialised(self.root.get_submodule(path), path, self.seed, self.root)
            found.update({name: made[name.rpartition(".")[2]] for name in inside})
        return {name: found[name] for name in wanted}

    def _read(self, wanted: Sequence[str]) -> dict[str, torch.Tensor]:
        """From the checkpoint, under any name of each tensor; buffers it lacks keep their built value."""
        assert self.weights is not None
        aliases: dict[str, list[str]] = {}
        for name, canonical in self.canonical.items():
            aliases.setdefault(canonical, []).append(name)
        found = read_tensors(self.weights, [a for n in wanted for a in aliases[n]])
        values: dict[str, torch.Tensor] = {}
        for name in wanted:
            like = self.tensor(name)
            hit = next((found[a] for a in aliases[name] if a in found), None)
            if hit is None and name not in self.parameters and like.device.type != "meta":
                values[name] = like  # a buffer the checkpoint does not keep (non-persistent)
                continue
            if hit is None:
                raise KeyError(f"the weights {self.weights} lack {name}; save the model's state_dict()")
            if hit.shape != like.shape:
                raise ValueError(
                    f"{name} is {tuple(hit.shape)} in {self.weights}, {tuple(like.shape)} in the model"
                )
            values[name] = hit.to(like.dtype)  # a private mapping of the file: pages are read when touched
        return values

    def materialise(self, names: Iterable[str], device: str | torch.device = "cpu") -> None:
        """Give ``root`` the named tensors' initial values on ``device``; tied names stay one tensor."""
        names = list(names)
        for name, value in self.values(names).items():
            module, attr = self.slots[name]
            store, old = _store(module, attr), self.tensor(name)
            tensor = value.to(device)
            store[attr] = nn.Parameter(tensor, old.requires_grad) if attr in module._parameters else tensor
        for name in names:
            module, attr = self.slots[name]
            source_module, source_attr = self.slots[self.canonical[name]]
            _store(module, attr)[attr] = _store(source_module, source_attr)[source_attr]


def full_model(
    factory: Callable[[], nn.Module],
    seed: int = 0,
    device: str | torch.device = "cpu",
    weights: str | None = None,
    init: str = "seeded",
) -> nn.Module:
    """The whole model, every tensor initialised exactly as the stages initialise theirs."""
    if init == "exact" and not weights:
        return exact_model(factory, seed).to(device)
    original = Original(factory, seed, weights, init)
    original.materialise(list(original.slots), device)
    return original.root


def _attach(target: nn.Module, path: str, value: nn.Module | torch.Tensor) -> None:
    """Place a module or tensor at a dotted path, creating plain ``nn.Module`` containers on the way."""
    *parents, leaf = path.split(".")
    holder = target
    for part in parents:
        child = holder._modules.get(part)
        if child is None:
            child = nn.Module()
            holder.add_module(part, child)
        holder = child
    if isinstance(value, nn.Module):
        holder.add_module(leaf, value)
    elif isinstance(value, nn.Parameter):
        holder.register_parameter(leaf, value)
    else:
        holder.register_buffer(leaf, value)


def populate(
    stage: nn.Module,
    factory: Callable[[], nn.Module],
    modules: Iterable[str],
    tensors: Iterable[str],
    seed: int = 0,
    device: str | torch.device = "cpu",
    weights: str | None = None,
    init: str = "seeded",
) -> None:
    """Fill an empty stage module with the original model's ``modules`` and single ``tensors``.

    Attribute paths inside the stage are the original module paths (``features.3``,
    ``transformer.h.0.attn``), so state_dict keys match the full model's. Only the stage's tensors are
    materialised (see the module docstring); on the meta device (or under ``torch.device("meta")``)
    none are: the stage is wiring only.
    """
    modules, tensors = list(modules), list(tensors)
    if torch.device(device).type == "meta" or torch.empty(()).device.type == "meta":
        _attach_all(stage, build_meta(factory, seed), modules, tensors)
        return
    original = Original(factory, seed, weights, init)
    original.materialise(original.stage_names(modules, tensors), device)
    _attach_all(stage, original.root, modules, tensors)


def _attach_all(stage: nn.Module, root: nn.Module, modules: Sequence[str], tensors: Sequence[str]) -> None:
    for path in modules:
        _attach(stage, path, root.get_submodule(path))
    inside = tuple(f"{m}." for m in modules)
    slots = _tensor_slots(root)
    for name in tensors:
        if name.startswith(inside):
            continue
        module, attr = slots[name]
        _attach(stage, name, _store(module, attr)[attr])


def loss_input(output: Any) -> torch.Tensor:
    """The tensor of an output the loss reads: itself, ``.logits``, ``["logits"]``, or the first element."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping):
        value = output["logits"] if "logits" in output else next(iter(output.values()))
        return loss_input(value)
    if isinstance(output, (tuple, list)) and output:
        return loss_input(output[0])
    raise TypeError(f"cannot find a tensor for the loss in a {type(output).__name__}")


class _CrossEntropy(nn.Module):
    """Cross-entropy over the last dimension, class targets (-100 ignored), mean over samples."""

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = loss_input(output)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


class _UserLoss(nn.Module):
    """The model file's own ``loss_fn(output, target)`` as a module."""

    def __init__(self, fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.fn(output, target)


def criterion(kind: str) -> nn.Module:
    """``cross_entropy``, or ``where:loss_fn`` naming a model file's loss function."""
    if kind == "cross_entropy":
        return _CrossEntropy()
    return _UserLoss(factory_from_spec(kind))  # type: ignore[arg-type]


_INPUT_SEED = 1234  # the same generator seed as partitioner.models.specs: seed 0 gives the profiled data
MASK_RATE = 0.15  # masked-lm: the share of positions hidden and scored (as text_windows.MASK_RATE)


def _draw(spec: Mapping[str, Any], batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """One tensor like the recorded one: the same constant (masks), integers in ``[low, high)``, or
    normal."""
    shape = (batch_size, *spec["shape"][1:])
    dtype = getattr(torch, spec["dtype"])
    if spec.get("fill") is not None:
        return torch.full(shape, spec["fill"], dtype=dtype)
    if spec.get("high") is not None:
        low = int(spec.get("low", 0))
        return torch.randint(low, int(spec["high"]), shape, generator=generator).to(dtype)
    return torch.randn(shape, generator=generator, dtype=dtype)


def _next_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Each position's target is the next token; the last position is ignored (-100)."""
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]
    return targets


def _shifted_right(labels: torch.Tensor, start: int) -> torch.Tensor:
    """An encoder-decoder's decoder inputs: the labels one position later, ``start`` first (as
    transformers' ``shift_tokens_right``), so the decoder predicts each label from the ones before it."""
    shifted = torch.roll(labels, 1, dims=1)
    shifted[:, 0] = start
    return shifted


def synthetic_example(
    specs: Sequence[Mapping[str, Any]], target: Mapping[str, Any], batch_size: int, seed: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Inputs and targets of one synthetic minibatch, a task for the model's head (``target["kind"]``):

    - ``next_token``: the first input's next tokens (a causal model cannot see them);
    - ``masked``: a share of input ``target["input"]``'s tokens hidden behind ``target["mask_token"]``,
      scored against what they hid;
    - ``shifted``: labels drawn on their own, input ``target["decoder"]`` is them shifted right;
    - ``classes``/``normal``: drawn after the inputs, from the same generator: independent of them.

    One generator seeded from ``seed`` draws everything in that order, so a seed always gives the same
    minibatch (seed 0: the data the profile measured) and no target is a copy of an input.
    """
    generator = torch.Generator().manual_seed(_INPUT_SEED + seed)
    values = [_draw(spec, batch_size, generator) for spec in specs]
    kind = target.get("kind")
    if kind == "next_token":
        return values, _next_tokens(values[0])
    if kind == "masked":
        from runtime.datasets.text_windows import mask_tokens  # (the runtime masks text windows with it too)

        where = int(target.get("input", 0))
        rate = float(target.get("rate", MASK_RATE))
        values[where], targets = mask_tokens(values[where], int(target["mask_token"]), generator, rate)
        return values, targets
    if kind == "shifted":
        where = int(target["decoder"])
        labels = _draw({**target, "shape": specs[where]["shape"]}, batch_size, generator)
        values[where] = _shifted_right(labels, int(target.get("start", 0))).to(values[where].dtype)
        return values, labels
    return values, _draw(target, batch_size, generator)


def _user_call(function: str, batch_size: int, seed: int) -> Any:
    """The model file's ``example_inputs``/``example_targets`` under torch's CPU RNG seeded from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(_INPUT_SEED + seed)  # the CPU generator, cheaply
        return factory_from_spec(function)(batch_size)  # type: ignore[call-arg]


def _positional(made: Any, specs: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
    """A tensor, tuple or name-keyed dict of inputs as a list in the model's argument order."""
    if isinstance(made, Mapping):
        made = [made[spec["name"]] for spec in specs]
    values = [made] if isinstance(made, torch.Tensor) else list(made)
    if len(values) != len(specs) or not all(isinstance(v, torch.Tensor) for v in values):
        raise ValueError(f"example_inputs() must give the model's {len(specs)} input tensors")
    return values


def make_inputs(
    specs: Sequence[Mapping[str, Any]],
    batch_size: int,
    seed: int = 0,
    function: str | None = None,
    target: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Example inputs by the model's argument names; the same for a seed, other data for another seed.

    With ``function`` (``file.py:example_inputs``) the model file makes them, so masks stay masks and
    token ids stay in its vocabulary; otherwise they are drawn like the recorded names, shapes, dtypes,
    and shaped by the ``target`` task (masked tokens, decoder inputs: :func:`synthetic_example`).
    """
    if function:
        values = _positional(_user_call(function, batch_size, seed), specs)
    else:
        values = synthetic_example(specs, target or {}, batch_size, seed)[0]
    return {spec["name"]: value for spec, value in zip(specs, values, strict=True)}


def make_targets(
    spec: Mapping[str, Any],
    inputs: Sequence[Mapping[str, Any]],
    batch_size: int,
    seed: int = 0,
    functions: tuple[str | None, str | None] = (None, None),
) -> torch.Tensor:
    """Example targets for ``make_inputs(inputs, batch_size, seed, target=spec)``: the model file's
    ``example_targets``, or the task's targets (:func:`synthetic_example`).

    ``functions`` are the model file's (example_inputs, example_targets), where it defines them.
    """
    make_in, make_out = functions
    if make_out:
        return _user_call(make_out, batch_size, seed)  # type: ignore[no-any-return]
    if make_in and spec.get("kind") == "next_token":
        return _next_tokens(next(iter(make_inputs(inputs, batch_size, seed, make_in).values())))
    if make_in:
        return _draw(spec, batch_size, torch.Generator().manual_seed(_INPUT_SEED + seed))
    return synthetic_example(inputs, spec, batch_size, seed)[1]
