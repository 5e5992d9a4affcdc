"""Peak memory one rank measured while training, for metrics.json next to the plan's prediction.

CUDA: ``torch.cuda.max_memory_allocated`` over the window (the caching allocator's own count of bytes
in live tensors; untested here, written as torch documents it).

CPU: torch has no allocator statistics for the CPU, and the process's resident size mixes tensors
with the interpreter, libraries, communication buffers and heap the C library keeps after a free, so
its growth says little about tensors. Instead the window runs under a ``TorchDispatchMode`` that sees
every operator's outputs (factory functions included) and keeps a weak reference to each new storage:
the running sum of live storages rises when an operator makes one and falls when the last tensor on
it dies. The stage's own tensors alive when the window opens (parameters, buffers, gradients and
optimizer state, counted once per storage) start the sum and leave it when freed. The peak is the
highest sum seen after any operator: weights and gradients, optimizer state, stashed weight
versions, activations autograd keeps, received and sent tensors, recomputed activations. It does not
count an operator's internal scratch buffers, memory that is not a tensor (Python objects, gloo's
buffers, allocator slack), nor other tensors made before the window. The same operators give the
same number: byte for byte from one run to the next. (torch.profiler's memory events measured this
before; on torch 2.13 a rank that ran it died of heap corruption after it stopped, about one run in
two of a 2-rank package, so it is not used.)

The window is the first ``ranks + 1`` minibatches (or all of a shorter run): a synchronous schedule
flushes after every minibatch (the second already holds the optimizer state the first step made) and
pipedream's pipeline is full once every rank has had a minibatch, so a longer run peaks in it too,
except for the gradient sends a pipedream stage with replicas keeps for ``2 (ranks + 1)`` steps
(``runtime.executing.comm``).
Every operator in the window pays a Python call; later steps run without it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakMemory", "live_tensor_bytes", "local", "memory_report", "stage_bytes"]


def _stage_tensors(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The stage's parameters, buffers, gradients and optimizer state."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [
        t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    ]
    return [local(t) for t in tensors]  # (a DTensor's bytes on this rank are its shard's)


def live_tensor_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the stage's parameters, buffers, gradients and optimizer state, each storage once."""
    seen: dict[int, int] = {}
    for t in _stage_tensors(module, optimizer):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def stage_bytes(module: nn.Module) -> int:
    """Bytes of a stage's parameters and buffers, each storage once."""
    seen: dict[int, int] = {}
    for t in [local(t) for t in [*module.parameters(), *module.buffers()]]:
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class _LiveStorages(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """The running sum of the bytes of live tensor storages this mode has seen, and its highest value.

    A storage joins when an operator outputs it (or through :meth:`add`) and leaves when torch frees it
    (a weak reference's callback); views and in-place results share a storage already counted.
    """

    def __init__(self, devices: tuple[str, ...] = ("cpu",)) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.devices = devices
        """device types counted: a rank's CPU; the profiler's estimate counts the meta device too."""
        self.level = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def add(self, tensors: Iterable[object]) -> None:
        """Count the storages of ``tensors`` not counted yet; raise the peak if the sum is higher."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type in self.devices:
                self._add(local(t).untyped_storage())
        self.peak = max(self.peak, self.level)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self._refs or nbytes == 0:
            return
        self.level += nbytes
        self._refs[key] = weakref.ref(storage, self._freed(key, nbytes))

    def _freed(self, key: int, nbytes: int) -> Callable[[object], None]:
        def freed(_: object) -> None:
            if self._refs.pop(key, None) is not None:
                self.level -= nbytes

        return freed

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.add(tree_leaves(out))
        return out


@dataclass
class PeakMemory:
    """Measures one rank's peak over its first ``window`` minibatches: :meth:`start`, then
    :meth:`stepped` after every optimizer step; :attr:`peak_bytes` is set once the window closes.

    Attributes:
        device: the rank's device.
        window: minibatches measured.
        cpu: measure on a CPU (``pipeplan run --measure-memory``): opt-in, as every operator in the
            window pays a Python call.
        peak_bytes: the peak, None until measured.
        method: how it was measured (recorded in metrics.json).
    """

    device: torch.device
    window: int
    cpu: bool = True
    peak_bytes: int | None = None
    method: str = ""
    _seen: int = 0
    _counter: _LiveStorages | None = field(default=None, repr=False)

    def start(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Open the window now, the stage's own tensors already in place."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "torch.cuda.max_memory_allocated"
            return
        if not self.cpu:
            return
        self._counter = _LiveStorages()
        self._counter.add(_stage_tensors(module, optimizer))
        self._counter.__enter__()  # type: ignore[no-untyped-call]
        self.method = "live CPU tensor storages: stage tensors at start + every operator's outputs"

    @property
    def measured_minibatches(self) -> int:
        """Minibatches the window covered (fewer than ``window`` in a shorter run)."""
        return min(self._seen, self.window)

    def stepped(self, minibatches: int) -> None:
        """An optimizer step covering ``minibatches`` ended; close the window once it is full."""
        self._seen += minibatches
        if self._seen >= self.window:
            self.stop()

    def stop(self) -> None:
        """Close the window (again: nothing) and compute the peak."""
        if self.peak_bytes is not None or not self.method:
            return
        if self.device.type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        assert self._counter is not None
        self._counter.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        self.peak_bytes = self._counter.peak
        self._counter = None


def memory_report(
    peaks: Sequence[tuple[int, int | None]], predicted: Sequence[int], method: str, window: int
) -> dict[str, Any]:
    """metrics.json's ``memory``: per stage, the plan's predicted peak per device and the highest peak
    its replicas measured (``peaks``: (stage, peak bytes) of every rank)."""
    stages = []
    for stage in sorted({k for k, _ in peaks}):
        measured = [p for k, p in peaks if k == stage and p is not None]
        peak = max(measured) if measured else None
        want = predicted[stage] if stage < len(predicted) and predicted[stage] > 0 else None
        stages.append({
            "stage": stage,
            "predicted_bytes": want,
            "measured_peak_bytes": peak,
            "ratio_measured_over_predicted": peak / want if peak is not None and want else None,
        })  # fmt: skip
    return {"method": method, "window_minibatches": window, "stages": stages}


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
