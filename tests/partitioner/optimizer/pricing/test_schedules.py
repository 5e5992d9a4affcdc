"""The cost and memory models, checked by hand on a 3-layer chain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.graph import Profile, at_microbatches
from partitioner.optimizer import evaluate, solve
from partitioner.optimizer.pricing.simulate import simulate
from partitioner.optimizer.pricing.stage import host_bound
from partitioner.plan import Cluster
from tests.partitioner.optimizer.conftest import make_profile

# compute l0 = 30 ms, l1 = 15 ms, l2 = 45 ms; outputs 4 MB, 1 MB, 0; params 1 MB, 0, 2 MB
THREE = make_profile([(10, 20, 4_000_000, 1_000_000), (5, 10, 1_000_000, 0), (15, 30, 0, 2_000_000)],
                     [(0, 1), (1, 2)])  # fmt: skip


def test_pipedream_hand_checked() -> None:
    # stage 0 = l0 on 2 replicas: (0.030 + 4*1*1e6/(2*1e9)) / 2 = 0.016; its cut 2*4e6/(1e9*2) = 0.004
    # stage 1 = l1,l2 on 1: 0.060; its cut 2*4e6/1e9 = 0.008 -> the plan takes 0.060
    plan = evaluate(THREE, Cluster.flat(3), ["l0"], [2, 1])
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.060)
    # stage 0 = l0,l1 on 1: 0.045 (cut 2*1e6/1e9 = 0.002); stage 1 = l2 on 2: (0.045 + 0.004)/2 = 0.0245
    plan = evaluate(THREE, Cluster.flat(3), ["l1"], [1, 2])
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.045)
    assert solve(THREE, Cluster.flat(3)).predicted.time_per_minibatch_s <= 0.045 + 1e-12


def test_pipedream_activation_bound() -> None:
    # at 1e8 B/s stage 0 (l0 on 2): compute (0.030 + 0.02)/2 = 0.025 but the cut 2*4e6/(1e8*2) = 0.04
    plan = evaluate(THREE, Cluster.flat(3, bandwidth=1e8), ["l0"], [2, 1])
    assert plan.stages[0].compute_s == pytest.approx(0.030)
    assert plan.predicted.time_per_minibatch_s == pytest.approx(max(0.04, 0.06, 2 * 4e6 / 1e8))


def test_memory_per_schedule() -> None:
    cluster = Cluster.flat(3)
    # pipedream: stage 0 holds ceil(3/2) = 2 minibatches: 2P (weights+grads) + 2 snapshots P (one per
    # version in flight, beside the live weights) + 2 activations
    pd = evaluate(THREE, cluster, ["l0"], [2, 1])
    assert pd.stages[0].memory_bytes == 2_000_000 + 2 * 1_000_000 + 2 * 4_000_000
    adam = evaluate(THREE, cluster, ["l0"], [2, 1], optimizer="adam")
    assert adam.stages[0].memory_bytes == 4_000_000 + 2 * 1_000_000 + 2 * 4_000_000
    # the last stage holds one minibatch: no snapshot
    assert pd.stages[1].memory_bytes == 2 * 2_000_000 + 1_000_000 + 0
    # 1f1b with M=4: min(2 - 0, 4) = 2 microbatches of 4e6/(4*2) each; each replica runs 2 of the 4
    # microbatches, so it accumulates: l0's gradient (1 MB) beside the sum
    f1b = evaluate(THREE, cluster, ["l0"], [2, 1], "1f1b", 4)
    assert f1b.stages[0].memory_bytes == 2_000_000 + 1_000_000 + 2 * 4_000_000 // 8
    # gpipe: both of a replica's microbatches while its first backward makes the gradients, one
    # beside l0's gradient being added in its second (the larger of the two)
    gp = evaluate(THREE, cluster, ["l0"], [2, 1], "gpipe", 4)
    assert gp.stages[0].memory_bytes == 2_000_000 + max(4 * 4_000_000 // 8, 4_000_000 // 4 + 1_000_000)
    # zb1p's W computes the whole stage's weight gradients before adding them: P as well here
    zb = evaluate(THREE, cluster, ["l1"], [1, 1], "zb1p", 2)
    assert zb.stages[1].memory_bytes == 2 * 2_000_000 + 2_000_000 + 2 * 0 // 2
    # two microbatches on two replicas: nothing to accumulate
    two = evaluate(THREE, cluster, ["l0"], [2, 1], "1f1b", 2)
    assert two.stages[0].memory_bytes == 2_000_000 + 2 * 4_000_000 // 4


def test_synchronous_time_hand_checked() -> None:
    # M=2: stage 0 per microbatch 0.030/(2*2) + 2*4e6/(1e9*2)/2 = 0.0095; stage 1 0.060/2 = 0.030
    # time = 0.0095 + 0.030 + (2-1)*0.030 + all-reduce of stage 0 (4*1*1e6/(2*1e9) = 0.002)
    plan = evaluate(THREE, Cluster.flat(3), ["l0"], [2, 1], "1f1b", 2)
    assert plan.predicted.time_per_minibatch_s == pytest.approx(0.0715)


def test_infeasible_memory_names_a_limit_that_fits() -> None:
    from partitioner.errors import InfeasibleError

    with pytest.raises(InfeasibleError, match="would"):
        solve(THREE, Cluster.flat(2, memory_bytes=1000))


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
def test_adamw_keeps_adams_state_in_the_cost_model_and_the_simulation(schedule: str) -> None:
    from partitioner.optimizer.pricing.simulate import simulate

    m = 1 if schedule == "pipedream" else 4
    adam = evaluate(THREE, Cluster.flat(3), ["l0"], [2, 1], schedule, m, optimizer="adam")
    adamw = evaluate(THREE, Cluster.flat(3), ["l0"], [2, 1], schedule, m, optimizer="adamw")
    sgd = evaluate(THREE, Cluster.flat(3), ["l0"], [2, 1], schedule, m, optimizer="sgd")
    assert adamw.optimizer == "adamw"
    assert [s.memory_bytes for s in adamw.stages] == [s.memory_bytes for s in adam.stages]
    assert adamw.stages[0].memory_bytes == sgd.stages[0].memory_bytes + 2 * 1_000_000  # two moments
    assert simulate(adamw, THREE).peak_memory_bytes == tuple(s.memory_bytes for s in adamw.stages)


def test_host_bound_counts_cpu_ranks_sharing_cores() -> None:
    # 4 ranks of 1, 2, 3, 4 s on 2 cores at 1 thread: 10 s over 2 at a time; 2 threads: 1 at a time
    assert host_bound([1, 2, 3, 4], 4, 2, 1) == pytest.approx(5.0)
    assert host_bound([1, 2, 3, 4], 4, 2, 2) == pytest.approx(10.0)
    assert host_bound([1, 2, 3, 4], 2, 2, 1) == pytest.approx(3.5)  # two hosts of 2: the busier, 7 s / 2
    assert host_bound([1, 2], 2, 8, 1) == pytest.approx(1.5)  # more cores than ranks: 2 at a time
    assert host_bound([1, 2, 3, 4], 4, None, 1) == 0.0  # GPUs compute on their own


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b"])
def test_cpu_hosts_bound_the_prediction_and_the_simulation(schedule: str) -> None:
    # l0 | l1,l2 on 1 + 1 of 3 CPU ranks on 1 core: the host runs 30 + 60 ms of compute one at a time
    micro = 1 if schedule == "pipedream" else 2
    alone = evaluate(THREE, Cluster.flat(3), ["l0"], [1, 1], schedule, micro)
    shared = evaluate(THREE, replace(Cluster.flat(3), cores=1), ["l0"], [1, 1], schedule, micro)
    assert shared.predicted.host_bound_s == pytest.approx(0.090)
    assert shared.predicted.pipeline_s == pytest.approx(alone.predicted.time_per_minibatch_s)
    assert shared.predicted.time_per_minibatch_s == pytest.approx(max(0.090, alone.predicted.pipeline_s or 0))
    assert simulate(shared, THREE).time_per_minibatch_s == pytest.approx(
        max(0.090, simulate(alone, THREE).time_per_minibatch_s)
    )
    roomy = evaluate(THREE, replace(Cluster.flat(3), cores=2), ["l0"], [1, 1], schedule, micro)
    assert roomy.predicted.host_bound_s == pytest.approx(0.045)
    assert roomy.predicted.time_per_minibatch_s == pytest.approx(alone.predicted.time_per_minibatch_s)
    assert roomy.gap == alone.gap  # the solver's bound is on the pipeline's own time


def _with_casts(profile: Profile, casts: dict[str, int]) -> Profile:
    return replace(profile, nodes=tuple(replace(n, cast_bytes=casts.get(n.id, 0)) for n in profile.nodes))


# THREE measured under autocast: l0 and l2 keep a low-precision copy of their weights per forward
CAST = _with_casts(THREE, {"l0": 500_000, "l2": 1_000_000})


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b", "gpipe"])
def test_weight_copies_cost_one_per_forward_in_flight(schedule: str) -> None:
    from partitioner.optimizer.pricing.simulate import simulate

    m = 1 if schedule == "pipedream" else 4
    plain = evaluate(THREE, Cluster.flat(3), ["l0"], [2, 1], schedule, m)
    cast = evaluate(CAST, Cluster.flat(3), ["l0"], [2, 1], schedule, m)
    # master weights, gradients and optimizer state stay what the float32 parameters cost; each
    # forward in flight adds its copy: pipedream holds 2 minibatches on a stage-0 replica, 1f1b
    # min(2, 4) = 2 microbatches over 2 replicas, gpipe all 4 over 2; stage 1 one, one and, at
    # gpipe's peak, three (beside the gradient its second backward adds; four in its first).
    held = {"pipedream": (2, 1), "1f1b": (1, 1), "gpipe": (2, 3)}[schedule]
    extra = [c.memory_bytes - p.memory_bytes for c, p in zip(cast.stages, plain.stages, strict=True)]
    assert extra == [held[0] * 500_000, held[1] * 1_000_000]
    assert simulate(cast, CAST).peak_memory_bytes == tuple(s.memory_bytes for s in cast.stages)


@pytest.mark.parametrize(("schedule", "copies"), [("1f1b", 1), ("gpipe", 3)])
def test_weight_copies_count_against_the_memory_limit(schedule: str, copies: int) -> None:
    from partitioner.errors import InfeasibleError

    one = make_profile([(10, 20, 0, 1_000_000)], [])
    cast = _with_casts(one, {"l0": 100_000})
    # one device, 4 microbatches: 2P (weights + gradients) + P (a later microbatch's gradient beside
    # the sum) + a copy per microbatch in flight then (gpipe: 3, the first one's freed)
    need = 3 * 1_000_000 + copies * 100_000
    assert at_microbatches(at_microbatches(cast, 4), 4) == at_microbatches(cast, 4)
    assert at_microbatches(one, 4) is one
    assert solve(cast, Cluster.flat(1, memory_bytes=need), schedule, 4).stages[0].memory_bytes == need
    with pytest.raises(InfeasibleError):
        solve(cast, Cluster.flat(1, memory_bytes=need - 1), schedule, 4)
    solve(one, Cluster.flat(1, memory_bytes=need - 1), schedule, 4)


def test_1f1b_holds_what_its_depth_says_at_every_position() -> None:
    """``held_from_end``: a 1f1b stage's items in flight (and those beside a later backward's
    gradient) depend on its replicas and the stages from it to the end alone, so the exact search's
    table by depth (``held_by_depth``) is every position's, whatever the other stages' replicas."""
    from partitioner.optimizer.pricing.schedules import MODELS, held_by_depth

    sched = MODELS["1f1b"]
    assert sched.held_from_end and not MODELS["gpipe"].held_from_end and not MODELS["zb1p"].held_from_end
    for m in (1, 2, 3, 4, 8):
        held, later = held_by_depth("1f1b", 6, 4, m)
        for stages in range(1, 7):
            for position in range(stages):
                for r in range(1, 5):
                    replicas = [3 if i % 2 else 2 for i in range(stages)]
                    replicas[position] = r
                    d = stages - position
                    assert sched.held(position, replicas, m, 1) == held[d - 1][r - 1]
                    assert sched.later(position, replicas, m, 1) == later[d - 1][r - 1]
