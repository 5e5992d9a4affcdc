"""Model FLOPs of a minibatch and a device's peak: what model FLOP utilisation (MFU) divides.

MFU = model FLOPs per minibatch / (seconds per minibatch x devices x one device's peak FLOP/s). The
model FLOPs are the unsplit model's forward and backward, counted by ``torch.utils.flop_counter`` on
the meta device (every stage chained on meta tensors: no memory, no compute): recomputed forwards,
optimizer steps and communication are not model FLOPs. The peak is ``--peak-tflops`` or, for a GPU
named below, its spec sheet's dense figure at the run's precision; a CPU has none.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType

import torch
from torch.utils.flop_counter import FlopCounterMode

from runtime.packages.load import Wiring
from runtime.packages.tensor_names import stage_modules

__all__ = ["SPEC_TFLOPS", "minibatch_flops", "peak_flops", "token_count"]

log = logging.getLogger(__name__)

SPEC_TFLOPS: dict[str, dict[str, float]] = {
    # dense tensor-core TFLOP/s (fp32: TF32, which torch uses for float32 matmuls only when allowed;
    # plain fp32 is 19.5 on A100, 67 on H100): NVIDIA's A100 datasheet (SXM), H100 datasheet (SXM5),
    # H200 product brief
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
}
"""Peak dense TFLOP/s of a device, by a word of its name, per precision."""


def peak_flops(device: torch.device, precision: str, given_tflops: float | None) -> float | None:
    """One device's peak FLOP/s: ``given_tflops``, else a known GPU's spec sheet figure, else None."""
    if given_tflops is not None:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for word, table in SPEC_TFLOPS.items():
        if word in name:
            return table.get(precision, table["fp32"]) * 1e12
    return None


def token_count(inputs: Sequence[torch.Tensor]) -> int | None:
    """Tokens in a minibatch: the elements of its first input when that is integer ids of a sequence
    (batch x positions); None for other models."""
    first = inputs[0] if inputs else None
    if first is None or first.is_floating_point() or first.dim() < 2 or first.dtype == torch.bool:
        return None
    return int(first.numel())


def minibatch_flops(
    package: ModuleType,
    wiring: Wiring,
    module_stages: Sequence[int],
    inputs: Sequence[torch.Tensor],
    targets: torch.Tensor,
) -> int | None:
    """The model's forward and backward FLOPs on one minibatch; None where the model cannot run on
    the meta device (data-dependent code, an operator without a meta kernel)."""
    try:
        modules = stage_modules(package, wiring, module_stages)
        with torch.device("meta"):
            criterion = package.criterion()
        with FlopCounterMode(display=False) as counter:
            env = {n: t.to("meta") for n, t in zip(wiring.stage_inputs[0], inputs, strict=True)}
            for k, module in enumerate(modules):
                out = module(*(env[n] for n in wiring.stage_inputs[k]))
                names = wiring.stage_outputs[k]
                env.update(zip(names, (out,) if len(names) == 1 else out, strict=True))
            criterion(env[wiring.loss_input], targets.to("meta")).backward()
    except Exception as exc:  # a model that only runs on real data: no MFU, said once
        log.info("no model FLOP count (the model does not run on the meta device: %s)", exc)
        return None
    return int(counter.get_total_flops())
