"""The summary compares only against plans that fit: data parallelism is said not to fit when the
whole model on each device exceeds the memory limit, and the line says so instead of a ratio."""

from __future__ import annotations

import io
from dataclasses import replace

from rich.console import Console

from cli_render.plan import auto_table, plan_summary
from partitioner.optimizer import solve
from partitioner.optimizer.auto import solve_auto
from partitioner.optimizer.comparison import auto_tie, data_parallel_fits
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.pricing.simulate import simulate
from partitioner.plan import Cluster
from tests.partitioner.optimizer.conftest import make_profile

GIB = 2**30


def test_data_parallel_that_does_not_fit_is_named_not_compared() -> None:
    profile = make_profile([(10, 20, 2**20, GIB)] * 4, [(0, 1), (1, 2), (2, 3)])
    tight = solve(profile, Cluster.flat(4, memory_bytes=6 * GIB))
    assert len(tight.stages) > 1 and not data_parallel_fits(profile, tight)
    line = plan_summary(tight, simulate(tight, profile), profile)
    assert "data parallel does not fit in 6.00 GiB per device (the memory limit rules it out)" in line
    assert "over data parallel" not in line
    roomy = solve(profile, Cluster.flat(4, memory_bytes=64 * GIB))
    assert data_parallel_fits(profile, roomy)
    assert "over data parallel" in plan_summary(roomy, simulate(roomy, profile), profile)


def test_schedules_that_tie_are_said_to_tie_and_why_the_chosen_one_won() -> None:
    profile = make_profile([(10, 20, 2**20, 2**20)] * 8, [(i, i + 1) for i in range(7)], batch_size=8)
    one_core = replace(Cluster.flat(4), cores=1)  # four CPU ranks on one core: the host bounds them all
    choice = solve_auto(profile, one_core, SolveOptions(microbatches=4))
    tie = auto_tie(choice)
    assert (
        tie is not None
        and tie.startswith("all 6 schedules predict")
        and "the host's cores bound each of them" in tie
    ), tie
    assert f"{choice.plan.schedule} is chosen as the first of them in the order tried" in tie
    lines = _render(auto_table(choice, 4, 4), 80)
    assert max(map(len, lines)) <= 80 and any("predict" in line for line in lines)
    assert any("8 on 4 ranks (v=2)" in line for line in lines)  # CPU processes are not GPUs
    spread = solve_auto(profile, Cluster.flat(4), SolveOptions(microbatches=4))
    assert len({t for t in spread.times.values() if t}) > 1 and auto_tie(spread) is None


def _render(renderable: object, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False)
    console.print(renderable)
    return [line.rstrip() for line in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]
