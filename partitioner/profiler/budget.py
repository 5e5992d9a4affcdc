"""Whether a model is profiled whole or layer by layer: its weights against the memory free here.

Profiling the model whole measures each layer on the values of one real forward and times the
whole training step (the check that the layer times add up), but holds every weight, every
activation of the forward and the whole model's gradients at once. Layer by layer
(:mod:`partitioner.profiler.layerwise`) holds one layer. ``auto`` profiles whole while the weights
take at most :data:`WHOLE_SHARE` of the memory free to this process, leaving the rest to
gradients, activations and the measurements, and the model does not repeat a block
:data:`REPEATS_FOR_LAYER` times or more.

Both modes measure identical layers once; what grows with the depth in whole mode is the rest:
tracing with a dynamic batch and timing the whole step (bench_profile_phases.py: 8.2 -> 22.7 CPU s
from 2 to 32 Llama blocks, against 4.6 -> 7.8 layer by layer). A model of many identical blocks is
therefore profiled layer by layer under ``auto``, unless each layer's fixed time per call is to be
measured (a batch of 2 or more with ``fixed_cost``): that needs the dynamic graph only whole mode
traces, and without it ``partition`` cannot price one microbatch count against another.
"""

from __future__ import annotations

import os
import resource

import torch
from torch import nn

from partitioner.errors import PipeplanError
from partitioner.graph import Profile

__all__ = [
    "MATERIALIZE",
    "REPEATS_FOR_LAYER",
    "WHOLE_SHARE",
    "choose_materialize",
    "free_bytes",
    "repeated_blocks",
    "too_big_to_build",
    "unbuildable",
]

MATERIALIZE = ("auto", "whole", "layer")
"""The values of ``pipeplan profile --materialize``."""

WHOLE_SHARE = 1 / 8
"""The largest share of the free memory a model's weights may take to be profiled whole."""


REPEATS_FOR_LAYER = 8
"""Blocks repeated this many times make ``auto`` profile layer by layer (when no fixed time per call
is measured). Whole mode grows by about 0.48 CPU s a block, layer by layer by 0.11
(bench_profile_phases.py, Llama of hidden 512): from 8 blocks on, whole mode costs a small model's
profile 3 s or more on top of its 5 to 8."""


def choose_materialize(mode: str, module: nn.Module, device: torch.device, fixed_cost: bool = False) -> str:
    """``whole`` or ``layer`` for ``mode``. ``auto`` decides from the weights of ``module`` (which may
    be on the meta device) against :func:`free_bytes` of ``device``, and from its
    :func:`repeated_blocks` where ``fixed_cost`` (each layer's fixed time per call to be measured,
    which needs whole mode) is False."""
    if mode not in MATERIALIZE:
        raise PipeplanError(f"unknown --materialize {mode!r}: use {', '.join(MATERIALIZE)}")
    if mode != "auto":
        return mode
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    if weights > WHOLE_SHARE * free_bytes(device):
        return "layer"
    return "layer" if not fixed_cost and repeated_blocks(module) >= REPEATS_FOR_LAYER else "whole"


def repeated_blocks(module: nn.Module) -> int:
    """The most children of one module (a ``ModuleList``, a ``Sequential``) that are alike: the same
    class with parameters and buffers of the same names, shapes and dtypes. 32 for a Llama of 32
    decoder layers; 0 for a model without weighted children."""
    most = 0
    for parent in module.modules():
        kinds: dict[object, int] = {}
        for child in parent.children():
            tensors = [*child.named_parameters(), *child.named_buffers()]
            if tensors:
                key = (type(child), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors))
                kinds[key] = kinds.get(key, 0) + 1
        most = max([most, *kinds.values()])
    return most


def unbuildable(profile: Profile) -> str | None:
    """Why ``partition`` cannot write the stage code of ``profile``'s model here, or None.

    Writing a package re-traces the model (the generated stages are cut from that graph). Built-in,
    torchvision and ``hf:`` models traced by fx are built on the meta device, and every model traced
    by torch.export is traced on fake tensors without its weights (:mod:`partitioner.generation.codegen`):
    none of them is built whole. A model file's factory traced by fx runs on this machine's CPU, in
    float32: if those weights exceed half of the memory free here it would not build; its plan is
    still made and written.
    """
    spec = str(dict(profile.tracer_options).get("spec", profile.model))
    if profile.tracer != "fx" or spec.startswith(("hf:", "torchvision:")) or ":" not in spec:
        return None
    return too_big_to_build(profile)


def too_big_to_build(profile: Profile) -> str | None:
    """Why ``profile``'s model cannot be built whole in float32 on this machine's CPU (its weights
    exceed half of the memory free here), or None."""
    itemsize = {"float16": 2, "bfloat16": 2, "float64": 8}.get(profile.dtype, 4)
    need = profile.total_param_bytes * 4 / itemsize
    free = free_bytes(torch.device("cpu"))
    if need <= free / 2:
        return None
    return (
        f"writing the stage code builds {profile.model} whole in float32 "
        f"({need / 2**30:.1f} GiB of weights), "
        f"more than half of the {free / 2**30:.1f} GiB free here"
    )


def free_bytes(device: torch.device) -> float:
    """Bytes this process can still allocate on ``device``: a GPU's free memory; on the CPU the
    smaller of the available memory and what the address-space limit (``ulimit -v``, ``prlimit
    --as``) leaves."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    available = _meminfo("MemAvailable") or float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return available
    used = _meminfo("VmSize", "/proc/self/status") or 0.0
    return max(0.0, min(available, limit - used))


def _meminfo(key: str, path: str = "/proc/meminfo") -> float | None:
    """A ``kB`` field of a /proc file in bytes; None where there is none (not Linux)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None
