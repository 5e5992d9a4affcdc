"""The measured peak memory of a rank: exact on known allocations; per stage in the report.

A run records it for every rank (tests/test_cli_run.py).
"""

from __future__ import annotations

import torch

from runtime.observing.peak_memory import PeakMemory, live_tensor_bytes, memory_report

torch.set_num_threads(1)


def test_peak_is_the_stage_tensors_plus_the_most_allocated_at_once() -> None:
    layer = torch.nn.Linear(100, 100)
    optim = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer(torch.randn(2, 100)).sum().backward()
    optim.step()  # momentum buffers: weights, gradients and state are 3 x 40,400 bytes
    assert live_tensor_bytes(layer, optim) == 3 * 4 * (100 * 100 + 100)
    meter = PeakMemory(torch.device("cpu"), window=2)
    meter.start(layer, optim)
    big = torch.empty(1_000_000, dtype=torch.uint8)
    small = torch.empty(300_000, dtype=torch.uint8)
    del big
    other = torch.empty(600_000, dtype=torch.uint8)  # 900,000 at once: less than 1,300,000 before
    meter.stepped(1)
    assert meter.peak_bytes is None  # the window is two minibatches
    meter.stepped(1)
    assert meter.peak_bytes == 3 * 40_400 + 1_300_000
    del small, other
    meter.stop()  # closed already: no change
    assert meter.peak_bytes == 3 * 40_400 + 1_300_000


def test_report_per_stage() -> None:
    report = memory_report([(0, 100), (0, 150), (1, 80)], (120, 0), "m", 4)
    assert report["stages"] == [
        {
            "stage": 0,
            "predicted_bytes": 120,
            "measured_peak_bytes": 150,
            "ratio_measured_over_predicted": 1.25,
        },
        {
            "stage": 1,
            "predicted_bytes": None,
            "measured_peak_bytes": 80,
            "ratio_measured_over_predicted": None,
        },
    ]
