"""Device models: presets with sources, files, the matmul curve, calibration's correction."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from partitioner.errors import PipeplanError
from partitioner.hardware.devices import (
    PRESETS,
    DeviceModel,
    device_model_from_json,
    device_model_to_json,
    load_device_model,
    save_device_model,
)


def test_presets_cite_a_source_for_every_number() -> None:
    for name, model in PRESETS.items():
        keys = ("peak_flops", "memory_bandwidth", "memory_bytes", "matmul_efficiency", "memory_efficiency")
        for key in (*keys, "launch_s", "matmul_curve"):
            assert model.sources.get(key), f"{name}: {key} has no source"
        assert model.peak("bfloat16") > model.peak("tf32") > model.peak("float32")
    assert PRESETS["h100"].peak("bfloat16") == 989.4e12 and PRESETS["h100"].memory_bandwidth == 3350e9
    assert PRESETS["a100-80gb"].peak("bfloat16") == 312e12 and PRESETS["h200"].memory_bytes == 141 * 10**9


def test_the_matmul_curve_passes_through_the_measured_ceilings() -> None:
    h100 = PRESETS["h100"]
    for n, tflops in zip((1024, 2048, 4096, 8192), (101.14, 459.26, 730.87, 777.57), strict=True):
        assert h100.matmul_rate("bfloat16", 2.0 * n**3) == pytest.approx(tflops * 1e12)
    between = h100.matmul_rate("bfloat16", 2.0 * 3000**3)
    assert 459.26e12 < between < 730.87e12
    assert h100.matmul_rate("bfloat16", 1.0) == pytest.approx(101.14e12)  # clamped at the ends
    assert h100.matmul_rate("bfloat16", 1e18) == pytest.approx(777.57e12)
    a100 = PRESETS["a100-80gb"]  # the H100's curve scaled by the peaks
    assert a100.matmul_rate("bfloat16", 2.0 * 8192**3) == pytest.approx(777.57e12 * 312 / 989.4)
    flat = replace(h100, matmul_curve={})
    assert flat.matmul_rate("bfloat16", 1.0) == pytest.approx(989.4e12 * h100.matmul_efficiency)


def test_a_device_model_file_round_trips_and_bad_ones_say_why(tmp_path: Path) -> None:
    path = save_device_model(PRESETS["h100"], tmp_path / "h100.json")
    assert load_device_model(str(path)) == PRESETS["h100"]
    doc = device_model_to_json(PRESETS["h100"])
    with pytest.raises(PipeplanError, match="matmul_efficiency must be in"):
        device_model_from_json({**doc, "matmul_efficiency": 1.5})
    with pytest.raises(PipeplanError, match="unknown field 'flops'"):
        device_model_from_json({**doc, "flops": 1})
    with pytest.raises(PipeplanError, match="unknown compute dtype 'int8'"):
        device_model_from_json({**doc, "peak_flops": {"float32": 1e12, "int8": 2e12}})
    with pytest.raises(PipeplanError, match="not a pipeplan device model"):
        device_model_from_json({"name": "x"})
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(PipeplanError, match="cannot read device model"):
        load_device_model(str(tmp_path / "broken.json"))


def test_an_unknown_device_model_lists_the_presets() -> None:
    with pytest.raises(PipeplanError) as info:
        load_device_model("h10")
    message = str(info.value)
    assert "did you mean h100" in message and all(name in message for name in (*PRESETS, "cpu"))


def test_the_cpu_model_is_not_loaded_as_a_preset_and_the_message_says_where_it_comes_from() -> None:
    with pytest.raises(PipeplanError) as info:
        load_device_model("cpu")
    message = str(info.value)
    assert "'cpu' is not a preset" in message and "cpu_model()" in message and "did you mean" not in message
    assert all(name in message for name in PRESETS)


def test_scaling_slows_every_term_by_the_factor() -> None:
    h100 = PRESETS["h100"]
    slow = h100.scaled(2.0, "calibrated from run.json")
    assert slow.matmul_efficiency == pytest.approx(h100.matmul_efficiency / 2)
    assert slow.memory_efficiency == pytest.approx(h100.memory_efficiency / 2)
    assert slow.launch_s == pytest.approx(2 * h100.launch_s)
    assert slow.matmul_rate("bfloat16", 1e12) == pytest.approx(h100.matmul_rate("bfloat16", 1e12) / 2)
    assert "calibrated from run.json" in slow.sources["matmul_efficiency"]
    assert h100.scaled(0.1, "fast").memory_efficiency == 1.0  # capped: no device beats its bandwidth
    with pytest.raises(PipeplanError):
        h100.scaled(0.0, "x")
    assert json.loads(json.dumps(device_model_to_json(slow)))["name"] == "h100"
    assert isinstance(slow, DeviceModel)
