"""--schedule auto: never predicted slower than the best fixed schedule it considers."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile, load_profile
from partitioner.optimizer import solve
from partitioner.optimizer.auto import AUTO_SCHEDULES, microbatch_counts, solve_auto
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.pricing.schedules import MODELS as SCHEDULE_MODELS
from partitioner.plan import Cluster, Plan
from tests.data import PIPEDREAM_PROFILES
from tests.partitioner.optimizer.conftest import make_profile

MODELS = ("alexnet", "vgg16", "resnet18", "squeezenet1_0")


def _profile(name: str) -> Profile:
    profile = load_profile(PIPEDREAM_PROFILES / name / "graph.txt")
    return profile if profile.batch_size else replace(profile, batch_size=64)


def _fixed(profile: Profile, cluster: Cluster, schedule: str) -> Plan | None:
    """The fixed schedule's best plan as auto asks for it (interleaved: the fastest over the virtual
    stage counts that apply, None where none does)."""
    if schedule == "zbv":
        with contextlib.suppress(PlanError):  # 2 x GPUs stages: a model with fewer layers has none
            return solve(profile, cluster, schedule, 4)
        return None
    if schedule != "interleaved":
        return solve(profile, cluster, schedule, 1 if schedule == "pipedream" else 4)
    found = []
    for v in SCHEDULE_MODELS["interleaved"].auto_virtual:
        with contextlib.suppress(PlanError):
            found.append(solve(profile, cluster, schedule, 4, virtual_stages=v))
    return min(found, key=lambda p: p.predicted.time_per_minibatch_s, default=None)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("gpus", [4, 8, 16])
def test_auto_is_the_fastest_schedule(name: str, gpus: int) -> None:
    profile, cluster = _profile(name), Cluster.flat(gpus)
    choice = solve_auto(profile, cluster, SolveOptions(microbatches=4))
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
    choice = solve_auto(profile, Cluster.flat(4), SolveOptions(microbatches=4), schedules=("1f1b", "zb1p"))
    assert set(choice.times) == {"1f1b", "zb1p"} and choice.plan.schedule in ("1f1b", "zb1p")
    with pytest.raises(InfeasibleError, match="memory"):
        solve_auto(profile, Cluster.flat(4, memory_bytes=1000), SolveOptions(microbatches=4))


def _with_fixed(profile: Profile, share: float) -> Profile:
    """Every layer's fixed time per call: ``share`` of its time at the profile's batch."""
    nodes = tuple(
        replace(n, forward_fixed_ms=share * n.forward_ms, backward_fixed_ms=share * n.backward_ms)
        for n in profile.nodes
    )
    return replace(profile, nodes=nodes)


@pytest.mark.parametrize("name", ["alexnet", "vgg16", "resnet18"])
@pytest.mark.parametrize("gpus", [4, 8])
def test_auto_searches_microbatches_where_calls_have_fixed_times(name: str, gpus: int) -> None:
    profile, cluster = _with_fixed(_profile(name), 0.02), Cluster.flat(gpus)
    choice = solve_auto(profile, cluster, SolveOptions(microbatches=4))
    assert choice.counts == microbatch_counts(profile, gpus, 4) and len(choice.counts) > 2
    for schedule in ("1f1b", "gpipe", "zb1p"):
        each = [solve(profile, cluster, schedule, m).predicted.time_per_minibatch_s for m in choice.counts]
        assert choice.times[schedule] == pytest.approx(min(each), rel=1e-12)
    assert choice.plan.predicted.time_per_minibatch_s == min(t for t in choice.times.values() if t)
    assert choice.plan.extra["microbatches_searched"] == list(choice.counts)


def test_fixed_times_make_a_middle_count_the_fastest() -> None:
    """Equal layers on 4 straight stages: more microbatches shrink 1f1b's bubble, each pays every
    layer's fixed time again; with none the most microbatches win, with some a middle count does."""
    chain = make_profile([(4, 8, 100, 100)] * 8, [(i, i + 1) for i in range(7)], batch_size=64)
    opts, cluster = SolveOptions(microbatches=4, straight=True), Cluster.flat(4)
    best = solve_auto(_with_fixed(chain, 0.05), cluster, opts, ["1f1b"]).plan.microbatches
    counts = microbatch_counts(_with_fixed(chain, 0.05), 4, 4)
    assert counts == (1, 2, 4, 8, 16) and best not in (1, 16)
    free = solve_auto(chain, cluster, opts, ["1f1b"], counts=counts)
    assert free.plan.microbatches == 16
    assert microbatch_counts(chain, 4, 4) == (4,)  # no fixed times measured: the asked count only


def test_auto_with_recompute_auto_recomputes_only_where_nothing_else_fits() -> None:
    chain = make_profile([(4, 8, 1000, 1000)] * 8, [(i, i + 1) for i in range(7)], batch_size=16)
    chain = replace(chain, nodes=tuple(replace(n, saved_bytes=400_000) if n.op != "input" else n
                                       for n in chain.nodes))  # fmt: skip
    # without recomputation the least a plan needs is 816 kB (4 replicas, each holding one whole
    # microbatch: a quarter of the 3.2 MB a minibatch saves); recomputing, 4 stages need about 203 kB
    tight, roomy = Cluster.flat(4, memory_bytes=210_000), Cluster.flat(4, memory_bytes=820_000)
    with pytest.raises(InfeasibleError):
        solve_auto(chain, tight, SolveOptions(microbatches=4))
    plan = solve_auto(chain, tight, SolveOptions(microbatches=4, recompute="auto")).plan
    assert any(s.recompute for s in plan.stages) and plan.extra["recompute"] == "auto"
    plan = solve_auto(chain, roomy, SolveOptions(microbatches=4, recompute="auto")).plan
    assert not any(s.recompute for s in plan.stages)
