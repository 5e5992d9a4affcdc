"""The 3D search: one layout (``t`` tensor ranks x ``d`` copies, a shard level) for every stage of
the plan, chosen jointly with the cuts, the schedule, the microbatches and recomputation.

For each layout the exact 2D search of one device per stage runs on its copy view
(:mod:`partitioner.optimizer.pricing.layout`), at every schedule and microbatch count; the
layouts are searched in the order of a lower bound on their time (:func:`_least_time`: a copy's
work spread over its stages with 1f1b's and gpipe's least fill and drain, its largest node, one
microbatch's way through every stage) and a layout whose bound is no better than the best plan
found, or that cannot fit by a bound (:func:`_fits_nowhere`: its weights and one microbatch of
activations over the stages exceed the memory), is ruled out before it is searched; a layout's
copy view is made once per microbatch count. Exact under the model within each layout but for
the step, which the search does not minimise: the plan keeps the search's bound, so its gap says
how far it can be. ``t = 1`` with ``shard = none`` is today's 2D search, which also lets each
stage have its own replicas (docs/optimizer-search.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from partitioner.errors import InfeasibleError, PlanError
from partitioner.graph import Profile
from partitioner.hardware.devices import estimated_device
from partitioner.optimizer.auto import AutoChoice
from partitioner.optimizer.options import SolveOptions
from partitioner.optimizer.planner import evaluate, solve_with
from partitioner.optimizer.pricing.layout import Layout, copy_cluster, copy_memory, copy_profile, layout_plan
from partitioner.optimizer.pricing.memory import master_ratio, persistent_factor
from partitioner.optimizer.pricing.schedules import MODELS, model, priced_profile
from partitioner.optimizer.pricing.simulate import Simulation, simulate
from partitioner.optimizer.pricing.stage import W_SHARE
from partitioner.optimizer.pricing.tensor import PRODUCTS_KEY, TOKENS_KEY, degrees
from partitioner.plan import SHARD_LEVELS, Cluster, Plan
from runtime.schedule import get_schedule

__all__ = [
    "LAYOUT_SCHEDULES",
    "LayoutChoice",
    "copy_of",
    "evaluate_layout",
    "hand_layouts",
    "layout_name",
    "layouts",
    "model_flops_per_sample",
    "runs",
    "simulate_layout",
    "solve_layout",
    "solve_layouts",
    "splits",
    "tokens_per_device",
    "utilisation",
]

#: schedules a 3D layout runs: every flushing one (pipedream's weight stashing takes t = 1 and no
#: sharding: docs/layout-3d.md).
LAYOUT_SCHEDULES: tuple[str, ...] = tuple(name for name, m in MODELS.items() if not m.asynchronous)


def runs(layout: Layout, schedule: str) -> bool:
    """Whether the runtime runs ``layout`` under ``schedule`` (docs/layout-3d.md, what it refuses):
    every flushing schedule runs every layout (a shard level under a split backward reduces once,
    after the last W; interleaved's and zbv's copies are laid-out pipelines of their own), pipedream
    none (its weight stashing takes t = 1 and no sharding)."""
    return not get_schedule(schedule).stashes


@dataclass(frozen=True)
class LayoutChoice:
    """The fastest 3D plan and, per layout tried, its best time (None: nothing fits; absent:
    ruled out by its bound)."""

    plan: Plan
    times: dict[str, float | None]


def check_tensor(profile: Profile, cluster: Cluster, tensor: int) -> None:
    """Refuse a tensor-parallel degree that does not divide a node's devices or a split layer."""
    inner = cluster.levels[0].devices
    if inner % tensor or tensor not in degrees(profile, inner):
        raise PlanError(
            f"--tensor-parallel {tensor} must divide a node's {inner} devices and every split layer's "
            f"degree (the profile allows {', '.join(map(str, degrees(profile, inner)))}){_not_split(profile)}"
        )


def _not_split(profile: Profile) -> str:
    """Why layers the model's own tensor plan names are not split, from the profile's notes
    (``partitioner.profiler.tensor_plan.UNKNOWN_KEY``, ``tensor_check.WHOLE_KEY``), or ''."""
    unknown = profile.extra.get("tensor_parallel_unknown_styles") or {}
    whole = profile.extra.get("tensor_parallel_whole") or {}
    parts = []
    if unknown:
        styles = sorted(set(unknown.values()))
        parts.append(
            f"its base_model_tp_plan's styles {', '.join(styles)} are not understood, so "
            f"{', '.join(unknown)} stay whole"
        )
    if whole:
        count = f"{len(whole)} layer{'s' if len(whole) != 1 else ''}"
        parts.append(f"{count} stay whole because their traced code breaks split ({', '.join(whole)})")
    return "; " + "; ".join(parts) if parts else ""


