"""This machine's CPU as a device model, from rates measured here and now.

The ``cpu`` device model prices work at what this CPU does with the profile's threads: a matrix
product's rate per dtype (n = 1024, the size of most layers' products), a large copy's bandwidth,
and the time torch takes to dispatch a tiny operation. The rates are achieved ones, so the
efficiencies are 1. Estimating a model with it and comparing with a measured profile of the same
model (``benchmarks/bench_device_model.py``) tests the estimator where its answer can be checked.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from partitioner.hardware.devices import DeviceModel

__all__ = ["cpu_model"]

_SOURCE = "measured by pipeplan on this machine when the profile was made"


def cpu_model(threads: int | None = None, seconds: float = 0.3, clock: str = "wall") -> DeviceModel:
    """Measure this CPU at ``threads`` threads (default: torch's current count), about ``seconds``
    per rate; ``clock="cpu"`` times with the process's CPU time (steadier on a shared machine, as
    ``pipeplan profile --clock cpu``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    timer = time.process_time if clock == "cpu" else time.perf_counter
    try:
        peaks = {name: _matmul_rate(dtype, seconds, timer) for name, dtype in _DTYPES.items()}
        bandwidth, launch = _copy_rate(seconds, timer), _dispatch_s(seconds, timer)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    peaks["tf32"] = peaks["float32"]
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    sources = {
        "peak_flops": f"{_SOURCE}: {used} thread(s), square matrix products of n = 1024 (256 for a "
        "dtype whose 1024 product would outlast the time allowed)",
        "memory_bandwidth": f"{_SOURCE}: copy of 64 MiB (read + write)",
        "memory_bytes": "this machine's physical memory",
        "matmul_efficiency": "1: the peaks are achieved rates",
        "memory_efficiency": "1: the bandwidth is an achieved rate",
        "launch_s": f"{_SOURCE}: one add of two 1-element tensors",
    }
    return DeviceModel(
        "cpu", f"this CPU, {used} thread(s)", peaks, bandwidth, memory, 1.0, 1.0, launch,
        float32_matmul="float32", float32_conv="float32", sources=sources,
        assumptions=("kernels run one after another on the profile's threads",),
    )  # fmt: skip


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


Timer = Callable[[], float]


def _rate(run: Callable[[], object], seconds: float, timer: Timer) -> float:
    """Median seconds of ``run`` over about ``seconds`` of wall time (after one warm-up call)."""
    run()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while not times or time.perf_counter() < deadline:
        start = timer()
        for _ in range(10):
            run()
        times.append((timer() - start) / 10)
    return statistics.median(times)


def _matmul_rate(dtype: torch.dtype, seconds: float, timer: Timer, n: int = 1024) -> float:
    """FLOP/s of an ``n``-cube product, probed at 256 first: a dtype this CPU multiplies slowly
    (float16 without a vector path runs at about 1 GFLOP/s, 2 s a 1024 product) keeps the 256 rate,
    as slow at any size, so that measuring it does not take half a minute."""
    small = _product_rate(dtype, seconds / 4, timer, 256)
    one_product_s = 2.0 * n**3 / small
    return small if one_product_s > seconds else _product_rate(dtype, seconds, timer, n)


def _product_rate(dtype: torch.dtype, seconds: float, timer: Timer, n: int) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2.0 * n**3 / _rate(lambda: a @ b, seconds, timer)


def _copy_rate(seconds: float, timer: Timer) -> float:
    src = torch.ones(16 * 2**20)
    dst = torch.empty_like(src)
    return 2.0 * src.nbytes / _rate(lambda: dst.copy_(src), seconds, timer)


def _dispatch_s(seconds: float, timer: Timer) -> float:
    x, y = torch.ones(1), torch.ones(1)
    return _rate(lambda: torch.add(x, y), seconds / 3, timer)
