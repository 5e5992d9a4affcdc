"""Devices that are not here: what a GPU can do, as numbers a layer's time is estimated from.

A plan for H100s is made on a laptop: ``pipeplan profile MODEL --device-model h100`` counts each
layer's floating-point operations and bytes moved on the meta device
(:mod:`partitioner.profiler.estimate`) and prices them against a :class:`DeviceModel`: dense peak
FLOP/s per compute dtype, memory bandwidth, memory size, and three efficiency terms (the share of
the peak a large matrix product reaches, the share of the bandwidth an elementwise kernel reaches,
the time one kernel launch costs). Every number has a source, recorded beside it and printed in
docs/devices.md. Plain data, no torch: plans and devices are compared anywhere.

The presets' peaks are NVIDIA's datasheet figures (dense, without structured sparsity); their
efficiency terms are what this project measured on one H100 80GB HBM3 (benchmarks/results/
gpu_h100_2026-11-25.md): a bfloat16 matrix product of 8192^3 ran at 778 of 989 TFLOP/s, a device
copy at 2987 of 3350 GB/s, a tiny kernel cost 6.6 us. The A100 and H200 presets assume the same
efficiencies; neither device was measured. ``pipeplan calibrate`` corrects them from a real run.

Example:
    >>> h100 = load_device_model("h100")
    >>> round(h100.peak_flops["bfloat16"] / 1e12, 1)
    989.4
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from partitioner.errors import PipeplanError
from partitioner.graph import Profile
from runtime.files.atomic import write_text_atomic

__all__ = [
    "COMPUTE_DTYPES",
    "DEVICE_MODEL_SCHEMA",
    "PRESETS",
    "DeviceModel",
    "device_model_from_json",
    "device_model_to_json",
    "estimated_device",
    "load_device_model",
    "read_spec_file",
    "save_device_model",
]

DEVICE_MODEL_SCHEMA = "pipeplan.device/1"

COMPUTE_DTYPES = ("float32", "tf32", "bfloat16", "float16")
"""The compute dtypes a device model gives a dense peak for (``tf32``: float32 matrix products on
tensor cores, what cuDNN uses for float32 convolutions by default)."""


@dataclass(frozen=True)
class DeviceModel:
    """One device, as the estimator prices work on it.

    Attributes:
        name: the preset name or the file's ``name``.
        description: what the device is.
        peak_flops: dense peak FLOP/s per compute dtype (:data:`COMPUTE_DTYPES`; float32 required).
        memory_bandwidth: bytes/s of the device's memory (the datasheet's figure).
        memory_bytes: memory of one device, bytes.
        matmul_efficiency: the share of the peak a large matrix product (mm, bmm, convolution,
            fused attention) reaches, for dtypes without a ``matmul_curve``.
        matmul_curve: per compute dtype, measured points (FLOPs of one product, FLOP/s it reached),
            smallest first: a product's rate is interpolated between them (log-log; clamped at the
            ends). Small products reach a fraction of the peak (an H100 ran a bfloat16 product of
            1024^3 at 101 TFLOP/s, one of 8192^3 at 778).
        memory_efficiency: the share of the bandwidth a streaming kernel (elementwise, copy,
            reduction, optimizer update) reaches.
        launch_s: seconds one kernel costs at the least (launch and dispatch): a kernel takes the
            longer of this and its roofline time.
        float32_matmul: the compute dtype of a float32 matrix product: ``float32`` (torch's
            default on CUDA) or ``tf32`` (``torch.backends.cuda.matmul.allow_tf32``).
        float32_conv: the same for a float32 convolution (cuDNN's default: ``tf32``).
        sources: where each number comes from, by attribute name.
        assumptions: what the estimate assumes beyond the numbers.
    """

    name: str
    description: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_bytes: int
    matmul_efficiency: float
    memory_efficiency: float
    launch_s: float
    float32_matmul: str = "float32"
    float32_conv: str = "tf32"
    matmul_curve: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    assumptions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if "float32" not in self.peak_flops:
            raise PipeplanError(f"device model {self.name}: peak_flops needs a float32 entry")
        unknown = sorted(set(self.peak_flops) - set(COMPUTE_DTYPES))
        if unknown:
            raise PipeplanError(
                f"device model {self.name}: unknown compute dtype {unknown[0]!r} in peak_flops; "
                f"use {', '.join(COMPUTE_DTYPES)}"
            )
        positive = {
            "memory_bandwidth": self.memory_bandwidth, "memory_bytes": self.memory_bytes,
            **{f"peak_flops.{k}": v for k, v in self.peak_flops.items()},
        }  # fmt: skip
        for key, value in positive.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PipeplanError(f"device model {self.name}: {key} must be a number > 0, got {value!r}")
        for key in ("matmul_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise PipeplanError(f"device model {self.name}: {key} must be in (0, 1], got {value!r}")
        if not (isinstance(self.launch_s, (int, float)) and 0 <= self.launch_s < 1):
            raise PipeplanError(
                f"device model {self.name}: launch_s must be in [0, 1) s, got {self.launch_s!r}"
            )
        for key in ("float32_matmul", "float32_conv"):
            if getattr(self, key) not in ("float32", "tf32"):
                raise PipeplanError(f"device model {self.name}: {key} must be float32 or tf32")

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a dtype the model lacks computes at float32's."""
        return float(self.peak_flops.get(dtype, self.peak_flops["float32"]))

    def matmul_rate(self, dtype: str, flops: float) -> float:
        """FLOP/s a matrix product of ``flops`` reaches in ``dtype``: the ``matmul_curve`` where
        there is one, else the peak times ``matmul_efficiency``."""
        curve = self.matmul_curve.get(dtype)
        if not curve:
            return self.peak(dtype) * self.matmul_efficiency
        if flops <= curve[0][0]:
            return curve[0][1]
        for (f0, r0), (f1, r1) in itertools.pairwise(curve):
            if flops <= f1:
                t = math.log(flops / f0) / math.log(f1 / f0)
                return math.exp(math.log(r0) + t * math.log(r1 / r0))
        return curve[-1][1]

    def scaled(self, factor: float, source: str) -> DeviceModel:
        """The same device with its work ``factor`` times slower: both efficiencies divided by it
        (capped at 1) and the launch time multiplied: what a calibration measured."""
        if not (math.isfinite(factor) and factor > 0):
            raise PipeplanError(f"a calibration factor must be a number > 0, got {factor!r}")
        sources = {**self.sources}
        for key in ("matmul_efficiency", "matmul_curve", "memory_efficiency", "launch_s"):
            sources[key] = f"{source} (x{1 / factor:.3f} of: {self.sources.get(key, 'the preset')})"
        curve = {k: tuple((f, r / factor) for f, r in v) for k, v in self.matmul_curve.items()}
        return replace(
            self,
            matmul_efficiency=min(1.0, self.matmul_efficiency / factor),
            matmul_curve=curve,
            memory_efficiency=min(1.0, self.memory_efficiency / factor),
            launch_s=self.launch_s * factor,
            sources=sources,
        )


_NVIDIA_A100 = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM4 80GB"
_NVIDIA_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM5 column (dense: half the with-sparsity figures)"
)
_NVIDIA_H200 = "NVIDIA H200 Tensor Core GPU product page and datasheet, H200 SXM column"
_MEASURED_H100 = "benchmarks/results/gpu_h100_2026-11-25.md, one H100 80GB HBM3, torch 2.11"
_SAME_AS_H100 = f"assumed equal to the H100's, measured in {_MEASURED_H100}; not measured on this device"
_FP32_DEFAULTS = (
    "float32 matrix products in float32 (torch.backends.cuda.matmul.allow_tf32 = False, torch's "
    "default), float32 convolutions in TF32 (torch.backends.cudnn.allow_tf32 = True, the default)"
)
_FUSED = "attention (scaled_dot_product_attention) runs as one fused kernel; a causal one does half the work"
_GPU_ASSUMPTIONS = (_FP32_DEFAULTS, _FUSED, "kernels launch asynchronously: each costs at least launch_s")


