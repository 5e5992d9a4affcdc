"""Peak memory one rank measured while training, for metrics.json next to the plan's prediction.

CUDA: ``torch.cuda.max_memory_allocated`` over the window (the caching allocator's own count of bytes
in live tensors; untested here, written as torch documents it).

CPU: torch has no allocator statistics for the CPU, and the process's resident size mixes tensors
with the interpreter, libraries, communication buffers and heap the C library keeps after a free, so
its growth says little about tensors. Instead the window runs under ``torch.profiler`` with
``profile_memory=True``, which reports every CPU tensor allocation and free with its size. The peak
is the stage's tensors alive when the window opens (parameters, buffers, gradients and optimizer
state, counted once per storage) plus the highest running sum of the bytes allocated minus freed in
the window: weights and gradients, optimizer state, stashed weight versions, activations autograd
keeps, received and sent tensors, recomputed activations and temporaries of every operator. It does
not count memory that is not a tensor (Python objects, gloo's buffers, allocator slack), nor other
tensors made before the window (torch logs a warning in the rank's log when one is freed in it). The
same allocations give the same number: byte for byte from one run to the next.

The window is the first ``ranks + 1`` minibatches (or all of a shorter run): a synchronous schedule
flushes after every minibatch (the second already holds the optimizer state the first step made) and
pipedream's pipeline is full once every rank has had a minibatch, so a longer run peaks in it too;
measuring every step would grow the profiler's event buffer without bound. The profiler costs those
steps some CPU time (about 5-10% on resnet18 here); later steps run without it.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

__all__ = ["PeakMemory", "live_tensor_bytes", "memory_report", "stage_bytes"]


def live_tensor_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the stage's parameters, buffers, gradients and optimizer state, each storage once."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [
        t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    ]
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def stage_bytes(module: nn.Module) -> int:
    """Bytes of a stage's parameters and buffers, each storage once."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass
class PeakMemory:
    """Measures one rank's peak over its first ``window`` minibatches: :meth:`start`, then
    :meth:`stepped` after every optimizer step; :attr:`peak_bytes` is set once the window closes.

    Attributes:
        device: the rank's device.
        window: minibatches measured.
        cpu: measure on a CPU (torch.profiler; ``pipeplan run --measure-memory``). On torch 2.13 a
            rank that ran the profiler dies of a segmentation fault or an abort after it stops, in a
            later backward or while collecting garbage (a 2-rank vgg16 package: 3 runs of 3; keeping
            the profiler object alive does not help), so it is opt-in there.
        peak_bytes: the peak, None until measured.
        method: how it was measured (recorded in metrics.json).
    """

    device: torch.device
    window: int
    cpu: bool = True
    peak_bytes: int | None = None
    method: str = ""
    _seen: int = 0
    _base: int = 0
    _profiler: profile | None = field(default=None, repr=False)

    def start(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Open the window now, the stage's own tensors already in place."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "torch.cuda.max_memory_allocated"
            return
        if not self.cpu:
            return
        self._base = live_tensor_bytes(module, optimizer)
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.start()
        self.method = "torch.profiler CPU tensor allocations + stage tensors at start"

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
        assert self._profiler is not None
        self._profiler.stop()
        self.peak_bytes = self._base + _highest_sum(self._profiler)
        self._profiler = None
        # The profiler leaves Python objects that crash the garbage collector when it next scans them
        # (torch 2.13: a rank died of SIGSEGV in a checkpoint write's first collection after the
        # window, 2 runs of 3); frozen, the collector never scans what exists now (4 runs of 4 lived).
        gc.freeze()


def _highest_sum(prof: profile) -> int:
    """The highest running sum of the window's allocations (+) and frees (-), in time order."""
    results: Any = prof.profiler.kineto_results if prof.profiler is not None else None
    events = results.events() if results is not None else []
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in changes:
        level += nbytes
        peak = max(peak, level)
    return peak


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
