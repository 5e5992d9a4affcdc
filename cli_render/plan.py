"""``pipeplan partition``'s output: the stage table, the prediction, the Gantt chart, ``auto``'s
comparison, ``--explain``'s baselines and the notes on microbatches."""

from __future__ import annotations

from typing import Any

from cli_render.common import console, layer_range, new_table, num, plural, short
from partitioner.partition import Partitioned, microbatch_note
from runtime.schedule import get_schedule

__all__ = ["auto_table", "explain_table", "layout_table", "plan_summary", "plan_table", "print_partition"]

HAND_LAYOUTS = ("pipeline x replicas",)
"""--explain's hand layouts besides the TP/FSDP ones (``layouts.hand_layouts``)."""
HAND_PREFIX = ("Megatron", "torchtitan")


def print_partition(done: Partitioned, optimizer: str, asked: int | None) -> None:
    """Everything ``partition`` prints after writing ``done`` (``asked``: --microbatches, if given)."""
    from partitioner.optimizer.pricing.simulate import gantt

    plan, profile, sim, out = done.plan, done.profile, done.simulation, console()
    out.print(plan_table(plan, profile))
    out.print(plan_summary(plan, sim, profile))
    charged = profile.extra.get("update_charged")
    if charged:
        whole = sum(n.param_bytes for n in profile.nodes) * charged["s_per_byte"] * 1e3
        out.print(
            f"stage compute includes the {optimizer} update of its weights (the profile measured "
            f"{whole:.2f} ms for the whole model; --optimizer to plan for another)"
        )
    first = [e.end_s for e in sim.events if e.stage == 0 and e.kind == "B"]
    until = first[min(2, len(first) - 1)] if get_schedule(plan.schedule).stashes and first else None
    out.print("\n".join(gantt(sim, width=60, until_s=until)), highlight=False, markup=False)
    span = max((e.end_s for e in sim.events), default=0.0)
    bound = plan.predicted.host_bound_s or 0.0  # (a host-bound plan's time is the host's, not the period)
    if until is None and sim.window_s > bound and span > sim.window_s * 1.01:
        out.print(
            f"the timeline is one minibatch ({span * 1e3:.3f} ms); a rank starts the next once it has "
            f"stepped, so in the steady state a minibatch takes {sim.window_s * 1e3:.3f} ms",
            highlight=False,
        )
    if done.choice is not None:
        out.print(auto_table(done.choice, done.cluster.gpus, asked))
    if done.alternatives is not None:
        hand = {k: v for k, v in done.alternatives.items() if k in HAND_LAYOUTS or k.startswith(HAND_PREFIX)}
        if hand:
            out.print(layout_table(plan, hand, profile))
        rest = {k: v for k, v in done.alternatives.items() if k not in hand}
        if rest or not hand:
            out.print(explain_table(plan, rest, done.recompute))
    rounded = plan.extra.get("microbatches_asked")
    if rounded:
        out.print(
            f"[yellow]note:[/yellow] {plan.microbatches} microbatches instead of {rounded}: the synchronous "
            "schedules give a stage's replicas microbatches round-robin: each replica count divides it",
        )
    whole = profile.extra.get("tensor_parallel_whole")  # (partitioner.profiler.tensor_check.WHOLE_KEY)
    if whole and any(s.tensor_parallel > 1 for s in plan.stages):
        why = next(iter(whole.values()))
        out.print(
            f"[yellow]note:[/yellow] tensor parallelism keeps {plural(len(whole), 'layer')} whole, "
            f"replicated in each tensor group ({', '.join(whole)}): their traced code breaks split ({why})",
            highlight=False,
        )
    unknown = profile.extra.get("tensor_parallel_unknown_styles")  # (tensor_plan.UNKNOWN_KEY)
    if unknown and any(s.tensor_parallel > 1 for s in plan.stages):
        out.print(
            f"[yellow]note:[/yellow] tensor parallelism keeps {', '.join(unknown)} whole: their "
            f"base_model_tp_plan styles ({', '.join(sorted(set(unknown.values())))}) are not understood",
            highlight=False,
        )
    note = microbatch_note(profile, plan)
    if note:
        out.print(f"[yellow]note:[/yellow] {note}")
    kept = ", ".join(f"{name}/" for name in done.kept_runs)
    kept = f"; the replaced plan's runs are kept in {kept}" if kept else ""
    out.print(f"wrote {done.out_dir}/plan.json and mp_conf.json{kept}", soft_wrap=True)