# The H100's measured ceilings (benchmarks/results/gpu_h100_2026-11-25.md): TFLOP/s of square
# products of n = 1024, 2048, 4096, 8192 per dtype.
_H100_CEILINGS = {
    "bfloat16": (101.14, 459.26, 730.87, 777.57),
    "float16": (101.45, 452.48, 715.59, 748.91),
    "tf32": (69.33, 259.23, 366.68, 368.04),
    "float32": (26.53, 39.55, 50.54, 51.67),
}


def _curve(scale: Mapping[str, float]) -> dict[str, tuple[tuple[float, float], ...]]:
    """The H100's ceilings as (FLOPs, FLOP/s) points, each dtype's rates times ``scale[dtype]``."""
    sizes = (1024, 2048, 4096, 8192)
    return {
        dtype: tuple(
            (2.0 * n**3, tflops * 1e12 * scale[dtype]) for n, tflops in zip(sizes, rates, strict=True)
        )
        for dtype, rates in _H100_CEILINGS.items()
    }


_H100_PEAKS = {"float32": 66.9e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12}


def _gpu(
    name: str, description: str, peaks: Mapping[str, float], bandwidth: float, memory: int, source: str,
    efficiency_source: str,
) -> DeviceModel:  # fmt: skip
    sources = {
        "peak_flops": source,
        "memory_bandwidth": source,
        "memory_bytes": source,
        "matmul_efficiency": (
            "778 of 989 TFLOP/s for a bfloat16 8192^3 matrix product (float16 749, TF32 368 of 495, "
            f"float32 51.7 of 66.9): {efficiency_source}"
        ),
        "memory_efficiency": f"a device copy at 2987 of 3350 GB/s (read + write): {efficiency_source}",
        "launch_s": f"6.6 us per tiny kernel: {efficiency_source}",
        "matmul_curve": (
            "square products of n = 1024 to 8192 per dtype, TFLOP/s scaled by this device's peak over the "
            f"H100's: {efficiency_source}"
        ),
    }
    curve = _curve({k: peaks[k] / _H100_PEAKS[k] for k in _H100_PEAKS})
    return DeviceModel(
        name, description, peaks, bandwidth, memory, 0.786, 0.892, 6.6e-6, matmul_curve=curve,
        sources=sources, assumptions=_GPU_ASSUMPTIONS,
    )  # fmt: skip


