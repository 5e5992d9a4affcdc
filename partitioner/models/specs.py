"""Model specs -> a ``ModelBundle``: the module plus everything needed to train one step of it.

A spec is a built-in zoo name (``vgg16``), ``torchvision:NAME``, ``package.module:factory`` or
``path/to/file.py:factory``. A factory returns a module, or ``(module, example_inputs)``; a model file
may also define ``example_inputs(batch_size)``, ``example_targets(batch_size)`` and
``loss_fn(output, target)``. Profiling, code generation, ``verify`` and the runtime all train with
the same inputs, targets and loss, so they are built here, once.

Example:
    >>> bundle = load_model("tiny-mlp", batch_size=4)
    >>> bundle.loss_fn(bundle.module(*bundle.inputs), bundle.targets).shape
    torch.Size([])
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import logging
import re
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partitioner.errors import ModelSpecError
from partitioner.models.hf_inputs import hf_bundle_parts, next_token_targets
from partitioner.models.meta_init import SkipMetaInit
from partitioner.models.zoo import ZOO, ZooEntry
from runtime.building.meta_params import split_buffers, weightless
from runtime.files.user_code import UserFileError, import_file

__all__ = [
    "SPEC_FORMS",
    "ModelBundle",
    "default_loss",
    "load_model",
    "logits_of",
    "model_name",
    "next_token_targets",
]

log = logging.getLogger(__name__)

SPEC_FORMS = (
    "a built-in name, hf:FAMILY (hf:llama), hf:config.json or hf:checkpoint-folder (optionally :TASK), "
    "torchvision:NAME, package.module:factory or path/to/file.py:factory"
)
_INPUT_SEED = 1234


@dataclass(frozen=True)
class ModelBundle:
    """A model ready for one training step, and how to rebuild it identically.

    Attributes:
        spec: the spec it was loaded from.
        module: the model, built under ``torch.manual_seed(0)``, in training mode.
        inputs: example inputs at ``batch_size`` (positional arguments of ``module``).
        targets: example targets at ``batch_size``, matching ``loss_fn``.
        loss_fn: ``loss_fn(output, target)`` -> mean loss over samples.
        batch_size: the batch size of ``inputs`` and ``targets``.
        factory: builds a fresh module (call under a seeded RNG; see ``build``).
        input_maker: ``batch_size`` -> example inputs (deterministic).
        target_maker: ``batch_size`` -> example targets (deterministic, consistent with the inputs).
        input_names: when set, the inputs are keyword arguments of these names (Hugging Face models);
            otherwise they are positional.
        buffers: for a module built without its weights (``load_model(..., lazy=True)``: every
            tensor of ``module`` on the meta device), the real values of its buffers by qualified name.
        data: for built-in and ``hf:`` models, the (input specs, target spec) the inputs and targets
            are drawn from (:func:`runtime.building.stage_init.synthetic_example`); a package records them
            and draws its synthetic data the same way, so it trains on what the profile measured.
    """

    spec: str
    module: nn.Module
    inputs: tuple[Tensor, ...]
    targets: Tensor
    loss_fn: Callable[[Any, Tensor], Tensor]
    batch_size: int
    factory: Callable[[], Any] = field(repr=False)
    input_maker: Callable[[int], tuple[Tensor, ...]] = field(repr=False)
    target_maker: Callable[[int], Tensor] = field(repr=False)
    input_names: tuple[str, ...] = ()
    buffers: Mapping[str, Tensor] = field(default_factory=dict, repr=False)
    data: tuple[list[dict[str, Any]], dict[str, Any]] | None = None

    def call(self, module: nn.Module, inputs: tuple[Tensor, ...]) -> Any:
        """Run ``module`` on ``inputs`` as this model is called: by keyword or by position."""
        if self.input_names:
            return module(**dict(zip(self.input_names, inputs, strict=True)))
        return module(*inputs)

    def build(self, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
        """The same architecture with the weights ``seed`` gives; ``device="meta"`` allocates nothing."""
        return _build(self.factory, seed, device)

    def make_inputs(self, batch_size: int) -> tuple[Tensor, ...]:
        """Example inputs with ``batch_size`` samples."""
        return self.input_maker(batch_size)

    def make_targets(self, batch_size: int) -> Tensor:
        """Example targets for ``make_inputs(batch_size)``."""
        return self.target_maker(batch_size)


def logits_of(output: Any) -> Tensor:
    """The prediction tensor of an output: Hugging Face ``.logits``, a dict's ``logits``, a tuple's first."""
    if isinstance(output, Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits  # type: ignore[no-any-return]
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]  # type: ignore[no-any-return]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise ModelSpecError(
        f"cannot find the prediction in a model output of type {type(output).__name__}; "
        "define loss_fn(output, target) in the model file"
    )


def default_loss(output: Any, target: Tensor) -> Tensor:
    """Cross-entropy over the last dimension with class targets (-100 = ignored), averaged."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def model_name(spec: str) -> str:
    """A file-system-safe short name for a spec: ``vgg16``, ``resnet50`` (torchvision:),
    ``mymodel-make-1a2b3c`` (a file: its stem, the factory and 6 hex digits of the file's absolute
    path, so files of one name in two folders never share a profile or a package folder)."""
    if spec.startswith("hf:"):
        body = spec[3:]
        source, _, task = body.rpartition(":") if body.count(":") else (body, "", "")
        path = Path(source)
        # folder/config.json is named by its folder (save_pretrained's layout); llama3-70b.json by its
        # own name, so two configs in one folder do not share a profile
        stem = (
            path.parent.name
            if path.name == "config.json"
            else path.stem
            if path.suffix == ".json"
            else path.name
        )
        name = f"hf-{stem or 'model'}" + (f"-{task}" if task else "")
    elif ":" in spec:
        where, _, factory = spec.rpartition(":")
        stem = Path(where).stem if where.endswith(".py") else where.rsplit(".", 1)[-1]
        name = factory if where == "torchvision" else f"{stem}-{factory}"
        if where.endswith(".py"):  # the file itself, not only its name: two model.py files, two packages
            name += "-" + hashlib.sha256(str(Path(where).expanduser().resolve()).encode()).hexdigest()[:6]
    else:
        name = spec
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "model"


