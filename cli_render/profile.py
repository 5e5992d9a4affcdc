"""``pipeplan profile``'s output: the slowest layers, the totals, a note when the machine was busy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cli_render.common import console, new_table, num, tail

__all__ = ["print_profile", "profile_progress", "profile_table", "profile_totals"]


@contextmanager
def profile_progress(model: str) -> Iterator[Callable[[int, int, str], None]]:
    """The profiler's progress callback, shown on stderr while the block runs: tracing, each layer
    measured, then the whole-step timing (a bar on a terminal, a timed line per phase in a log)."""
    from cli_render.progress import progress

    with progress(transient=True) as bar:
        task = bar.add_task(f"tracing {model}", total=None)

        def measuring(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=f"measuring {name}")

        yield measuring
        bar.update(task, description="whole-step timing")


def print_profile(profile: Any, path: Path, top: int, clock: str) -> None:
    out = console()
    out.print(profile_table(profile, top))
    out.print(profile_totals(profile, path))
    load, cpus = max(profile.extra.get("loadavg_1min", [0.0])), profile.extra.get("cpus") or 1
    if profile.device == "cpu" and clock == "wall" and load > cpus:
        out.print(
            f"[yellow]note:[/yellow] the machine was busy (load {load:.1f} on {cpus} CPUs): wall-clock times "
            "include waiting for other jobs; --clock cpu measures CPU time instead"
        )


def profile_table(profile: Any, top: int) -> Any:
    total = profile.total_compute_ms or 1.0
    columns = ("layer", "type", "fwd\nms", "bwd\nms", "share", "output\nMB", "saved\nMB", "params\nM")
    table = new_table(
        f"{profile.model}: top {top} layers by forward+backward time", columns, ("layer", "type")
    )
    mb = 1 / 2**20
    for node in sorted(profile.nodes, key=lambda n: -n.compute_ms)[:top]:
        params = node.param_bytes / (4 if profile.dtype == "float32" else 2) / 1e6
        table.add_row(
            tail(node.name, 21) if node.op != "output" else "(loss)",
            tail(node.target.rsplit(".", 1)[-1], 11),
            num(node.forward_ms),
            num(node.backward_ms),
            f"{100 * node.compute_ms / total:.1f}%",
            num(node.output_bytes * mb),
            num(node.saved_bytes * mb),
            num(params),
        )
    return table


def profile_totals(profile: Any, path: Any) -> str:
    from partitioner.profiler.update_cost import UPDATE_KEY, update_ms

    mb = 1 / 2**20
    fwd = sum(n.forward_ms for n in profile.nodes)
    bwd = sum(n.backward_ms for n in profile.nodes)
    fidelity = f"{profile.fidelity:.2f}" if profile.fidelity else "n/a"
    elem = 4 if profile.dtype == "float32" else 2
    params = profile.total_param_bytes
    activations = sum(n.output_bytes for n in profile.nodes) * mb
    saved = sum(n.saved_bytes for n in profile.nodes) * mb
    updates = ", ".join(
        f"{name} {update_ms(profile, name):.1f} ms" for name in profile.extra.get(UPDATE_KEY, {})
    )
    cast = sum(n.cast_bytes for n in profile.nodes) * mb
    copies = f" + {cast:.1f} MB of {profile.precision} weight copies per forward" if cast else ""
    measured = profile.extra.get("layers_measured") or {}
    distinct = f", {measured['distinct']} distinct" if measured.get("reused") else ""
    how = {
        "layer": "measured layer by layer: --materialize whole times it",
        "none": f"estimated for {profile.device}",
    }
    step = (
        f"whole step {profile.step_ms:.1f} ms; fidelity {fidelity}"
        if profile.step_ms
        else f"whole step not timed ({how.get(profile.extra.get('materialized'), 'not measured')})"
    )
    return (
        f"{len(profile.layers)} layers{distinct} ({profile.tracer}), {params / elem / 1e6:.2f}M params "
        f"({params * mb:.1f} MB), activations {activations:.1f} MB, saved for backward {saved:.1f} MB"
        f"{copies}\n"
        f"forward {fwd:.1f} ms + backward {bwd:.1f} ms = {fwd + bwd:.1f} ms; {step} "
        f"(batch {profile.batch_size}, {profile.device}, {profile.dtype}"
        + (f" weights, {profile.precision} autocast" if profile.precision != "fp32" else "")
        + ")\n"
        + (f"optimizer update of all weights: {updates}\n" if updates else "")
        + f"wrote {path}"
    )