def plan_table(plan: Any, profile: Any) -> Any:
    """The stage table; where the stages' layer ranges would make it wider than 80 columns, the ranges
    follow the table one per line and the table counts the layers."""
    from rich.console import Group
    from rich.measure import Measurement
    from rich.text import Text

    from partitioner.optimizer.pricing.price import gib

    names = {n.id: n.name for n in profile.nodes}
    slowest = max((s.compute_s / s.replicas + s.comm_s for s in plan.stages), default=1.0) or 1.0
    again = any(s.recompute for s in plan.stages)  # (a column only where some stage recomputes)
    cols = (
        "stage",
        "layers",
        "ranks",
        "compute\nms",
        "comm\nms",
        "memory",
        *(("re-\ncompute",) if again else ()),
        "util",
    )
    title = f"{plan.model}: {len(plan.stages)} stages on {devices(plan.gpus, profile)} ({plan.schedule})"
    tensor = max(s.tensor_parallel for s in plan.stages)
    if len(plan.stages) == 1 and plan.gpus > 1:  # one stage on every device is no pipeline
        split = f"tensor parallel x {tensor}, " if tensor > 1 else ""
        kind = "data parallel" if plan.stages[0].replicas > 1 else "one copy"
        title = f"{plan.model}: {split}{kind}, one stage on {devices(plan.gpus, profile)} ({plan.schedule})"
    rows = 24  # as the Gantt: a pipeline of more stages shows its first and last, and how many it left out
    stages = plan.stages if len(plan.stages) <= rows else [*plan.stages[:16], *plan.stages[-8:]]
    spans = {}
    for s in stages:
        layers = [n for n in s.nodes if profile.node(n).op != "input"] or list(s.nodes)
        spans[s.index] = (layer_range(names[layers[0]], names[layers[-1]], len(layers)), len(layers))

    def fill(inline: bool) -> Any:
        table = new_table(title, cols, ("layers", "ranks"))
        for s in stages:
            if s.index == len(plan.stages) - 8 and len(plan.stages) > rows:
                table.add_row("...", f"{len(plan.stages) - rows} not shown", *[""] * (len(cols) - 2))
            span, count = spans[s.index]
            ranks = ",".join(map(str, s.ranks)) if len(s.ranks) <= 3 else f"{s.ranks[0]}..{s.ranks[-1]}"
            busy = s.compute_s / s.replicas + s.comm_s
            table.add_row(str(s.index), span if inline else str(count), ranks, num(s.compute_s * 1e3),
                          num(s.comm_s * 1e3), gib(s.memory_bytes),
                          *(("yes" if s.recompute else "no",) if again else ()),
                          f"{100 * busy / slowest:.0f}%")  # fmt: skip
        return table

    table, out = fill(inline=True), console()
    if Measurement.get(out, out.options.update_width(10_000), table).maximum <= 80:
        return table
    return Group(fill(inline=False), *(Text(f"stage {i}: {span}") for i, (span, _) in spans.items()))


def devices(count: int, profile: Any) -> str:
    """``4 GPUs``, or ``4 CPU ranks`` for a profile measured on a CPU (the plan then runs on CPU ranks)."""
    return plural(count, "CPU rank") if profile.device == "cpu" else plural(count, "GPU")


def _simulated_bubble(sim: Any) -> str:
    """The simulation's bubble beside a closed form's (a plan the simulation prices has only one)."""
    filling = "" if sim.steady else f" over the first {sim.minibatches} minibatches, still filling"
    return f" (simulated {100 * sim.bubble_fraction:.1f}%{filling})"


