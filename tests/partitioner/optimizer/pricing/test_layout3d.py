"""3D layouts' cost terms (docs/layout-3d.md) by hand, and the layout search against every layout."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.hardware.devices import load_device_model
from partitioner.optimizer.layouts import evaluate_layout, layouts, solve_layout, solve_layouts, splits
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.pricing.layout import Layout, copy_cluster, copy_profile, layout_plan
from partitioner.optimizer.pricing.sharding import per_byte, per_call_exposed, step_bytes, step_exposed
from partitioner.optimizer.pricing.tensor import degrees, ring_time, split_penalty, tensor_view
from partitioner.plan import Cluster, Level, Link

from ..conftest import make_profile


def _split_chain(layers: int = 4, t_max: int = 4) -> Profile:
    """A chain of equal layers, each tensor parallelism splits (3/4 of its parameters)."""
    base = make_profile([(10, 20, 1000, 4000)] * layers, [(i, i + 1) for i in range(layers - 1)])
    nodes = tuple(
        replace(n, tp_param_bytes=3000, tp_comm_bytes=2000, tp_max=t_max) if n.op != "input" else n
        for n in base.nodes
    )
    return replace(base, nodes=nodes)


def test_tensor_view_divides_the_split_part_and_adds_the_all_reduces() -> None:
    link = Link(1e6, 1e-3)
    node = _split_chain().nodes[1]
    split = tensor_view(_split_chain(), 2, link).nodes[1]
    wire = 2 * 0.5 * 2000 / 1e6  # all-reduce: 2 (t-1)/t of the bytes ...
    latency = 2 * 1 * 1e-3  # ... and 2 (t-1) latencies, once per call
    assert split.param_bytes == 1000 + 3000 // 2
    assert split.saved_bytes == node.saved_bytes // 2
    assert split.forward_ms == pytest.approx(10 / 2 + (wire + latency) * 1e3)
    assert split.backward_ms == pytest.approx(20 / 2 + (wire + latency) * 1e3)
    assert split.forward_fixed_ms == pytest.approx(latency * 1e3)
    assert tensor_view(_split_chain(), 1, link) == _split_chain()
    assert tensor_view(_split_chain(t_max=3), 2, link).nodes[1] == _split_chain(t_max=3).nodes[1]


def test_a_split_layers_largest_weight_is_its_rank_share_or_a_whole_one() -> None:
    """On one tensor rank a layer's largest weight (the most gradient it makes at once) is 1/t of a
    split one, unless the weights kept whole (``param_bytes - tp_param_bytes``) may be larger."""
    link = Link(1e6, 1e-3)

    def largest(biggest: int, t: int) -> int:
        chain = _split_chain()
        nodes = tuple(replace(n, largest_tensor_bytes=biggest) if n.param_bytes else n for n in chain.nodes)
        return tensor_view(replace(chain, nodes=nodes), t, link).nodes[1].largest_tensor_bytes

    assert largest(2000, 4) == 1000  # 1000 kept whole may hold a weight larger than 2000 / 4
    assert largest(3000, 2) == 1500  # the split weight's half
    assert largest(0, 2) == 0  # not measured: the layer's param_bytes bound it


def test_smaller_products_run_slower_on_the_h100_curve() -> None:
    h100 = load_device_model("h100")
    big = [2.0 * 4096 * 8192 * 8192]
    assert split_penalty(None, "bfloat16", big, 8) == 1.0
    expected = h100.matmul_rate("bfloat16", big[0]) / h100.matmul_rate("bfloat16", big[0] / 8)
    assert split_penalty(h100, "bfloat16", big, 8) == pytest.approx(expected)
    assert expected > 1.05


def test_degrees_divide_a_node_and_every_split_layer() -> None:
    assert degrees(_split_chain(t_max=4), 8) == (1, 2, 4)
    assert degrees(make_profile([(1, 1, 1, 1)], []), 8) == (1,)
    assert not splits(make_profile([(1, 1, 1, 1)], []), Cluster.flat(8))


@pytest.mark.parametrize(
    ("shard", "d", "bf16_adam", "fp32_adam"),
    [("none", 4, 8.0, 4.0), ("optimizer", 4, 2 + 6 / 4, 2 + 3 / 4), ("gradients", 4, 2 + 7 / 4, 2 + 4 / 4),
     ("full", 4, 2 + 7 / 4, 2 + 4 / 4)],
)  # fmt: skip
def test_bytes_per_weight_byte_follow_the_table(
    shard: str, d: int, bf16_adam: float, fp32_adam: float
) -> None:
    assert per_byte(shard, d, "adam", 2.0) == pytest.approx(bf16_adam)
    assert per_byte(shard, d, "adam", 0.0) == pytest.approx(fp32_adam)


def test_the_step_holds_fsdp2s_reduce_scatter_buffers() -> None:
    """fp32 Adam over 2 copies, per weight byte of the stage: the gathered W, the sharded W and S
    (1.5), the flat input G and its output G/2, gloo's copy of the input (CPU ranks), and under
    gradients and full the sharded gradient of the earlier microbatches: what the runtime's
    reduce-scatter was measured to hold (benchmarks/results/bench_3d_memory.md)."""
    assert step_bytes("optimizer", 2, "adam", 0.0, 1.0, copied=True) == pytest.approx(5.0)
    assert step_bytes("gradients", 2, "adam", 0.0, 1.0, copied=True) == pytest.approx(5.5)
    assert step_bytes("full", 2, "adam", 0.0, 1.0, copied=False) == pytest.approx(4.5)
    assert step_bytes("none", 2, "adam", 0.0, 1e6, copied=True) == pytest.approx(5e6)
    assert step_bytes("full", 1, "adam", 0.0, 1e6, copied=True) == 0.0


def test_fixed_cuts_are_priced_at_the_layout_with_the_step_as_a_floor() -> None:
    """evaluate_layout (bench_3d_memory's plans): two stages of two copies at ``gradients``, each
    stage's memory at least its step's reduce-scatter; pipedream refuses a shard level."""
    profile = _split_chain()
    cluster = Cluster((Level(4, 1e9),))
    cut = [profile.nodes[2].id]
    plan = evaluate_layout(profile, cluster, Layout(1, 2, "gradients"), cut, "1f1b", 2, "adam")
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    assert all(s.replicas == 2 and s.shard == "gradients" for s in plan.stages)
    for s in plan.stages:
        weight = sum(n.param_bytes for n in profile.nodes if n.id in s.nodes)
        assert s.memory_bytes >= step_bytes("gradients", 2, "adam", 0.0, weight, copied=False) > 0
    with pytest.raises(PlanError, match="does not run"):
        evaluate_layout(profile, cluster, Layout(1, 2, "full"), cut, "pipedream", 1, "adam")


def test_collectives_of_the_stage_unit_are_exposed() -> None:
    """The runtime shards a stage as one FSDP2 unit: its all-gather ends before its compute starts
    and its reduce-scatter starts after its backward, so nothing hides behind compute."""
    link = Link(1e6, latency=1e-3)
    units = [1e6, 1e6, 1e6]  # the stage's three weights
    stage = ring_time(3e6, 4, link)  # one gather or scatter of the stage's 3 MB over 4 copies
    assert step_exposed("none", units, 4, link) == pytest.approx(2 * stage)
    assert step_exposed("optimizer", units, 4, link) == pytest.approx(2 * stage)
    assert step_exposed("gradients", units, 4, link) == pytest.approx(stage)
    assert step_exposed("full", units, 4, link) == 0.0
    wire = ring_time(1e6, 4, Link(1e6))  # a node's share of a call, bytes only
    assert per_call_exposed("full", 1e6, 4, link) == pytest.approx((wire, 2 * wire))
    assert per_call_exposed("gradients", 1e6, 4, link) == pytest.approx((0.0, wire))
    assert per_call_exposed("optimizer", 1e6, 4, link) == (0.0, 0.0)
    assert step_exposed("none", units, 1, link) == 0.0


def test_a_layout_is_one_copys_pipeline_on_groups_plus_its_step() -> None:
    profile = _split_chain()
    cluster = Cluster((Level(4, 1e9), Level(2, 1e8)))
    layout = Layout(2, 2, "optimizer")
    assert copy_cluster(cluster, layout).levels == (Level(2, 1e8),)
    _, split = copy_profile(profile, cluster, layout, 2, "adam")
    all_reduce_ms = 2 * (1 / 2) * 2000 / 1e9 * 1e3  # (the tensor group's, on the innermost link)
    assert split.batch_size == 4
    assert split.nodes[1].forward_ms == pytest.approx((10 / 2 + all_reduce_ms) / 2)  # a copy runs half
    opts = SolveOptions("1f1b", 2, "adam", True)
    plan = solve_layout(profile, cluster, layout, opts, ("1f1b",), microbatches=4)
    assert [s.ranks for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)][: len(plan.stages)]
    assert all(s.tensor_parallel == 2 and s.replicas == 2 and s.shard == "optimizer" for s in plan.stages)
    step = plan.extra["layout"]["step_s"]
    assert step > 0
    assert plan.predicted.time_per_minibatch_s == pytest.approx(plan.extra["layout"]["copy_time_s"] + step)
    again = layout_plan(replace(plan, stages=plan.stages), split, cluster, layout)  # (idempotent ranks)
    assert again.gpus == plan.gpus


def test_the_search_finds_the_best_of_every_layout() -> None:
    """Ruling layouts out by their bound loses nothing: the search equals the best of all of them."""
    profile = _split_chain(layers=6)
    cluster = Cluster((Level(4, 1e8, 1e-4),), memory_bytes=60_000)
    opts = SolveOptions("1f1b", 1, "adam", True, recompute="auto")
    best = solve_layouts(profile, cluster, opts, ("1f1b", "gpipe"))
    assert best is not None
    each = []
    for layout in layouts(profile, cluster):
        try:
            plan = solve_layout(profile, cluster, layout, opts, ("1f1b", "gpipe"))
        except InfeasibleError:  # (a layout that fits nowhere)
            continue
        each.append(plan.predicted.time_per_minibatch_s)
    assert len(each) > 3
    assert best.plan.predicted.time_per_minibatch_s == pytest.approx(min(each))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_fill_and_drain_bound_holds_on_unequal_stages(schedule: str) -> None:
    """The search's ruling-out bound is below the simulated price of random plans of random chains."""
    import random

    from partitioner.optimizer import evaluate
    from partitioner.optimizer.layouts import _bubble

    rng = random.Random(7)
    for _ in range(12):
        layers = rng.randint(3, 8)
        costs = [(rng.randint(1, 9), rng.randint(1, 18), rng.randint(1, 99), 10) for _ in range(layers)]
        profile = make_profile(costs, [(i, i + 1) for i in range(layers - 1)])
        p, m = rng.randint(2, layers), rng.choice([1, 2, 4, 8])
        cuts = sorted(rng.sample(range(layers - 1), p - 1))
        plan = evaluate(profile, Cluster.flat(p, 1e6), [f"l{c}" for c in cuts], [1] * p, schedule, m)
        work = sum(f + b for f, b, _, _ in costs) / 1e3
        assert plan.predicted.time_per_minibatch_s >= work / p * _bubble(schedule, m, p) * (1 - 1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb1p", "interleaved", "zbv"])
def test_the_searchs_lower_bound_holds_under_every_flushing_schedule(schedule: str) -> None:
    """``_least_time`` (spread work, the largest node, one microbatch's way) is below the price of
    random plans of random chains with random microbatch counts, messages and recomputation."""
    import random

    from partitioner.optimizer import evaluate
    from partitioner.optimizer.layouts import _least_time
    from partitioner.optimizer.pricing.schedules import model

    rng = random.Random(11)
    sched = model(schedule)
    v = 2 if sched.laid_out else 1
    asked = 2 if sched.virtual_stages is None else 1  # (interleaved's stages per GPU; zbv's V is 2)
    for _ in range(10):
        p = rng.randint(2, 4)
        m = p * rng.choice([2, 4]) if sched.laid_out else rng.choice([1, 2, 4, 8, 16])
        layers = rng.randint(p * v, p * v + 4)
        costs = [(rng.randint(1, 9), rng.randint(1, 18), rng.randint(1, 999), 10) for _ in range(layers)]
        profile = make_profile(costs, [(i, i + 1) for i in range(layers - 1)], batch_size=16)
        cuts = sorted(rng.sample(range(layers - 1), p * v - 1))
        try:
            plan = evaluate(profile, Cluster.flat(p, 1e6), [f"l{c}" for c in cuts], [1] * (p * v), schedule,
                            m, recompute=rng.choice(["none", "all"]), virtual_stages=asked)  # fmt: skip
        except PlanError:  # (microbatches the laid-out order cannot play)
            continue
        assert plan.predicted.time_per_minibatch_s >= _least_time(profile, p, m, schedule) * (1 - 1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "interleaved"])
def test_a_layouts_simulation_is_its_copys(schedule: str) -> None:
    """partition shows a 3D plan's simulation: one copy's pipeline, laid out as its schedule lays it."""
    from partitioner.optimizer.layouts import simulate_layout

    profile = _split_chain(layers=8)
    cluster = Cluster((Level(4, 1e8, 1e-4), Level(2, 1e7)))
    layout = Layout(2, 2, "optimizer") if schedule == "1f1b" else Layout(2, 1)  # (what the runtime runs)
    plan = solve_layout(profile, cluster, layout, SolveOptions("1f1b", 1, "adam", True), (schedule,),
                        microbatches=8)  # fmt: skip
    sim = simulate_layout(plan, profile)
    assert sim.events and {e.stage for e in sim.events} == set(range(len(plan.stages)))
    assert sim.window_s == pytest.approx(plan.extra["layout"]["copy_time_s"], rel=1e-9)
    assert sorted({r for s in plan.stages for r in s.ranks}) == list(range(plan.gpus))


def test_no_layout_is_returned_that_is_slower_than_the_2d_plan() -> None:
    profile = _split_chain(layers=6)
    cluster = Cluster((Level(4, 1e8, 1e-4),), memory_bytes=60_000)
    opts = SolveOptions("1f1b", 1, "adam", True, recompute="auto")
    best = solve_layouts(profile, cluster, opts, ("1f1b",))
    assert best is not None
    time = best.plan.predicted.time_per_minibatch_s
    assert solve_layouts(profile, cluster, opts, ("1f1b",), incumbent=time) is None
    assert solve_layouts(profile, cluster, opts, ("1f1b",), incumbent=time * 1.01) is not None


def test_only_layouts_the_runtime_runs_are_searched() -> None:
    """docs/layout-3d.md: every layout under every flushing schedule (shard levels under a split
    backward, copies under a laid-out one), none under pipedream."""
    from partitioner.optimizer.layouts import runs

    assert runs(Layout(2, 2, "optimizer"), "1f1b") and runs(Layout(2, 2, "full"), "gpipe")
    assert runs(Layout(2, 2, "optimizer"), "zb1p") and runs(Layout(1, 2, "full"), "zbv")
    assert runs(Layout(2, 2), "zbv") and runs(Layout(1, 2), "interleaved") and runs(Layout(4, 1), "zbv")
    assert not runs(Layout(2, 1), "pipedream") and not runs(Layout(1, 2, "optimizer"), "pipedream")
    profile = _split_chain(layers=8)
    cluster = Cluster((Level(4, 1e8, 1e-4), Level(2, 1e7)))
    with pytest.raises(PlanError, match="does not run under pipedream"):
        solve_layout(
            profile, cluster, Layout(2, 2, "optimizer"), SolveOptions("1f1b", 1, "adam", True), ("pipedream",)
        )