def load_model(
    spec: str,
    batch_size: int = 1,
    input_shape: tuple[int, ...] | None = None,
    lazy: bool = False,
    device: str = "cpu",
) -> ModelBundle:
    """Resolve a spec into a bundle of module, example inputs, targets and loss.

    Args:
        spec: a zoo name, ``torchvision:NAME``, ``pkg.mod:factory`` or ``file.py:factory``.
        batch_size: samples in the example inputs and targets.
        input_shape: shape of one sample of the (single) input, overriding the model's default.
        lazy: build the module without its weights (:func:`runtime.building.meta_params.weightless`): every tensor
            on the meta device, the buffers' real values in ``bundle.buffers``. Costs what the
            buffers cost, whatever the model's size.
        device: where the module is built; ``meta`` for callers that need its structure and shapes,
            not its values (no time spent drawing weights). User factories are always built on CPU.

    Raises:
        ModelSpecError: unknown name, missing file or factory, a factory that raised, bad shapes.
    """
    if batch_size <= 0:
        raise ModelSpecError(f"batch size must be positive, got {batch_size}")
    if input_shape is not None and (not input_shape or any(d <= 0 for d in input_shape)):
        raise ModelSpecError(f"input shape must be positive integers such as 3,224,224, got {input_shape}")
    if spec in ZOO:
        return _zoo_bundle(spec, ZOO[spec], batch_size, input_shape, lazy, device)
    if spec.startswith("hf:"):
        factory, names, data = hf_bundle_parts(spec, input_shape)
        return _data_bundle(spec, factory, batch_size, data, names, lazy, device)
    if spec.startswith("torchvision:"):
        entry = _torchvision_entry(spec.partition(":")[2])
        return _zoo_bundle(spec, entry, batch_size, input_shape, lazy, device)
    if ":" in spec:
        return _user_bundle(spec, batch_size, input_shape, lazy)
    close = difflib.get_close_matches(spec, ZOO, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ModelSpecError(f"unknown model {spec!r}{hint}; use {SPEC_FORMS}; built-ins: {', '.join(ZOO)}")


# ---------------------------------------------------------------- building


def _build(
    factory: Callable[[], Any], seed: int, device: str | torch.device, lazy: bool = False
) -> nn.Module:
    return _seeded_call(factory, seed, device, lazy)[0]


def _seeded_call(
    factory: Callable[[], Any], seed: int = 0, device: str | torch.device = "cpu", lazy: bool = False
) -> tuple[nn.Module, Any]:
    """Call a factory under ``seed`` without disturbing the caller's RNG; (module, example inputs or None).
    ``lazy``: the module's parameters on the meta device, its buffers real (``runtime.building.meta_params``)."""
    name = getattr(factory, "__qualname__", repr(factory))
    place = weightless() if lazy else torch.device(device)
    meta = lazy or torch.device(device).type == "meta"
    with torch.random.fork_rng(devices=[]), place, SkipMetaInit() if meta else nullcontext():
        torch.manual_seed(seed)
        try:
            made = factory()
        except Exception as exc:
            raise ModelSpecError(f"model factory {name}() raised {type(exc).__name__}: {exc}") from exc
    module, extra = (made[0], made[1] if len(made) > 1 else None) if isinstance(made, tuple) else (made, None)
    if not isinstance(module, nn.Module):
        raise ModelSpecError(
            f"model factory {name}() returned {type(module).__name__}, expected a torch.nn.Module "
            "or (module, example_inputs)"
        )
    _disable_kv_cache(module)
    return module, extra


def _disable_kv_cache(module: nn.Module) -> None:
    """Training never reads a KV cache; Hugging Face models would otherwise return one as an output."""
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
        log.info("set config.use_cache=False: training does not use the KV cache")


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(_INPUT_SEED)


# ---------------------------------------------------------------- zoo and torchvision


def _zoo_bundle(
    spec: str,
    entry: ZooEntry,
    batch_size: int,
    input_shape: tuple[int, ...] | None,
    lazy: bool = False,
    device: str = "cpu",
) -> ModelBundle:
    shape = tuple(input_shape) if input_shape else entry.input_shape
    if entry.tokens and len(shape) != 1:
        raise ModelSpecError(f"{spec} takes token ids: --input-shape is the sequence length, got {shape}")
    if entry.tokens:
        inputs = [{"name": "tokens", "shape": [1, *shape], "dtype": "int64", "high": entry.classes}]
        target = {"name": "target", "shape": [1, *shape], "dtype": "int64", "kind": "next_token",
                  "high": entry.classes}  # fmt: skip
    else:
        inputs = [{"name": "x", "shape": [1, *shape], "dtype": "float32"}]
        target = {"name": "target", "shape": [1], "dtype": "int64", "kind": "classes", "high": entry.classes}
    return _data_bundle(spec, entry.factory, batch_size, (inputs, target), lazy=lazy, device=device)


def _data_bundle(
    spec: str,
    factory: Callable[[], Any],
    batch_size: int,
    data: tuple[list[dict[str, Any]], dict[str, Any]],
    names: tuple[str, ...] = (),
    lazy: bool = False,
    device: str = "cpu",
) -> ModelBundle:
    """A bundle whose inputs and targets are drawn from specs, as a generated package draws them
    (``lazy``: the module without its weights, as :func:`load_model`)."""
    from runtime.building.stage_init import synthetic_example

    inputs, target = data

    def make_inputs(b: int) -> tuple[Tensor, ...]:
        return tuple(synthetic_example(inputs, target, b)[0])

    def make_targets(b: int) -> Tensor:
        return synthetic_example(inputs, target, b)[1]

    bundle = _bundle(
        spec, factory, batch_size, make_inputs, make_targets, default_loss, input_names=names, lazy=lazy,
        device=device,
    )  # fmt: skip
    return replace(bundle, data=data)


def _torchvision_entry(name: str) -> ZooEntry:
    try:
        import torchvision.models
    except Exception as exc:
        raise ModelSpecError(
            f"torchvision:{name} needs torchvision, which cannot be imported here ({exc}); "
            "install it (pip install pipeplan[vision]) or use the built-in zoo"
        ) from exc
    try:
        factory = torchvision.models.get_model_builder(name)
    except ValueError as exc:
        raise ModelSpecError(
            f"torchvision has no model {name!r}; see torchvision.models.list_models()"
        ) from exc
    shape = (3, 299, 299) if name.startswith("inception") else (3, 224, 224)
    return ZooEntry(factory, shape, False, 1000, f"torchvision {name}")


def _bundle(
    spec: str,
    factory: Callable[[], Any],
    batch_size: int,
    make_inputs: Callable[[int], tuple[Tensor, ...]],
    make_targets: Callable[[int], Tensor],
    loss_fn: Callable[[Any, Tensor], Tensor],
    module: nn.Module | None = None,
    input_names: tuple[str, ...] = (),
    lazy: bool = False,
    buffers: Mapping[str, Tensor] | None = None,
    device: str = "cpu",
) -> ModelBundle:
    if module is None:
        module = _build(factory, 0, device, lazy)
        buffers = split_buffers(module) if lazy else None
    return ModelBundle(
        input_names=input_names,
        buffers=dict(buffers or {}),
        spec=spec,
        module=module.train(),
        inputs=make_inputs(batch_size),
        targets=make_targets(batch_size),
        loss_fn=loss_fn,
        batch_size=batch_size,
        factory=factory,
        input_maker=make_inputs,
        target_maker=make_targets,
    )


# ---------------------------------------------------------------- user factories


def _user_bundle(
    spec: str, batch_size: int, input_shape: tuple[int, ...] | None, lazy: bool = False
) -> ModelBundle:
    where, _, attr = spec.rpartition(":")
    source = _import_source(where, spec)
    factory = getattr(source, attr, None)
    if not callable(factory):
        raise ModelSpecError(f"{where} has no callable {attr!r} (spec {spec!r}; expected {SPEC_FORMS})")
    module, extra = _seeded_call(factory, lazy=lazy)
    buffers = split_buffers(module) if lazy else None
    names = _input_names(extra, getattr(source, "example_inputs", None))
    returned = _as_inputs(extra, spec) if extra is not None else None
    make_inputs = _user_inputs(spec, source, returned, input_shape)
    loss_fn: Callable[[Any, Tensor], Tensor] = getattr(source, "loss_fn", default_loss)
    user_targets = getattr(source, "example_targets", None)
    if callable(user_targets):
        make_targets: Callable[[int], Tensor] = user_targets
    else:
        make_targets = _derived_targets(module, make_inputs, names)
    return _bundle(
        spec, factory, batch_size, make_inputs, make_targets, loss_fn, module, names, lazy, buffers
    )


def _input_names(returned: Any, example_inputs: Any) -> tuple[str, ...]:
    """Keyword names when the model file gives its inputs as a dict (``model(**inputs)``), else ()."""
    sample = example_inputs(2) if callable(example_inputs) else returned
    return tuple(str(k) for k in sample) if isinstance(sample, Mapping) else ()


def _import_source(where: str, spec: str) -> ModuleType:
    if where.endswith(".py") or "/" in where:
        try:
            return import_file(where, "model file")
        except UserFileError as exc:
            raise ModelSpecError(f"{exc} (spec {spec!r})") from exc
    try:
        return importlib.import_module(where)
    except Exception as exc:
        raise ModelSpecError(f"cannot import {where} (spec {spec!r}): {type(exc).__name__}: {exc}") from exc


def _as_inputs(value: Any, spec: str) -> tuple[Tensor, ...]:
    """A tensor, a tuple of tensors or a dict of keyword tensors, as a tuple (dict order)."""
    if isinstance(value, Mapping):
        value = tuple(value.values())
    inputs = (
        (value,) if isinstance(value, Tensor) else tuple(value) if isinstance(value, (tuple, list)) else None
    )
    if not inputs or not all(isinstance(t, Tensor) for t in inputs):
        raise ModelSpecError(
            f"{spec}: example inputs must be a tensor, a tuple of tensors or a dict of keyword tensors "
            f"(model(**inputs)), got {type(value).__name__}"
        )
    return inputs


def _user_inputs(
    spec: str, source: ModuleType, returned: tuple[Tensor, ...] | None, input_shape: tuple[int, ...] | None
) -> Callable[[int], tuple[Tensor, ...]]:
    user_fn = getattr(source, "example_inputs", None)
    if callable(user_fn):
        base: Callable[[int], tuple[Tensor, ...]] = lambda b: _as_inputs(user_fn(b), spec)  # noqa: E731
    elif returned is not None:
        base = lambda b: tuple(_resize_batch(t, b) for t in returned)  # noqa: E731
    elif input_shape is not None:
        return lambda b: (torch.randn((b, *input_shape), generator=_generator()),)
    else:
        raise ModelSpecError(
            f"{spec} gives no example inputs: pass --input-shape, return (module, inputs) from the factory, "
            "or define example_inputs(batch_size) in the model file"
        )
    if input_shape is None:
        return base
    return lambda b: _reshaped(base(b), b, input_shape, spec)


def _resize_batch(t: Tensor, b: int) -> Tensor:
    """Repeat (or cut) example samples to ``b`` along the batch dimension."""
    return t if t.shape[0] == b else t[torch.arange(b) % t.shape[0]]


def _reshaped(inputs: tuple[Tensor, ...], b: int, shape: tuple[int, ...], spec: str) -> tuple[Tensor, ...]:
    if len(inputs) != 1:
        raise ModelSpecError(
            f"{spec} takes {len(inputs)} inputs: --input-shape only applies to single-input models; "
            "define example_inputs(batch_size) instead"
        )
    t = inputs[0]
    if t.is_floating_point():
        return (torch.randn((b, *shape), generator=_generator(), dtype=t.dtype),)
    high = int(t.max()) + 1 if t.numel() else 2
    return (torch.randint(0, high, (b, *shape), generator=_generator(), dtype=t.dtype),)


def _derived_targets(
    module: nn.Module, make_inputs: Callable[[int], tuple[Tensor, ...]], names: tuple[str, ...] = ()
) -> Callable[[int], Tensor]:
    """Class targets shaped like the output (next tokens when the model maps token ids to logits)."""

    def make_targets(b: int) -> Tensor:
        inputs = make_inputs(b)
        where = next((t.device for t in module.parameters()), torch.device("cpu"))
        run = tuple(t.to("meta") for t in inputs) if where.type == "meta" else inputs  # built lazily
        with torch.no_grad():
            try:
                output = module(**dict(zip(names, run, strict=True))) if names else module(*run)
                logits = logits_of(output)
            except Exception as exc:
                given = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in inputs)
                raise ModelSpecError(
                    f"the model's forward raised on example inputs {given}: {type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}; fix the model or "
                    "its inputs (--input-shape, or example_inputs in the model file)"
                ) from exc
        first = inputs[0]
        if (
            not first.is_floating_point()
            and first.dim() == 2
            and tuple(logits.shape[:-1]) == tuple(first.shape)
        ):
            return next_token_targets(first)
        return torch.randint(0, logits.shape[-1], tuple(logits.shape[:-1]), generator=_generator())

    return make_targets