def layouts(
    profile: Profile, cluster: Cluster, tensor: int | None = None, shard: str | None = None
) -> list[Layout]:
    """Every layout of the cluster's devices: ``t`` among :func:`~.tensor.degrees` (or ``tensor``),
    ``d`` with ``t x d`` tiling the levels and splitting the batch, each shard level (or
    ``shard``) where ``d >= 2``; not ``t = 1`` unsharded (the 2D search's)."""
    inner = cluster.levels[0].devices
    ts = (tensor,) if tensor else degrees(profile, inner)
    if tensor:
        check_tensor(profile, cluster, tensor)
    shards = (shard,) if shard else SHARD_LEVELS
    batch = profile.batch_size or 0
    found = []
    for t in ts:
        for d in range(1, cluster.gpus // t + 1):
            if cluster.gpus % (t * d) or (batch and batch % d) or not _tiles(cluster, t * d):
                continue
            for s in shards:
                if (s != "none" and d < 2) or (t == 1 and s == "none" and not tensor):
                    continue
                found.append(Layout(t, d, s))
    return found


def _tiles(cluster: Cluster, group: int) -> bool:
    for level in cluster.levels:
        if group >= level.devices:
            if group % level.devices:
                return False
            group //= level.devices
        else:
            return level.devices % group == 0
    return group == 1


def _counts(batch: int, devices: int, asked: int | None) -> tuple[int, ...]:
    """Microbatches per copy: ``asked``, or the powers of two that split its batch, up to 4 a device."""
    if asked:
        return (asked,)
    top = min(batch, 4 * max(devices, 1))
    return tuple(1 << k for k in range(top.bit_length()) if (1 << k) <= top and batch % (1 << k) == 0)


@dataclass(frozen=True)
class _Candidate:
    """One search to run: a layout at ``m`` microbatches a copy under ``schedule``, and its bound;
    the copy view it searches (made once per layout and count, shared by its schedules)."""

    bound: float
    layout: Layout
    m: int
    schedule: str
    view: Profile = field(compare=False, repr=False)
    split: Profile = field(compare=False, repr=False)
    wide: Cluster = field(compare=False, repr=False)


def _bubble(schedule: str, m: int, stages: int) -> float:
    """The least a schedule's fill and drain multiply a copy's evenly spread work by: under 1f1b
    and gpipe stage ``s`` cannot start before one microbatch's forwards through the stages before
    it nor end before their backwards, so ``T >= M t_s + sum_{k<s} t_k``, whose least maximum
    over stage times adding up to ``W / M`` is ``W / (M (1 - (1 - 1/M)^p))``; 1 for the others."""
    if not model(schedule).sync_sum or stages < 2:  # (1f1b's and gpipe's synchronous sum)
        return 1.0
    return stages / (m * (1.0 - (1.0 - 1.0 / m) ** stages))


def _least_time(view: Profile, stages: int, m: int, schedule: str) -> float:
    """A lower bound on every plan of one copy (``stages`` devices, ``m`` microbatches) on its
    priced view: its work spread evenly over the stages that can hold any (no more than its nodes:
    the fill and drain of :func:`_bubble` only grow with fewer); its largest node's work, which one
    device runs for every microbatch; and one microbatch's way through every stage, forwards then
    backwards (:func:`_path`), which a flushing schedule's period holds (the first stage's next
    forward waits for its step, the step for that microbatch's backward). Recomputation, messages,
    actions and the step only add."""
    priced = priced_profile(view, schedule, m)
    work = [n.forward_ms + n.backward_ms for n in priced.nodes if n.op != "input"]
    used = max(1, min(stages, len(work)))
    spread = sum(work) / used * _bubble(schedule, m, used)
    return max(spread, max(work, default=0.0), _path(priced, schedule) / m) / 1e3


def _path(priced: Profile, schedule: str) -> float:
    """Milliseconds of one minibatch's forwards and of its backwards that lie on one microbatch's
    way back (under a split backward a stage's B: its backward less the W it defers, ``W_SHARE``
    of it where B and W were not timed apart; the first stage's W ends the way, a bound)."""
    split = get_schedule(schedule).split_backward
    total = 0.0
    for n in priced.nodes:
        if n.op == "input":
            continue
        deferred = (n.split_ms[1] if n.split_ms else n.backward_ms * W_SHARE) if split else 0.0
        total += n.forward_ms + max(0.0, n.backward_ms - deferred)
    return total


def _fits_nowhere(view: Profile, wide: Cluster, stages: int, m: int, optimizer: str, laid_out: bool) -> bool:
    """Whether no plan of the copy view can fit, by a bound: every stage holds its weights'
    persistent bytes and, recomputing or not, at least one microbatch of its saved bytes while its
    backward runs (``peak_bytes``), so their sum over the stages is at most ``stages`` memories (a
    laid-out device's stages share their peak: its weights only)."""
    if wide.memory_bytes is None:
        return False
    per_byte = persistent_factor(optimizer, master_ratio(view.dtype))
    held = sum(n.param_bytes for n in view.nodes) * per_byte
    if not laid_out:
        held += sum(n.saved_bytes for n in view.nodes) / m
    return held / stages > wide.memory_bytes + 1.0


def _candidates(
    profile: Profile, cluster: Cluster, layout: Layout, optimizer: str, schedules: Sequence[str],
    asked: int | None,
) -> list[_Candidate]:  # fmt: skip
    """The searches of ``layout`` that a bound does not rule out, each with a lower bound on its
    time (:func:`_least_time`). Ruled out: where no plan can fit (:func:`_fits_nowhere`), and a
    laid-out schedule with more stages than the copy has layers (its search has no plan there)."""
    stages = cluster.gpus // layout.group
    batch = (profile.batch_size or layout.copies) // layout.copies
    found = []
    for m in _counts(batch, stages, asked):
        try:
            view, split = copy_profile(profile, cluster, layout, m, optimizer)
            wide = copy_memory(cluster, split, layout)
        except PlanError:
            continue
        for schedule in schedules:
            sched = model(schedule)
            if sched.asynchronous or not runs(layout, schedule):
                continue
            few = min(sched.virtual(v) for v in sched.auto_virtual) * stages > len(view.layers)
            if _fits_nowhere(view, wide, stages, m, optimizer, sched.laid_out) or (sched.laid_out and few):
                continue
            bound = _least_time(view, stages, m, schedule)
            found.append(_Candidate(bound, layout, m, schedule, view, split, wide))
    return found


def _searched(profile: Profile, cluster: Cluster, c: _Candidate, opts: SolveOptions) -> Plan | None:
    """The best plan of one candidate (over its schedule's virtual stage counts), None: none fits."""
    best: Plan | None = None
    for virtual in model(c.schedule).auto_virtual:
        at = replace(opts, schedule=c.schedule, microbatches=c.m, virtual_stages=virtual, straight=True)
        try:
            copy = solve_with(c.view, c.wide, at.checked(c.view))
        except (InfeasibleError, PlanError):
            continue
        plan = layout_plan(copy, c.split, cluster, c.layout)
        if not _fits(plan, cluster):  # (the step's reduce-scatter can hold more than the backward)
            continue
        if best is None or _time(plan) < _time(best):
            best = plan
    return best


def _fits(plan: Plan, cluster: Cluster) -> bool:
    limit = cluster.memory_bytes
    return limit is None or all(s.memory_bytes <= limit for s in plan.stages)


def _time(plan: Plan) -> float:
    return plan.predicted.time_per_minibatch_s


def solve_layout(
    profile: Profile,
    cluster: Cluster,
    layout: Layout,
    opts: SolveOptions,
    schedules: Sequence[str] = LAYOUT_SCHEDULES,
    microbatches: int | None = None,
) -> Plan:
    """The fastest plan of ``layout`` over ``schedules`` and microbatch counts per copy
    (``microbatches``: the whole minibatch's, split over the copies).

    Raises:
        PlanError: the runtime runs ``layout`` under none of ``schedules`` (:func:`runs`).
        InfeasibleError: nothing fits.
    """
    if not any(runs(layout, s) for s in schedules):
        raise PlanError(
            f"layout {layout.describe()} does not run under {', '.join(schedules)}: a 3D layout needs a "
            "flushing schedule (pipedream's weight stashing takes t = 1 and no sharding)"
        )
    choice = _search(profile, cluster, [layout], opts, schedules, microbatches, float("inf"))
    if choice is None:
        raise InfeasibleError(f"no plan of layout {layout.describe()} fits")
    return choice.plan


def solve_layouts(
    profile: Profile,
    cluster: Cluster,
    opts: SolveOptions,
    schedules: Sequence[str] = LAYOUT_SCHEDULES,
    tensor: int | None = None,
    shard: str | None = None,
    microbatches: int | None = None,
    incumbent: float = float("inf"),
) -> LayoutChoice | None:
    """The fastest 3D plan over :func:`layouts` (module docstring); None: no layout beats
    ``incumbent`` (the 2D plan's time) or fits."""
    found = layouts(profile, cluster, tensor, shard)
    return _search(profile, cluster, found, opts, schedules, microbatches, incumbent)


def _search(
    profile: Profile, cluster: Cluster, found: Sequence[Layout], opts: SolveOptions,
    schedules: Sequence[str], microbatches: int | None, incumbent: float,
) -> LayoutChoice | None:  # fmt: skip
    """Every candidate of ``found`` in the order of its bound, until the bound reaches the best."""
    start = time.perf_counter()
    ranked = []
    for layout in found:
        asked = microbatches // layout.copies if microbatches and microbatches % layout.copies == 0 else None
        ranked += _candidates(profile, cluster, layout, opts.optimizer, schedules, asked)
    ranked.sort(key=lambda c: c.bound)
    best: Plan | None = None
    times: dict[str, float | None] = {}
    searched, spent = 0, dict[str, float]()
    for c in ranked:
        if c.bound >= min(incumbent, _time(best) if best else incumbent):
            break
        searched += 1
        began = time.perf_counter()
        plan = _searched(profile, cluster, c, opts)
        spent[c.schedule] = spent.get(c.schedule, 0.0) + time.perf_counter() - began
        name = c.layout.describe()
        if plan is None:
            times.setdefault(name, None)
            continue
        if times.get(name) is None or _time(plan) < (times[name] or float("inf")):
            times[name] = _time(plan)
        if best is None or _time(plan) < _time(best):
            best = plan
    if best is None or _time(best) >= incumbent:  # (the 2D plan is at least as fast)
        return None
    info = replace(best.solver, solve_time_s=time.perf_counter() - start)
    extra = {
        **best.extra,
        "layouts_searched": times,
        "searches": searched,
        "candidates": len(ranked),
        "search_s": {k: round(v, 2) for k, v in spent.items()},
    }
    return LayoutChoice(replace(best, solver=info, extra=extra), times)


def evaluate_layout(
    profile: Profile,
    cluster: Cluster,
    layout: Layout,
    cuts: Sequence[str],
    schedule: str,
    microbatches: int,
    optimizer: str,
    recompute: str = "none",
) -> Plan:
    """Price a fixed 3D plan: the stages ``cuts`` make (the last layer of every stage but the
    last), every one at ``layout``, ``microbatches`` per copy, priced as the search prices a
    layout (one copy's pipeline on its copy view, then :func:`~.pricing.layout.layout_plan`).

    Raises:
        PlanError: the runtime does not run ``layout`` under ``schedule``, the batch does not split,
            or the cuts are not layers of the profile.
    """
    if not runs(layout, schedule) or model(schedule).asynchronous:
        raise PlanError(f"layout {layout.describe()} does not run under --schedule {schedule}")
    view, split = copy_profile(profile, cluster, layout, microbatches, optimizer)
    wide = copy_memory(cluster, split, layout)
    stages = len(cuts) + 1
    if stages * layout.group > cluster.gpus:
        raise PlanError(f"{stages} stages of {layout.describe()} need {stages * layout.group} GPUs")
    copy = evaluate(view, wide, cuts, [1] * stages, schedule, microbatches, optimizer, True, recompute)
    return layout_plan(copy, split, cluster, layout)


def copy_of(plan: Plan, profile: Profile) -> tuple[Plan, Profile]:
    """One copy's 2D plan and its copy view, from a 3D plan (what :func:`simulate_layout` plays)."""
    info = plan.extra["layout"]
    layout = Layout(int(info["tensor_parallel"]), int(info["data_parallel"]), str(info["shard"]))
    m = plan.microbatches // layout.copies
    view, _ = copy_profile(profile, plan.cluster, layout, m, plan.optimizer)
    group = layout.group  # (a laid-out schedule keeps several stages on one group of ranks)
    stages = tuple(
        replace(s, replicas=1, tensor_parallel=1, shard="none", ranks=(s.ranks[0] // group,),
                compute_s=s.compute_s / layout.copies)  # (a copy's own share: what its durations are)
        for s in plan.stages
    )  # fmt: skip
    gpus = len({s.ranks[0] for s in stages})
    copy = replace(plan, gpus=gpus, cluster=copy_cluster(plan.cluster, layout), stages=stages,
                   microbatches=m, batch_size=view.batch_size)  # fmt: skip
    return copy, view


def simulate_layout(plan: Plan, profile: Profile) -> Simulation:
    """The simulation of a plan: a 3D plan's is one copy's pipeline (its step is in the plan's time)."""
    if "layout" not in plan.extra:
        return simulate(plan, profile)
    copy, view = copy_of(plan, profile)
    return simulate(copy, priced_profile(view, copy.schedule, copy.microbatches))


def splits(profile: Profile, cluster: Cluster) -> bool:
    """Whether tensor parallelism can split any node of ``profile`` on ``cluster``'s nodes: where it
    cannot, ``--schedule auto`` plans as before (2D problems keep their plans)."""
    return degrees(profile, cluster.levels[0].devices) != (1,)


def hand_layouts(
    profile: Profile, cluster: Cluster, opts: SolveOptions, choice: AutoChoice | None
) -> dict[str, Plan | None]:
    """The layouts a user would try by hand, each priced by the same model (None: it does not
    fit): Megatron's (the largest tensor degree, the optimizer state sharded), torchtitan's (FSDP,
    everything sharded, with the largest tensor degree; both unsharded where that degree leaves
    fewer than two copies, as their users would run them), and today's pipeline x replicas (``auto``'s
    2D choice). Each searches the rest (cuts, copies, schedule, microbatches) as the 3D search does."""
    top = max(degrees(profile, cluster.levels[0].devices))
    rows: tuple[tuple[str, str], ...] = (
        (f"Megatron TP{top} zero1", "optimizer"),
        (f"torchtitan FSDP TP{top}", "full"),
    )
    if cluster.gpus // top < 2:  # no two copies to shard over: both tools' users run plain TP
        rows = ((f"Megatron, torchtitan TP{top}", "none"),) if top > 1 else ()
    out: dict[str, Plan | None] = {}
    for name, shard in rows:
        try:
            found = solve_layouts(profile, cluster, opts, tensor=top if top > 1 else None, shard=shard)
        except PlanError:
            found = None
        out[name] = found.plan if found else None
    if choice is not None:
        out["pipeline x replicas"] = choice.plan
    return out


def model_flops_per_sample(profile: Profile) -> float | None:
    """Training FLOPs of one sample as model FLOP utilisation counts them: three times the forward's
    split products (decoder layers: projections and attention) and 6 per token per parameter of the
    other linear layers (the head); None without the products (measured profiles)."""
    products = profile.extra.get(PRODUCTS_KEY)
    tokens = profile.extra.get(TOKENS_KEY)
    if not products or not tokens:
        return None
    linear = sum(n.param_bytes for n in profile.nodes if n.target == "Linear" and not n.tp_max)
    elem = 2 if profile.dtype in ("bfloat16", "float16") else 4
    return 3.0 * sum(sum(p) for p in products.values()) + 6.0 * float(tokens) * linear / elem


def layout_name(plan: Plan) -> str:
    """``TP4 x PP8 x DP4 zero1`` for a 3D plan (zero1, zero2, fsdp: the shard levels optimizer,
    gradients, full), ``PP21 x DP 3,4`` for a 2D one (its replicas)."""
    info = plan.extra.get("layout")
    if info:
        shard = {"none": "", "optimizer": " zero1", "gradients": " zero2", "full": " fsdp"}[info["shard"]]
        return f"TP{info['tensor_parallel']} x PP{len(plan.stages)} x DP{info['data_parallel']}{shard}"
    widths = sorted({s.replicas for s in plan.stages})
    return f"PP{len(plan.stages)} x DP " + ",".join(str(w) for w in widths)


def utilisation(plan: Plan, profile: Profile) -> float | None:
    """Model FLOP utilisation: :func:`model_flops_per_sample` at the plan's samples per second over
    the devices' dense peak in the profile's dtype (None: no device model or no FLOP count)."""
    flops = model_flops_per_sample(profile)
    device = estimated_device(profile)
    rate = plan.predicted.throughput_samples_per_s
    if flops is None or device is None or not rate:
        return None
    return flops * rate / (plan.gpus * device.peak(profile.dtype))


def tokens_per_device(plan: Plan, profile: Profile) -> float | None:
    """Tokens a second a device trains (None: the profile does not say its tokens)."""
    tokens = profile.extra.get(TOKENS_KEY)
    rate = plan.predicted.throughput_samples_per_s
    return float(tokens) * rate / plan.gpus if tokens and rate else None
