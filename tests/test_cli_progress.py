"""Progress when the output is not a terminal (a log, a pipe, CI): a line per phase with the elapsed
time, at most one per interval within a phase, no escape codes."""

from __future__ import annotations

import io
import itertools
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

import cli
from cli_render.progress import PhaseLog


def test_a_line_per_phase_and_throttled_within_one() -> None:
    out = io.StringIO()
    log = PhaseLog(Console(file=out, width=80), every=10.0, delay=0.0)
    ticks = itertools.count(0.0, 3.0)  # each call of the clock: 3 s later
    log.clock = lambda: next(ticks)
    log.start = log.last = 0.0
    with log:
        task = log.add_task("tracing vgg16")
        for done in range(1, 9):
            log.update(task, completed=done, total=8, description=f"measuring layer{done}")
        log.update(task, description="whole-step timing")
    lines = out.getvalue().splitlines()
    assert [line.split(" s  ", 1)[1] for line in lines] == [
        "tracing vgg16", "measuring layer1 (1/8)", "measuring layer5 (5/8)", "whole-step timing (8/8)",
    ]  # fmt: skip
    assert [line.split(" s  ", 1)[0].strip() for line in lines] == ["0.0", "3.0", "15.0", "27.0"]


def test_nothing_in_the_first_seconds_nor_after_an_error() -> None:
    out = io.StringIO()
    log = PhaseLog(Console(file=out, width=80), every=10.0, delay=2.0)
    ticks = itertools.count(0.0, 1.5)
    log.clock = lambda: next(ticks)
    log.start = log.last = 0.0
    with pytest.raises(ValueError), log:
        log.add_task("tracing vgg16")  # at 0.0 s: too early
        log.update(0, description="measuring layer1")  # 1.5 s: too early
        log.update(0, description="measuring layer2")  # 3.0 s: shown
        raise ValueError("the forward raised")  # no last state after the error
    assert [line.split(" s  ", 1)[1] for line in out.getvalue().splitlines()] == ["measuring layer2"]


def test_profile_piped_prints_only_phase_lines_on_stderr(tmp_path: Path) -> None:
    args = ["profile", "tiny-mlp", "-o", str(tmp_path / "p.json")]
    result = CliRunner().invoke(cli.main, args, env={"TERM": "xterm-256color"})
    assert result.exit_code == 0, result.output
    assert all(re.match(PhaseLog.PATTERN, line) for line in result.stderr.splitlines())
    assert "\x1b" not in result.stdout + result.stderr