PRESETS: dict[str, DeviceModel] = {
    "a100-80gb": _gpu(
        "a100-80gb",
        "NVIDIA A100 80GB SXM4",
        {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
        2039e9,
        80 * 2**30,
        _NVIDIA_A100,
        _SAME_AS_H100,
    ),
    "h100": _gpu(
        "h100",
        "NVIDIA H100 SXM5 80GB HBM3",
        _H100_PEAKS,
        3350e9,
        80 * 2**30,
        _NVIDIA_H100,
        _MEASURED_H100,
    ),
    "h200": _gpu(
        "h200",
        "NVIDIA H200 SXM 141GB HBM3e",
        {"float32": 66.9e12, "tf32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
        4800e9,
        141 * 10**9,
        _NVIDIA_H200,
        _SAME_AS_H100,
    ),
}
PRESETS["h100-sxm"] = replace(PRESETS["h100"], name="h100-sxm")


def load_device_model(spec: str) -> DeviceModel:
    """A preset by name (``h100``), or a device model JSON file (``device_model_to_json``'s format).

    ``cpu`` is not a preset: it is measured on this machine (:func:`partitioner.profiler.cpu_model`).

    Raises:
        PipeplanError: neither a preset nor a readable, valid file; the message lists the presets.
    """
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "cpu":
        raise PipeplanError(
            "device model 'cpu' is not a preset: it is this machine's CPU, measured when asked for "
            "(`pipeplan profile --device-model cpu` measures it; in Python, "
            "partitioner.profiler.cpu_model.cpu_model()); load_device_model takes a preset "
            f"({', '.join(PRESETS)}) or a device model JSON file"
        )
    close = difflib.get_close_matches(spec, [*PRESETS, "cpu"], n=2)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    presets = f"{hint}: use a preset ({', '.join([*PRESETS, 'cpu'])}) or a device model JSON file"
    return device_model_from_json(read_spec_file(spec, "device model", presets), spec)


def read_spec_file(spec: str, what: str, presets: str) -> Any:
    """The JSON document a ``--device-model`` or ``--cluster`` that names no preset points to.

    Raises:
        PipeplanError: no such file (``presets`` says what else ``spec`` could be), or not JSON.
    """
    path = Path(spec)
    if not path.is_file():
        raise PipeplanError(f"unknown {what} {spec!r}{presets} (see docs/devices.md)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PipeplanError(f"cannot read {what} {spec}: {exc}") from exc


def device_model_to_json(model: DeviceModel) -> dict[str, Any]:
    """The JSON document of a device model (``"schema": "pipeplan.device/1"``)."""
    doc = {"schema": DEVICE_MODEL_SCHEMA, **asdict(model)}
    doc["peak_flops"], doc["sources"] = dict(model.peak_flops), dict(model.sources)
    doc["assumptions"] = list(model.assumptions)
    doc["matmul_curve"] = {k: [list(p) for p in v] for k, v in model.matmul_curve.items()}
    return doc


def device_model_from_json(doc: Any, source: str = "device model") -> DeviceModel:
    """Parse :func:`device_model_to_json`'s document; PipeplanError names what is wrong."""
    if not isinstance(doc, Mapping) or doc.get("schema") != DEVICE_MODEL_SCHEMA:
        raise PipeplanError(f"{source} is not a pipeplan device model (schema {DEVICE_MODEL_SCHEMA!r})")
    known = {f for f in DeviceModel.__dataclass_fields__}
    unknown = sorted(set(doc) - known - {"schema"})
    if unknown:
        raise PipeplanError(
            f"{source}: unknown field {unknown[0]!r}; the fields are {', '.join(sorted(known))}"
        )
    try:
        fields = {k: v for k, v in doc.items() if k != "schema"}
        fields["peak_flops"] = {str(k): float(v) for k, v in fields["peak_flops"].items()}
        fields["assumptions"] = tuple(str(a) for a in fields.get("assumptions", ()))
        fields["matmul_curve"] = {
            str(k): tuple((float(f), float(r)) for f, r in v)
            for k, v in fields.get("matmul_curve", {}).items()
        }
        fields["memory_bytes"] = int(fields["memory_bytes"])
        return DeviceModel(**fields)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PipeplanError(f"{source}: bad or missing field {exc}") from exc


def estimated_device(profile: Profile) -> DeviceModel | None:
    """The device model an estimated profile was made for (``profile.extra["estimate"]``), else None."""
    estimate = profile.extra.get("estimate")
    if not isinstance(estimate, Mapping) or "device_model" not in estimate:
        return None
    return device_model_from_json(estimate["device_model"], f"{profile.model}'s estimate")


def save_device_model(model: DeviceModel, path: str | os.PathLike[str]) -> Path:
    """Write a device model JSON file (atomically)."""
    return write_text_atomic(path, json.dumps(device_model_to_json(model), indent=1) + "\n")
