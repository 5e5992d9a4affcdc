"""``pipeplan calibrate``'s output: each stage's profiled and measured compute, and what was written."""

from __future__ import annotations

from typing import Any

from cli_render.common import console, new_table
from partitioner.calibration.link_latency import LinkCalibration
from partitioner.calibration.stage_times import Calibration, stage_factors
from partitioner.optimizer.pricing.schedules import priced_profile
from runtime.schedule import get_schedule

__all__ = ["calibration_table", "print_calibration", "print_links"]


def print_calibration(done: Calibration, links: LinkCalibration | None = None) -> None:
    path, device, out = done.path, done.device, console()
    for note in done.notes:
        console(stderr=True).print(f"[yellow]note:[/yellow] {note}", soft_wrap=True)
    for number, run in enumerate(done.runs, 1):
        plan = run.plan
        forwards = 1 if get_schedule(plan.schedule).stashes else plan.microbatches
        if len(done.runs) > 1:  # (a path in a table's title would wrap at the table's width)
            stages = f"{len(plan.stages)} stage{'s' if len(plan.stages) != 1 else ''}"
            out.print(f"run {number}: {run.source} ({plan.schedule}, {stages})", soft_wrap=True)
        priced = priced_profile(done.profile, plan.schedule, forwards)
        out.print(calibration_table(priced, plan, run.seconds, run.hosted))
    if len(done.runs) > 1:
        out.print(f"each layer scaled by the median of the {len(done.runs)} runs that measured it")
    if done.split_backward:
        g, n = done.split_backward["factor"], int(done.split_backward["runs"])
        out.print(
            f"split backward (zb1p, zbv): B + W took {g:.2f}x the fused backward ({n} run{'s' * (n != 1)}); "
            "their plans are priced with it",
            soft_wrap=True,
        )
    plan = done.runs[0].plan
    if links is not None:
        print_links(links)
    where = f"--cluster {links.cluster}" if links is not None else _devices(plan)  # (the file: the devices)
    out.print(f"wrote {path}; next: pipeplan partition --profile {path} {where}", soft_wrap=True)
    if device is not None:
        out.print(
            f"the profile was estimated for {device.name}: its efficiencies corrected to matmul "
            f"{device.matmul_efficiency:.3f}, memory {device.memory_efficiency:.3f}, launch "
            f"{device.launch_s * 1e6:.1f} us; wrote {done.device_path} (pipeplan profile MODEL "
            f"--device-model {done.device_path})",
            soft_wrap=True,
        )


def print_links(done: LinkCalibration) -> None:
    """The latencies the run's messages and all-reduces gave, from how many, and the file they went to."""
    timed, skipped = len(done.messages.seconds), done.messages.skipped
    if done.latency_s is None:
        said = f"latency {done.latency_before_s * 1e6:.0f} us kept (too few to say)"
    else:
        said = (
            f"median {done.wire_median_s * 1e6:.0f} us on the wire; level-0 latency "
            f"{done.latency_before_s * 1e6:.0f} -> {done.latency_s * 1e6:.0f} us (bandwidth "
            f"{done.bandwidth / 1e9:.3g} GB/s kept)"
        )
    ars = len(done.allreduces.seconds)
    before = f"{done.allreduce_latency_before_s * 1e6:.0f} us"
    after = (
        "kept (too few to say)"
        if done.allreduce_latency_s is None
        else f"-> {done.allreduce_latency_s * 1e6:.0f} us"
    )
    action = (
        "kept (too few to say)"
        if done.action_s is None
        else f"-> {done.action_s * 1e6:.0f} us (mean idle time after {len(done.gaps)} actions)"
    )
    console().print(
        f"links: {timed} messages timed (their receiver was waiting; {skipped} arrived while it computed "
        f"and are not counted): {said}; {ars} gradient all-reduces timed: all-reduce latency per step "
        f"{before} {after}; the runtime's time per action {done.action_before_s * 1e6:.0f} us {action}; "
        f"wrote {done.cluster}",
        soft_wrap=True,
    )


def _devices(plan: Any) -> str:
    """The partition option for the plan's devices, so that the next command runs as printed (for a
    cluster of several levels, ``...``: the links the user gave, theirs to repeat)."""
    levels = plan.cluster.levels
    counts = ",".join(str(level.devices) for level in levels)
    return f"--gpus {plan.cluster.gpus}" if len(levels) == 1 else f"--topology {counts} ..."


def calibration_table(profile: Any, plan: Any, measured_s: Any, hosted: Any = None) -> Any:
    """A row per stage, or per rank where it ran several stages together (``0+2``: their sum)."""
    factors = stage_factors(profile, plan, measured_s, hosted)
    heads = ("stage", "profiled", "measured", "factor")
    table = new_table(f"{profile.model}: compute per minibatch", heads)
    grouped = {k for group in (hosted or {}).values() for k in group[1:]}
    by_index = {s.index: s for s in plan.stages}
    for stage in plan.stages:
        if stage.index in grouped:
            continue
        group = tuple((hosted or {}).get(stage.index, (stage.index,)))
        profiled = sum(profile.node(n).compute_ms for k in group for n in by_index[k].nodes)
        measured = measured_s.get(stage.index)
        table.add_row("+".join(map(str, group)), f"{profiled:.2f} ms",
                      f"{measured * 1e3:.2f} ms" if measured else "-",
                      f"{factors[stage.index]:.2f}x" if stage.index in factors else "-")  # fmt: skip
    return table
