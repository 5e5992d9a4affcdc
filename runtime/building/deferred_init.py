"""Build a model exactly as ``torch.manual_seed(seed); factory()`` does without holding its tensors.

A pipeline rank needs its own stage's initial weights, bit for bit what the whole model would start
with, but must not build the whole model to get them. The values depend on the order in which the
factory draws from the random generator, so a stage cannot simply re-run its own modules' inits.

:func:`build_deferred` runs the factory once under a dispatch mode that gives every tensor of at
least :data:`LARGE` elements no storage (a tensor on the meta device that reports the CPU) and
records, per storage, the operations that made and changed it. Random operations are still run, on a
scratch tensor that is freed at once, so the generator advances exactly as in a real build, and the
generator's state before each is kept. :meth:`Deferred.materialise` replays one tensor's record with
those states restored: the same kernels on the same generator states give the same values. When the
factory reads a value (``tensor.item()``, ``if mask.any()``: the rejection loop of ``trunc_normal_``),
the tensors it reads are replayed on the spot. This is torchdistx's deferred initialisation, kept to
what model constructors do.

Memory: the small tensors (biases, norms, their sum is tiny), the record (operation arguments, no
large data), and during the build one scratch tensor at a time (the largest random draw). Time: the
factory's own random draws once, then each materialised tensor's init again.

Example:
    >>> built = build_deferred(lambda: torch.nn.Linear(512, 512), seed=0)
    >>> weight = built.materialise(built.module.weight)  # as torch.manual_seed(0); nn.Linear(512, 512)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["LARGE", "Deferred", "as_meta", "build_deferred", "is_deferred"]

LARGE = 4096
"""Elements from which a tensor made while building is deferred (smaller ones are built real)."""

_META = torch.device("meta")
_CPU = torch.device("cpu")
# operations that read only their input's shape and dtype, never its values
_SHAPE_ONLY = frozenset(
    ("new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like",
     "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
)  # fmt: skip


class _Lazy(Tensor):
    """A deferred tensor: meta storage (its identity in the record), reporting the CPU device.

    Reporting the CPU matters: ``nn.init`` functions return early for meta tensors without drawing,
    which would put the generator out of step with a real build.
    """

    @staticmethod
    def __new__(cls, meta: Tensor) -> _Lazy:
        return Tensor._make_subclass(
            cls, meta, meta.requires_grad, dispatch_device=True, device_for_backend_keys=_CPU
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.prim.device.default:
            return _CPU
        raise RuntimeError(
            f"{func} on a tensor that was deferred while building the model; materialise it first"
        )

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"deferred tensor {tuple(self.shape)} {self.dtype}"


def is_deferred(t: object) -> bool:
    """Whether ``t`` is a tensor left without storage by :func:`build_deferred`."""
    return isinstance(t, _Lazy)


def _key(t: Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def as_meta(t: Tensor) -> Tensor:
    """A plain meta tensor viewing the same (meta) storage as a deferred one: its views (``.T``) and
    shapes can be taken, which the deferred tensor refuses."""
    return torch.empty(0, dtype=t.dtype, device=_META).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


@dataclass(frozen=True)
class _Ref:
    """A deferred tensor as an operation read it: its storage at a point of its record, and the view.

    ``version`` is how many recorded operations had changed the storage then; ``shape_only`` marks
    arguments whose values the operation never reads (``empty_like``), which replay as empty tensors.
    """

    key: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    shape_only: bool = False


@dataclass(frozen=True)
class _Op:
    """One recorded operation; ``output`` says which of its results creates the storage (else None)."""

    func: Any
    args: Any
    kwargs: Any
    state: Tensor | None = None
    generator: torch.Generator | None = None
    output: int | None = None


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Defers large tensors and records what happens to them (see the module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled while a model is built; the wrapper would import torch._dynamo

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.logs: dict[int, list[_Op]] = {}
        self.alive: list[Tensor] = []  # keeps each recorded storage (and so its key) alive
        self.buffer = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:
            return _CPU
        flat, _ = tree_flatten((args, kwargs))
        if not any(isinstance(t, _Lazy) for t in flat):
            return self._real(func, args, kwargs, flat)
        if not any("Tensor" in str(r.type) for r in func._schema.returns):
            return self._force(func, args, kwargs)  # a value read: replay what it reads
        name = func._schema.name.split("::")[-1]
        if name in _SHAPE_ONLY:
            made = func(*tree_map(_meta_of, args), **tree_map(_meta_of, kwargs))
            if made.numel() < LARGE:
                return func(*tree_map(_empty_like, args), **tree_map(_empty_like, kwargs))
        written = [v for v, a in _arguments(func, args, kwargs) if _writes(a) and isinstance(v, Tensor)]
        if any(not isinstance(v, _Lazy) for v in written):
            return self._force(func, args, kwargs)  # a real tensor changed from deferred ones
        state, generator = self._advance(func, args, kwargs)
        returns = func._schema.returns
        if written and len(returns) == 1 and returns[0].alias_info and returns[0].alias_info.is_write:
            out = written[0]  # in place: the result is the tensor written (no meta kernel to run)
        else:
            out = func(*tree_map(_meta_of, args), **tree_map(_meta_of, kwargs))
        shape_only = name in _SHAPE_ONLY
        op = _Op(func, self._refs(args, shape_only), self._refs(kwargs, shape_only), state, generator)
        for value in written:
            self.logs[_key(value)].append(op)
        return self._wrap(out, op, {_key(t) for t in flat if isinstance(t, _Lazy)})

    def _real(self, func: Any, args: Any, kwargs: Any, flat: Sequence[Any]) -> Any:
        """An operation on real tensors only: run it, but defer a large tensor made from nothing."""
        factory = not any(isinstance(t, Tensor) for t in flat) and "device" in {
            a.name for a in func._schema.arguments
        }
        if not factory or kwargs.get("device") not in (None, _CPU):
            return func(*args, **kwargs)
        made = func(*args, **{**kwargs, "device": _META})
        if not isinstance(made, Tensor) or made.numel() < LARGE:
            return func(*args, **kwargs)
        state, generator = self._advance(func, args, kwargs)
        return self._track(made, _Op(func, args, kwargs, state, generator, 0))

    def _wrap(self, out: Any, op: _Op, inputs: set[int]) -> Any:
        """Results as deferred tensors: views share their input's record, new storages start one."""
        flat, spec = tree_flatten(out)
        wrapped: list[Any] = []
        for i, value in enumerate(flat):
            if not isinstance(value, Tensor) or isinstance(value, _Lazy):
                wrapped.append(value)
            elif _key(value) in inputs or _key(value) in self.logs:
                self.alive.append(value)
                wrapped.append(_Lazy(value))
            else:
                made = _Op(op.func, op.args, op.kwargs, op.state, op.generator, i)
                wrapped.append(self._track(value, made))
        return tree_unflatten(wrapped, spec)

    def _track(self, meta: Tensor, op: _Op) -> _Lazy:
        self.logs[_key(meta)] = [op]
        self.alive.append(meta)
        return _Lazy(meta)

    def _refs(self, tree: Any, shape_only: bool) -> Any:
        def ref(v: Any) -> Any:
            if not isinstance(v, _Lazy):
                return v
            key = _key(v)
            return _Ref(
                key, len(self.logs[key]), tuple(v.shape), tuple(v.stride()), int(v.storage_offset()),
                v.dtype, shape_only,
            )  # fmt: skip

        return tree_map(ref, tree)

    def _advance(self, func: Any, args: Any, kwargs: Any) -> tuple[Tensor | None, torch.Generator | None]:
        """For a random operation: the generator's state before it, after running it on scratch
        tensors of the same shapes, so the generator moves on exactly as in a real build."""
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return None, None
        generator = kwargs.get("generator")
        state = (generator or torch.default_generator).get_state()
        func(*tree_map(self._scratch, args), **tree_map(self._scratch, kwargs))
        return state, generator

    def _scratch(self, v: Any) -> Any:
        """A deferred tensor's stand-in for a random draw: a view of one buffer kept for every draw
        (grown to the largest), so freed scratch memory does not pile up in the allocator."""
        if not isinstance(v, _Lazy):
            return v
        span = 1 + sum((n - 1) * s for n, s in zip(v.shape, v.stride(), strict=True)) if v.numel() else 0
        need = span * v.element_size()
        if self.buffer.nbytes() < need:
            self.buffer = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]  # the old one freed first
            self.buffer = torch.UntypedStorage(need)  # type: ignore[no-untyped-call]
        return torch.empty(0, dtype=v.dtype).set_(self.buffer, 0, v.shape, v.stride())

    def _force(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run ``func`` on real values: the deferred tensors it reads are replayed now."""
        replay = _Replay(self.logs)
        real = tree_map(lambda v: replay.tensor(v) if isinstance(v, _Lazy) else v, (args, kwargs))
        return func(*real[0], **real[1])


def _arguments(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    for i, argument in enumerate(func._schema.arguments):
        yield (args[i] if i < len(args) else kwargs.get(argument.name)), argument


def _writes(argument: Any) -> bool:
    return argument.alias_info is not None and bool(argument.alias_info.is_write)


def _meta_of(v: Any) -> Any:
    if isinstance(v, _Lazy):
        return as_meta(v)
    if isinstance(v, Tensor):
        return v.to(_META)
    return v


def _empty_like(v: Any) -> Any:
    if isinstance(v, _Lazy):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
    return v


class _Replay:
    """Replays recorded storages; each is replayed once and continued in place where a later point
    of its record is asked for (an earlier point is replayed afresh)."""

    def __init__(self, logs: dict[int, list[_Op]]) -> None:
        self.logs = logs
        self.done: dict[int, tuple[int, Tensor]] = {}

    def storage(self, key: int, version: int | None = None) -> Tensor:
        log = self.logs[key]
        version = len(log) if version is None else version
        done, base = self.done.get(key, (0, None))
        if done > version:
            done, base = 0, None
        for op in log[done:version]:
            base = self._run(op, key, base)
        assert base is not None, "a recorded storage starts with the operation that made it"
        if version >= self.done.get(key, (0, None))[0]:
            self.done[key] = (version, base)
        return base

    def _run(self, op: _Op, key: int, base: Tensor | None) -> Tensor | None:
        def real(v: Any) -> Any:
            if not isinstance(v, _Ref):
                return v
            if v.shape_only:
                return torch.empty_strided(v.size, v.stride, dtype=v.dtype)
            source = base if v.key == key else self.storage(v.key, v.version)
            assert source is not None
            return source.as_strided(v.size, v.stride, v.offset)

        args, kwargs = tree_map(real, (op.args, op.kwargs), is_leaf=lambda v: isinstance(v, _Ref))
        generator = op.generator or torch.default_generator
        saved = generator.get_state() if op.state is not None else None
        if op.state is not None:
            generator.set_state(op.state)
        try:
            with torch.no_grad():
                out = op.func(*args, **kwargs)
        finally:
            if saved is not None:
                generator.set_state(saved)
        return tree_flatten(out)[0][op.output] if op.output is not None else base

    def tensor(self, t: Tensor) -> Tensor:
        return self.storage(_key(t)).as_strided(t.shape, t.stride(), t.storage_offset())


@dataclass(frozen=True)
class Deferred:
    """A model built with its large tensors deferred, and the record that materialises them.

    Attributes:
        module: the model; its large parameters and buffers are deferred (:func:`is_deferred`), the
            others hold their real values.
    """

    module: nn.Module
    _recorder: _Recorder

    def materialise(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The real values of ``tensors`` (real ones are returned as they are), on the CPU.

        Tensors materialised in one call share their replay: tied tensors come back as views of one.
        """
        replay = _Replay(self._recorder.logs)
        return [replay.tensor(t) if isinstance(t, _Lazy) else t for t in tensors]


def build_deferred(factory: Callable[[], Any], seed: int = 0) -> Deferred:
    """Call ``factory`` under ``torch.manual_seed(seed)`` (the caller's RNG untouched), deferring every
    tensor of at least :data:`LARGE` elements; ``factory`` may return (module, anything)."""
    recorder = _Recorder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with recorder:
            made = factory()
    recorder.buffer = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]  # the scratch is done
    module = made[0] if isinstance(made, tuple) else made
    return Deferred(module, recorder)
