"""--schedule auto: never predicted slower than the best fixed schedule it considers."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile, load_profile
from partitioner.optimizer import solve
from partitioner.optimizer.auto import AUTO_SCHEDULES, AUTO_VIRTUAL_STAGES, solve_auto
from partitioner.plan import Cluster, Plan
from tests.data import PIPEDREAM_PROFILES

MODELS = ("alexnet", "vgg16", "resnet18", "squeezenet1_0")


def _profile(name: str) -> Profile:
    profile = load_profile(PIPEDREAM_PROFILES / name / "graph.txt")
    return profile if profile.batch_size else replace(profile, batch_size=64)


def _fixed(profile: Profile, cluster: Cluster, schedule: str) -> Plan | None:
    """The fixed schedule's best plan as auto asks for it (interleaved: the fastest over the virtual
    stage counts that apply, None where none does)."""
    if schedule != "interleaved":
        return solve(profile, cluster, schedule, 1 if schedule == "pipedream" else 4)
    found = []
    for v in AUTO_VIRTUAL_STAGES:
        with contextlib.suppress(PlanError):
            found.append(solve(profile, cluster, schedule, 4, virtual_stages=v))
    return min(found, key=lambda p: p.predicted.time_per_minibatch_s, default=None)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("gpus", [4, 8, 16])
def test_auto_is_the_fastest_schedule(name: str, gpus: int) -> None:
    profile, cluster = _profile(name), Cluster.flat(gpus)
    choice = solve_auto(profile, cluster, microbatches=4)
    fixed = {s: _fixed(profile, cluster, s) for s in AUTO_SCHEDULES}
    best = min(p.predicted.time_per_minibatch_s for p in fixed.values() if p is not None)
    assert choice.plan.predicted.time_per_minibatch_s == pytest.approx(best, rel=1e-12)
    want = {s: p.predicted.time_per_minibatch_s if p else None for s, p in fixed.items()}
    assert choice.times == pytest.approx(want)
    assert (choice.times["interleaved"] is None) == (gpus != 4)  # 4 microbatches: a multiple of 4 GPUs only
    assert choice.plan.extra["schedule_auto"] == choice.times
    assert choice.plan.schedule == min(choice.times, key=lambda s: choice.times[s] or float("inf"))


def test_only_the_schedules_asked_and_nothing_fits_names_the_memory() -> None:
    profile = _profile("alexnet")
    choice = solve_auto(profile, Cluster.flat(4), 4, schedules=("1f1b", "zb1p"))
    assert set(choice.times) == {"1f1b", "zb1p"} and choice.plan.schedule in ("1f1b", "zb1p")
    with pytest.raises(InfeasibleError, match="memory"):
        solve_auto(profile, Cluster.flat(4, memory_bytes=1000), 4)