def plan_summary(plan: Any, sim: Any, profile: Any) -> str:
    from partitioner.optimizer.comparison import data_parallel_fits
    from partitioner.optimizer.pricing.price import gib

    p, info = plan.predicted, plan.solver
    rate = (
        f"{p.throughput_samples_per_s:.1f} samples/s" if p.throughput_samples_per_s else "batch size unknown"
    )
    simulated = plan.extra.get("priced_by") == "simulation"
    gap = (
        f"gap {100 * plan.gap:.2f}% to lower bound {info.lower_bound_s * 1e3:.3f} ms"
        if plan.gap is not None
        else ""
    )
    exact = "optimal" if info.optimal else "not proven optimal"
    if simulated:  # the search's proof and bound are its closed form's; the price is the simulation's
        exact = f"{'optimal' if info.optimal else 'searched'} under the schedule's closed form"
        gap = "priced by simulating the runtime's lists"
    c = plan.cluster
    hosts = (
        f" (bound by the host, not the pipeline: CPU ranks, {c.levels[0].devices} per host of {c.cores} "
        f"cores, {c.threads} thread(s) each; the busiest host needs {p.host_bound_s * 1e3:.3f} ms for "
        "their compute; the pipeline alone "
        f"{(p.pipeline_s or 0) * 1e3:.3f} ms)"
        if p.host_bound_s and p.host_bound_s >= (p.pipeline_s or 0)
        else ""
    )
    single = (
        f"{p.speedup_vs_single or 0:.2f}x over {'one CPU rank' if profile.device == 'cpu' else 'one GPU'}"
    )
    if "layout" in plan.extra:  # (a 3D plan is compared with the hand layouts: --explain)
        speedup = _layout_clause(plan, profile)
    elif len(plan.stages) == 1 and plan.stages[0].replicas == plan.gpus:
        speedup = f"speedup {single}"  # (it is data parallelism: no ratio to itself)
    elif data_parallel_fits(profile, plan):
        speedup = f"speedup {p.speedup_vs_data_parallel or 0:.2f}x over data parallel, {single}"
    else:
        speedup = (
            f"speedup {single}; data parallel does not fit in {gib(c.memory_bytes or 0)} per device (the "
            "memory limit rules it out)"
        )
    return (
        f"predicted {p.time_per_minibatch_s * 1e3:.3f} ms/minibatch{hosts}, {rate}; {speedup}; "
        + _bubble(plan, sim, simulated)
        + _slower_than_data_parallel(plan, profile)
        + "\n"
        f"solver {info.name}: {info.solve_time_s:.3f} s, {exact}; {gap}"
    )


def _bubble(plan: Any, sim: Any, simulated: bool) -> str:
    """The bubble; for one stage (data parallelism) what its devices' idle share really is."""
    p = plan.predicted
    if len(plan.stages) == 1:
        idle = p.bubble_fraction if simulated or sim is None else sim.bubble_fraction
        if idle < 0.0005:
            return "no pipeline bubble (one stage)"
        return (
            f"no pipeline bubble (one stage); {100 * idle:.1f}% of each rank's time"
            f"{' (simulated)' if not simulated and sim is not None else ''} goes to the gradient all-reduce "
            "between its replicas"
        )
    return f"bubble {100 * p.bubble_fraction:.1f}%" + (_simulated_bubble(sim) if not simulated else "")


def _slower_than_data_parallel(plan: Any, profile: Any) -> str:
    """A sentence when the plan is predicted slower than data parallelism, saying what would be faster."""
    from partitioner.optimizer.comparison import data_parallel_fits

    p = plan.predicted
    speedup = p.speedup_vs_data_parallel
    if not speedup or speedup >= 0.995 or len(plan.stages) == 1 or not data_parallel_fits(profile, plan):
        return ""
    dp_ms = speedup * p.time_per_minibatch_s * 1e3
    return (
        f"\nslower than data parallelism ({dp_ms:.3f} ms/minibatch, one stage on every device): "
        f"`--schedule pipedream` or `--schedule auto` can choose it"
    )


def _layout_clause(plan: Any, profile: Any) -> str:
    """A 3D plan's layout, tokens a GPU and utilisation, and what its data group's step adds."""
    from partitioner.optimizer.layouts import layout_name, tokens_per_device, utilisation

    tokens, mfu = tokens_per_device(plan, profile), utilisation(plan, profile)
    rates = (f", {tokens:,.0f} tokens/s a GPU" if tokens else "") + (f", MFU {mfu:.1%}" if mfu else "")
    step = plan.extra["layout"]["step_s"] * 1e3
    return f"layout {layout_name(plan)}{rates}; the data group's step adds {step:.1f} ms (exposed)"


