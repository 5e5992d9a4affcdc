"""A ``profile`` request checked before anything is measured: a bad shape, an unwritable output or an
option that means nothing for an estimate fails in a second, not after a long measurement."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from partitioner.errors import PipeplanError, ProfileFormatError
from partitioner.graph import load_profile
from partitioner.hardware.devices import load_device_model
from partitioner.models.specs import model_name
from partitioner.profiler.profile import check_precision_options

__all__ = ["check_estimate_options", "check_output", "parse_shape", "prepare"]

MEASURING = ("device", "repeats", "fixed_cost", "materialize")  # options that only shape a measurement


def prepare(
    model: str, output: str | None, batch_size: int, input_shape: str | None, dtype: str, precision: str,
    device_model: str | None, given: Sequence[str] = (),
) -> tuple[tuple[int, ...] | None, Path]:  # fmt: skip
    """Check a request (``given``: the options the user set) -> (one sample's shape, the output path)."""
    if batch_size <= 0:
        raise PipeplanError(f"--batch-size must be positive, got {batch_size}")
    if device_model is not None:
        check_estimate_options(device_model, given)
    check_precision_options(precision, dtype)
    shape = parse_shape(input_shape)
    path = Path(output) if output else Path("profiles") / model_name(model) / "profile.json"
    check_output(path)
    return shape, path


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """``3,224,224`` -> (3, 224, 224); a PipeplanError names the bad value."""
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise PipeplanError(
            f"bad --input-shape {text!r}: give one sample's shape as positive integers, e.g. 3,224,224 or 128"
        )
    return shape


def check_output(path: Path) -> None:
    """Fail before a long measurement, not after: the folder must be writable and no foreign file replaced."""
    if path.is_dir():
        raise PipeplanError(f"output {path} is a folder; give a file name such as {path / 'profile.json'}")
    if path.exists():
        try:
            load_profile(path)
        except ProfileFormatError as exc:
            raise PipeplanError(f"refusing to overwrite {path}: {exc}") from exc
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise PipeplanError(
            f"cannot write {path}: {exc.strerror or exc}; choose another -o/--output"
        ) from exc


def check_estimate_options(device_model: str, given: Sequence[str]) -> None:
    """--device-model estimates without running: options that only shape a measurement are refused
    (``given``: the options set on the command line, by their parameter names)."""
    if device_model != "cpu":
        load_device_model(device_model)  # before a progress bar: an unknown name is one line
    measuring = list(MEASURING)
    if device_model != "cpu":
        measuring += ["threads", "clock"]  # the cpu model measures this machine at --threads, --clock
    refused = [p for p in measuring if p in given]
    if refused:
        flag = "--" + refused[0].replace("_", "-")
        raise PipeplanError(f"{flag} shapes a measurement; --device-model estimates without one: drop {flag}")