def auto_table(choice: Any, gpus: int, asked: int | None) -> Any:
    from rich.console import Group
    from rich.text import Text

    from partitioner.optimizer.comparison import auto_tie
    from partitioner.optimizer.pricing.schedules import model

    notes = []
    plans, chosen = choice.plans, choice.plan.schedule
    asked_virtual = [
        name for name, plan in plans.items() if plan is None and model(name).virtual_stages is None
    ]
    for name in asked_virtual if gpus >= 2 else ():  # (interleaved: v stages on each GPU, as asked)
        devices = "ranks" if choice.plan.cluster.cores else "GPUs"
        notes.append(f"{name} needs microbatches a multiple of the {gpus} {devices} and {2 * gpus}+ layers")
    if asked is None and len(choice.counts) == 1:
        notes.append("microbatches not searched: the profile has no fixed per-call times")
    elif asked is None:
        notes.append(f"microbatches searched: {', '.join(map(str, choice.counts))}")
    cols = ("schedule", "micro-\nbatches", "stages: replicas", "ms per\nminibatch", "vs best")
    table = new_table("--schedule auto: each schedule's best plan", cols, ("schedule", "stages: replicas"))
    best = choice.times[chosen] or 1.0
    for name, plan in plans.items():
        label = name + (" (chosen)" if name == chosen else "")
        if plan is None:
            table.add_row(label, "-", "-", "no plan", "-")
            continue
        t = choice.times[name]
        table.add_row(label, str(plan.microbatches), stages_cell(plan), f"{t * 1e3:.3f}", f"{t / best:.2f}x")
    tie = auto_tie(choice)
    notes += [tie] if tie else []
    return Group(table, *(Text(note) for note in notes))


def stages_cell(plan: Any) -> str:
    """``3: 2+1+1`` (stages: replicas each); interleaved: ``8 on 4 GPUs (v=2)``; zbv: ``8 on 4 GPUs (V)``."""
    from partitioner.optimizer.pricing.schedules import model

    sched = model(plan.schedule)
    if sched.laid_out:
        shape = f"v={plan.virtual_stages}" if sched.virtual_stages is None else "V"
        devices = "ranks" if plan.cluster.cores else "GPUs"  # (a cluster of CPU processes has cores)
        return f"{len(plan.stages)} on {plan.cluster.gpus} {devices} ({shape})"
    return f"{len(plan.stages)}: " + "+".join(str(s.replicas) for s in plan.stages)


def _none_cell(plan: Any) -> str:
    """Why a row has no plan: memory, where the cluster has a limit; else none ran (no layout)."""
    return "does not fit" if plan.cluster.memory_bytes else "no plan"


def explain_table(plan: Any, others: dict[str, Any], recompute: str) -> Any:
    """--explain: the chosen plan next to the baselines other tools would pick."""
    cols = ("plan", "stages", "replicas", "recomputing\nstages", "ms per\nminibatch", "vs\nchosen")
    table = new_table(
        f"alternatives (--recompute {recompute})", cols, ("plan", "replicas", "recomputing\nstages")
    )
    rows = [("chosen", plan), *others.items()]
    for name, alt in rows:
        if alt is None:
            table.add_row(name, "-", _none_cell(plan), "-", "-", "-")
            continue
        t = alt.predicted.time_per_minibatch_s
        reps = short(",".join(str(s.replicas) for s in alt.stages), 16)
        again = short(",".join(str(s.index) for s in alt.stages if s.recompute) or "none", 12)
        table.add_row(name, str(len(alt.stages)), reps, again,
                      f"{t * 1e3:.3f}", f"{t / plan.predicted.time_per_minibatch_s:.2f}x")  # fmt: skip
    return table


def layout_table(plan: Any, others: dict[str, Any], profile: Any) -> Any:
    """--explain: the chosen layout beside the hand layouts a user would try, each priced by the
    same model: tokens a second a GPU, model FLOP utilisation, the most memory a GPU holds."""
    from partitioner.optimizer.layouts import layout_name, tokens_per_device, utilisation

    cols = ("plan", "layout", "tokens/s\na GPU", "MFU", "GiB\na GPU", "vs\nchosen")
    table = new_table("layouts (each priced by the same model)", cols, ("plan", "layout"))
    for name, alt in [("chosen", plan), *others.items()]:
        if alt is None:
            table.add_row(short(name, 22), "-", _none_cell(plan), "-", "-", "-")
            continue
        tokens, mfu = tokens_per_device(alt, profile), utilisation(alt, profile)
        peak = max(s.memory_bytes for s in alt.stages) / 2**30
        speed = alt.predicted.time_per_minibatch_s / plan.predicted.time_per_minibatch_s
        table.add_row(
            short(name, 22), short(layout_name(alt), 26), "-" if tokens is None else f"{tokens:,.0f}",
            "-" if mfu is None else f"{mfu:.1%}", f"{peak:.1f}", f"{speed:.2f}x",
        )  # fmt: skip
    return table
