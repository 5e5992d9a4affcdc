"""The ``pipeplan`` command: profile -> partition -> verify -> run.

Commands stay thin: parse options, call the library, render with rich. This is the only module that
uses rich, and it imports torch and the heavy library modules lazily, inside the commands, so
``pipeplan --help`` stays fast.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
from rich.console import Console

from runtime.schedule import SCHEDULES, get_schedule

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])


def _console(stderr: bool = False) -> Console:
    """One Console per stream; commands print tables on stdout and progress/errors on stderr."""
    return Console(stderr=stderr, highlight=False, emoji=False)  # (":llama:" is no emoji in a spec)


def _progress(transient: bool) -> Any:
    """rich's progress bar on a terminal; elsewhere (a log, a pipe, CI) a line per phase with the
    elapsed time, since rich draws nothing there until the end."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = _console(stderr=True)
    if not console.is_terminal:
        return _PhaseLog(console)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console, transient=transient)


class _PhaseLog:
    """The part of rich's Progress the commands use, as plain lines: one when the phase (the
    description's first word: tracing, measuring, step) changes, at most one per ``every`` seconds
    within a phase, and the last state at the end, each after the seconds since the start. Nothing
    in the first ``delay`` seconds, nor after an error: a command that fails at once prints only its
    ``error:`` line."""

    PATTERN = r"^ *\d+\.\d s  "  # (the start of each line, for tools that read the output)

    def __init__(self, console: Console, every: float = 10.0, delay: float = 2.0) -> None:
        import time

        self.console, self.every, self.delay, self.clock = console, every, delay, time.monotonic
        self.start = self.last = self.clock()
        self.task: dict[str, Any] = {}
        self.shown: tuple[Any, ...] | None = None
        self.phase = ""

    def __enter__(self) -> _PhaseLog:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.stop()

    def add_task(self, description: str, total: float | None = None) -> int:
        self.task = {"description": description, "completed": 0, "total": total}
        self._show()
        return 0

    def update(self, task: int, **fields: Any) -> None:
        self.task.update({k: v for k, v in fields.items() if v is not None})
        self._show()

    def stop(self) -> None:
        self._show(final=True)

    def _show(self, final: bool = False) -> None:
        now, text, done, total = (
            self.clock(),
            self.task["description"],
            self.task["completed"],
            self.task["total"],
        )
        phase = text.split(" ", 1)[0]
        due = phase != self.phase or now - self.last >= self.every or final
        if not due or self.shown == (text, done, total) or now - self.start < self.delay:
            return
        self.phase, self.last, self.shown = phase, now, (text, done, total)
        count = f" ({done:g}/{total:g})" if total else ""
        self.console.print(f"{now - self.start:7.1f} s  {text}{count}", markup=False, highlight=False)


def _table(title: str, columns: Sequence[str], left: Sequence[str] = ()) -> Any:
    """A table that reads in an 80-column terminal or a log: a rule under the header, no side borders,
    two spaces between columns, numbers never cut or wrapped (units go in the header's second line,
    ``"compute\nms"``; tests/test_cli_tables.py renders every table at 80 columns)."""
    from rich import box
    from rich.table import Table

    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True
    )
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right", no_wrap=column not in left)
    return table


def _layer_range(first: str, last: str, count: int) -> str:
    """``features.0..30 (31)``: the first and last layer's names, their shared dotted prefix once."""
    if first == last:
        return f"{first} ({count})"
    a, b = first.split("."), last.split(".")
    pairs = enumerate(zip(a[:-1], b[:-1], strict=False))
    shared = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)) - 1)
    return f"{first}..{'.'.join(b[shared:])} ({count})"


def _plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"


def _num(value: float) -> str:
    """A time or size in at most 6 characters that keeps 4 significant digits (``1410``, ``12.34``)."""
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def _tail(name: str, width: int) -> str:
    """A layer's name in a table cell: the end is what tells layers apart (``…layers.5.mlp.down_proj``)."""
    return name if len(name) <= width else "\N{HORIZONTAL ELLIPSIS}" + name[1 - width :]


def _node_options(func: F) -> F:
    """The options that place a job's ranks on machines, shared by `run` and `probe`."""
    options = [
        click.option("--timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
                     callback=_finite, help="Seconds a rank waits on its peers before the job is stopped."),
        click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True, help="Machines."),
        click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
                     help="This machine's index (run the same command on every node)."),
        click.option("--master-addr", default="127.0.0.1", show_default=True,
                     help="Node 0's address (rendezvous)."),
        click.option("--master-port", type=click.IntRange(min=0, max=65535), default=0,
                     help="0: a free port."),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def user_errors(func: F) -> F:
    """Turn the library's typed errors into one red line and exit code 2 (a traceback with --debug)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from partitioner.errors import PipeplanError
        from runtime.errors import RunError

        try:
            return func(*args, **kwargs)
        except (PipeplanError, RunError) as exc:
            if click.get_current_context().find_root().params.get("debug"):
                raise
            from rich.markup import escape

            _console(stderr=True).print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


class _OneLineErrors(click.Group):
    """click's own usage errors (bad option, value out of range) as one ``error:`` line, exit 2, like
    the library's; Ctrl-C as one line and exit 130. click would print a three-line usage block."""

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:  # fmt: skip
        if not standalone_mode:
            return super().main(args, prog_name, standalone_mode=False, **extra)
        try:
            result = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            message = exc.format_message().rstrip(".")
            click.echo(f"error: {message[:1].lower()}{message[1:]}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(result if isinstance(result, int) else 0)


@click.group(
    cls=_OneLineErrors,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug logs).")
@click.version_option(package_name="pipeplan")
def main(debug: bool, verbose: int) -> None:
    """Automatic pipeline-parallel training for PyTorch.

    \b
    The workflow, each step writing a file the next one reads:
      pipeplan profile vgg16          measure every layer       -> profiles/vgg16/profile.json
      pipeplan partition --gpus 4     choose stages + replicas  -> models/vgg16/gpus=4/
      pipeplan verify                 check the stages against the original model
      pipeplan run                    train the package on its ranks (torchrun)
      pipeplan calibrate              feed the run's stage times back -> profiles/<model>/calibrated.json
      pipeplan export -o model.pt     the trained stages as one state_dict of the original model
    """
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


# ----------------------------------------------------------------------------- profile
# (owned by the profiler: partitioner/profiler, partitioner/models.py)


def _parse_shape(text: str | None) -> tuple[int, ...] | None:
    """``3,224,224`` -> (3, 224, 224); a PipeplanError names the bad value."""
    from partitioner.errors import PipeplanError

    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise PipeplanError(
            f"bad --input-shape {text!r}: give one sample's shape as positive integers, e.g. 3,224,224 or 128"
        )
    return shape


def _check_output(path: Any) -> None:
    """Fail before a long measurement, not after: the folder must be writable and no foreign file replaced."""
    import tempfile

    from partitioner.errors import PipeplanError, ProfileFormatError
    from partitioner.graph import load_profile

    if path.is_dir():
        raise PipeplanError(f"output {path} is a folder; give a file name such as {path / 'profile.json'}")
    if path.exists():
        try:
            load_profile(path)
        except ProfileFormatError as exc:
            raise PipeplanError(f"refusing to overwrite {path}: {exc}") from exc
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise PipeplanError(
            f"cannot write {path}: {exc.strerror or exc}; choose another -o/--output"
        ) from exc


def _profile_table(profile: Any, top: int) -> Any:
    total = profile.total_compute_ms or 1.0
    columns = ("layer", "type", "fwd\nms", "bwd\nms", "share", "output\nMB", "saved\nMB", "params\nM")
    table = _table(f"{profile.model}: top {top} layers by forward+backward time", columns, ("layer", "type"))
    mb = 1 / 2**20
    for node in sorted(profile.nodes, key=lambda n: -n.compute_ms)[:top]:
        params = node.param_bytes / (4 if profile.dtype == "float32" else 2) / 1e6
        table.add_row(
            _tail(node.name, 21) if node.op != "output" else "(loss)",
            _tail(node.target.rsplit(".", 1)[-1], 11),
            _num(node.forward_ms),
            _num(node.backward_ms),
            f"{100 * node.compute_ms / total:.1f}%",
            _num(node.output_bytes * mb),
            _num(node.saved_bytes * mb),
            _num(params),
        )
    return table


def _profile_totals(profile: Any, path: Any) -> str:
    from partitioner.update import UPDATE_KEY, update_ms

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
    how = {"layer": "measured layer by layer", "none": f"estimated for {profile.device}"}
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


def _check_estimate_options(device_model: str) -> None:
    """--device-model estimates without running: options that only shape a measurement are refused."""
    from click.core import ParameterSource

    from partitioner.devices import load_device_model
    from partitioner.errors import PipeplanError

    if device_model != "cpu":
        load_device_model(device_model)  # before a progress bar: an unknown name is one line
    ctx = click.get_current_context()
    measuring = ["device", "repeats", "fixed_cost", "materialize"]
    if device_model != "cpu":
        measuring += ["threads", "clock"]  # the cpu model measures this machine at --threads, --clock
    given = [p for p in measuring if ctx.get_parameter_source(p) == ParameterSource.COMMANDLINE]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise PipeplanError(f"{flag} shapes a measurement; --device-model estimates without one: drop {flag}")


@main.command()
@click.argument("model")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=str),
    default=None,
    help="Where to write the profile  [default: profiles/<model>/profile.json]",
)
@click.option(
    "--batch-size",
    type=int,
    default=8,
    show_default=True,
    help="Samples per minibatch: the plan, the package and `pipeplan run` use it. Profile at the size "
    "you train at; at batch 1 fixed per-layer costs dominate and the plan is unrealistic.",
)
@click.option(
    "--input-shape", default=None, help="One sample's shape, e.g. 3,224,224 (images) or 128 (tokens)."
)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option(
    "--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True
)
@click.option(
    "--leaf-module",
    "leaf_modules",
    multiple=True,
    metavar="CLASS",
    help="Keep every module of this class as one layer (repeatable), e.g. GPT2Block.",
)
@click.option(
    "--repeats",
    type=int,
    default=3,
    show_default=True,
    help="Timed runs per layer, after a warm-up (fewer for layers over 0.5 s); the median is kept.",
)
@click.option(
    "--clock",
    type=click.Choice(["wall", "cpu"]),
    default="wall",
    show_default=True,
    help="cpu: process CPU time, steadier on a CPU shared with other jobs (CPU only).",
)
@click.option(
    "--threads",
    type=int,
    default=None,
    help="CPU threads while measuring [default: 1 on a CPU]. `pipeplan run` gives each rank "
    "cores / ranks per machine (at least 1): profile at that count for predictions that match.",
)
@click.option(
    "--microbatch-size",
    type=int,
    default=None,
    help="Measure at this many samples and scale to --batch-size: the per-microbatch cost a 1f1b or "
    "gpipe pipeline sees (partition with --microbatches = batch size / this).",
)
@click.option(
    "--fixed-cost/--no-fixed-cost",
    default=True,
    show_default=True,
    help="Also measure every layer at an eighth of the batch, for its fixed time per call: what "
    "`partition --schedule auto` weighs microbatch counts with (a second, smaller pass over the layers).",
)
@click.option(
    "--precision",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default="fp32",
    show_default=True,
    help="Measure under autocast to bf16 or fp16 (float32 weights), as `pipeplan run --precision` "
    "trains; partition carries it into plan.json.",
)
@click.option(
    "--materialize",
    type=click.Choice(["auto", "whole", "layer"]),
    default="auto",
    show_default=True,
    help="whole: build the model on the device and time the whole step too; layer: build it without "
    "weights and make one layer real at a time (memory of one layer, no whole-step time); auto: whole "
    "while the weights take at most an eighth of the free memory.",
)
@click.option(
    "--device-model",
    default=None,
    metavar="NAME|FILE.json",
    help="Estimate every layer for a device that is not here instead of measuring: h100, a100-80gb, "
    "h200, cpu (this machine's measured rates) or a device model file (docs/devices.md). Nothing is "
    "allocated: plans a 70B model on a laptop.",
)
@click.option(
    "--reuse/--no-reuse",
    default=True,
    show_default=True,
    help="Measure identical layers (same code, shapes and dtypes) once and share the result.",
)
@click.option("--top", type=int, default=10, show_default=True, help="Layers shown in the summary table.")
@click.option("--json", "as_json", is_flag=True, help="Print only the profile JSON on stdout.")
@user_errors
def profile(
    model: str,
    output: str | None,
    batch_size: int,
    input_shape: str | None,
    device: str,
    dtype: str,
    leaf_modules: tuple[str, ...],
    repeats: int,
    clock: str,
    threads: int | None,
    microbatch_size: int | None,
    fixed_cost: bool,
    precision: str,
    materialize: str,
    reuse: bool,
    device_model: str | None,
    top: int,
    as_json: bool,
) -> None:  # fmt: skip
    """Trace MODEL and measure every layer's time and memory -> profile.json.

    \b
    MODEL is a built-in name (vgg16, resnet50, gpt2, tiny-mlp, ...), torchvision:NAME,
    hf:FAMILY[:TASK] or hf:PATH (Hugging Face; nothing downloaded), package.module:factory, or
    path/to/file.py:factory (the factory returns a module, or (module, example_inputs); the file
    may define example_inputs(batch_size), example_targets(batch_size) and loss_fn(output, target)).

    \b
    Examples:
      pipeplan profile vgg16 --batch-size 8 --input-shape 3,64,64
      pipeplan profile hf:llama --input-shape 128
      pipeplan profile my_model.py:build -o profiles/mine/profile.json
    """
    import json
    from pathlib import Path

    from partitioner.errors import PipeplanError
    from partitioner.graph import profile_to_json, save_profile
    from partitioner.models import model_name
    from partitioner.profiler import check_precision_options, profile_model

    if batch_size <= 0:
        raise PipeplanError(f"--batch-size must be positive, got {batch_size}")
    if device_model is not None:
        _check_estimate_options(device_model)
    check_precision_options(precision, dtype)
    shape = _parse_shape(input_shape)
    path = Path(output) if output else Path("profiles") / model_name(model) / "profile.json"
    _check_output(path)
    with _progress(transient=True) as bar:
        task = bar.add_task(f"tracing {model}", total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=f"measuring {name}")

        result = profile_model(
            model,
            batch_size,
            shape,
            device,
            dtype,
            leaf_modules,
            repeats,
            progress,
            clock,
            threads,
            microbatch_size,
            precision,
            fixed_cost,
            materialize=materialize,
            reuse=reuse,
            device_model=device_model,
        )
        bar.update(task, description="whole-step timing")
    save_profile(result, path)
    if as_json:
        click.echo(json.dumps(profile_to_json(result), indent=1))
        return
    console = _console()
    console.print(_profile_table(result, top))
    console.print(_profile_totals(result, path))
    load, cpus = max(result.extra.get("loadavg_1min", [0.0])), result.extra.get("cpus") or 1
    if result.device == "cpu" and clock == "wall" and load > cpus:
        console.print(
            f"[yellow]note:[/yellow] the machine was busy (load {load:.1f} on {cpus} CPUs): wall-clock times "
            "include waiting for other jobs; --clock cpu measures CPU time instead"
        )


# ----------------------------------------------------------------------------- partition
# (owned by the optimizer: partitioner/optimizer, partitioner/codegen.py)


def _newest_profile() -> Any:
    from pathlib import Path

    from partitioner.errors import ProfileFormatError

    found = sorted(Path("profiles").glob("*/profile.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ProfileFormatError(
            "no profiles/*/profile.json here; run `pipeplan profile MODEL` or give --profile"
        )
    return found[-1]


def _cluster(
    gpus: int | None,
    topology: str | None,
    bandwidth: str | None,
    memory: str | None,
    preset: str | None = None,
    latency: str | None = None,
    device: str = "cpu",
) -> Any:
    from dataclasses import replace

    from partitioner.clusters import default_latency, levels_of
    from partitioner.errors import PlanError
    from partitioner.optimizer.units import parse_bytes, parse_int_list
    from partitioner.plan import Cluster

    if preset is not None:
        from partitioner.clusters import load_cluster

        if gpus is not None or topology is not None or bandwidth is not None or latency is not None:
            raise PlanError(
                "--cluster gives the devices and their links: drop --gpus, --topology, --bandwidth, --latency"
            )
        cluster = load_cluster(preset)
        return replace(cluster, memory_bytes=parse_bytes(memory)) if memory else cluster
    if (gpus is None) == (topology is None):
        raise PlanError("give exactly one of --gpus N, --topology N1,N2,.. or --cluster NAME[:NODES]")
    if gpus is not None and gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {gpus}")
    devices = [gpus] if gpus is not None else parse_int_list(str(topology), "--topology")
    limit = parse_bytes(memory) if memory else None
    return Cluster(levels_of(devices, bandwidth, latency, default_latency(device)), limit)


def _estimated_memory(profile: Any, cluster: Any) -> Any:
    """A profile estimated for a device model plans with that device's memory unless told otherwise."""
    from dataclasses import replace

    from partitioner.devices import estimated_device

    device = estimated_device(profile)
    if device is None or cluster.memory_bytes is not None:
        return cluster
    _console(stderr=True).print(
        f"[yellow]note:[/yellow] --memory {device.memory_bytes / 2**30:.0f}GiB, the memory of the "
        f"{device.name} the profile was estimated for (give --memory to plan for another)",
        soft_wrap=True,
    )
    return replace(cluster, memory_bytes=device.memory_bytes)


def _cpu_hosts(cluster: Any, profile: Any, host_cores: int | None) -> Any:
    """CPU ranks time-slice their host's cores: a CPU profile's cluster gets this machine's cores (or
    --host-cores) and the threads the profile measured with, so the prediction counts the sharing."""
    import os
    from dataclasses import replace

    from partitioner.errors import PlanError

    if profile.device != "cpu":
        if host_cores is not None:
            raise PlanError(
                f"--host-cores is for profiles measured on a CPU; this one was measured on "
                f"{profile.device}, whose devices compute on their own: leave --host-cores out"
            )
        return cluster
    if host_cores is not None and host_cores < 0:
        raise PlanError(f"--host-cores must be >= 0 (0: every rank has cores of its own), got {host_cores}")
    cores = len(os.sched_getaffinity(0)) if host_cores is None else host_cores
    threads = int(profile.extra.get("threads") or 1)
    return replace(cluster, cores=cores or None, threads=max(1, threads))


def _plan_table(plan: Any, profile: Any) -> Any:
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
    title = f"{plan.model}: {len(plan.stages)} stages on {_devices(plan.gpus, profile)} ({plan.schedule})"
    rows = 24  # as the Gantt: a pipeline of more stages shows its first and last, and how many it left out
    stages = plan.stages if len(plan.stages) <= rows else [*plan.stages[:16], *plan.stages[-8:]]
    spans = {}
    for s in stages:
        layers = [n for n in s.nodes if profile.node(n).op != "input"] or list(s.nodes)
        spans[s.index] = (_layer_range(names[layers[0]], names[layers[-1]], len(layers)), len(layers))

    def fill(inline: bool) -> Any:
        table = _table(title, cols, ("layers", "ranks"))
        for s in stages:
            if s.index == len(plan.stages) - 8 and len(plan.stages) > rows:
                table.add_row("...", f"{len(plan.stages) - rows} not shown", *[""] * (len(cols) - 2))
            span, count = spans[s.index]
            ranks = ",".join(map(str, s.ranks)) if len(s.ranks) <= 3 else f"{s.ranks[0]}..{s.ranks[-1]}"
            busy = s.compute_s / s.replicas + s.comm_s
            table.add_row(str(s.index), span if inline else str(count), ranks, _num(s.compute_s * 1e3),
                          _num(s.comm_s * 1e3), gib(s.memory_bytes),
                          *(("yes" if s.recompute else "no",) if again else ()),
                          f"{100 * busy / slowest:.0f}%")  # fmt: skip
        return table

    table, console = fill(inline=True), _console()
    if Measurement.get(console, console.options.update_width(10_000), table).maximum <= 80:
        return table
    return Group(fill(inline=False), *(Text(f"stage {i}: {span}") for i, (span, _) in spans.items()))


def _devices(count: int, profile: Any) -> str:
    """``4 GPUs``, or ``4 CPU ranks`` for a profile measured on a CPU (the plan then runs on CPU ranks)."""
    return _plural(count, "CPU rank") if profile.device == "cpu" else _plural(count, "GPU")


def _plan_summary(plan: Any, sim: Any, profile: Any) -> str:
    p, info = plan.predicted, plan.solver
    rate = (
        f"{p.throughput_samples_per_s:.1f} samples/s" if p.throughput_samples_per_s else "batch size unknown"
    )
    gap = (
        f"gap {100 * plan.gap:.2f}% to lower bound {info.lower_bound_s * 1e3:.3f} ms"
        if plan.gap is not None
        else ""
    )
    exact = "optimal" if info.optimal else "not proven optimal"
    c = plan.cluster
    hosts = (
        f" (CPU ranks, {c.levels[0].devices} per host of {c.cores} cores, {c.threads} thread(s) each: "
        f"the busiest host needs {p.host_bound_s * 1e3:.3f} ms for their compute; the pipeline alone "
        f"{(p.pipeline_s or 0) * 1e3:.3f} ms)"
        if p.host_bound_s and p.host_bound_s >= (p.pipeline_s or 0)
        else ""
    )
    return (
        f"predicted {p.time_per_minibatch_s * 1e3:.3f} ms/minibatch{hosts}, {rate}; speedup "
        f"{p.speedup_vs_data_parallel or 0:.2f}x over data parallel, "
        f"{p.speedup_vs_single or 0:.2f}x over {'one CPU rank' if profile.device == 'cpu' else 'one GPU'}; "
        f"bubble {100 * p.bubble_fraction:.1f}% (simulated {100 * sim.bubble_fraction:.1f}%"
        + ("" if sim.steady else f" over the first {sim.minibatches} minibatches, still filling")
        + ")\n"
        f"solver {info.name}: {info.solve_time_s:.3f} s, {exact}; {gap}"
    )


def _explain(
    profile: Any, cluster: Any, plan: Any, schedule: str, micro: int, optimizer: str, recompute: str
) -> Any:
    from partitioner.optimizer.planner import alternatives

    cols = ("plan", "stages", "replicas", "recomputing\nstages", "ms per\nminibatch", "vs\nchosen")
    table = _table(
        f"alternatives (--recompute {recompute})", cols, ("plan", "replicas", "recomputing\nstages")
    )
    rows = [("chosen", plan), *alternatives(profile, cluster, schedule, micro, optimizer, recompute).items()]
    for name, alt in rows:
        if alt is None:
            table.add_row(name, "-", "does not fit", "-", "-", "-")
            continue
        t = alt.predicted.time_per_minibatch_s
        reps = _short(",".join(str(s.replicas) for s in alt.stages), 16)
        again = _short(",".join(str(s.index) for s in alt.stages if s.recompute) or "none", 12)
        table.add_row(name, str(len(alt.stages)), reps, again,
                      f"{t * 1e3:.3f}", f"{t / plan.predicted.time_per_minibatch_s:.2f}x")  # fmt: skip
    return table


def _short(text: str, width: int = 39) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _check_package_options(profile: Any, weights: str | None, init: str) -> None:
    """Refuse --weights/--init that cannot apply before solving, not after."""
    from pathlib import Path

    from partitioner.errors import PlanError

    if profile.tracer == "pipedream" and (weights is not None or init != "auto"):
        raise PlanError(
            "--weights and --init need a traced model; a PipeDream graph.txt profile yields only the plan"
        )
    if weights is not None and not Path(weights).is_file():
        raise PlanError(f"--weights {weights}: no such file; give a torch.save(model.state_dict()) file")


def _virtual_stages(schedule: str, virtual: int | None, explain: bool) -> int:
    """--virtual-stages: 2 by default under interleaved, refused elsewhere (and --explain, whose
    baselines are not laid out in virtual stages)."""
    from partitioner.errors import PlanError
    from partitioner.optimizer.pricing.schedules import model

    laid_out = schedule != "auto" and model(schedule).laid_out
    asks = laid_out and model(schedule).virtual_stages is None  # (as many as asked: interleaved)
    if laid_out and explain and not asks:
        raise PlanError(f"--explain does not support --schedule {schedule} yet; drop one of them")
    if not asks:
        if virtual is not None:
            raise PlanError(f"--virtual-stages needs --schedule interleaved, not {schedule}")
        return 1
    if virtual is not None and virtual < 1:
        raise PlanError(f"--virtual-stages must be >= 1, got {virtual}")
    if explain:
        raise PlanError(f"--explain does not support --schedule {schedule} yet; drop one of them")
    return 2 if virtual is None else virtual


def _check_replicas(plan: Any) -> None:
    """Refuse a plan whose replicas cannot all get a sample: the cost model divides a minibatch's time
    by the replicas as if samples were endlessly divisible (100000 GPUs at batch 8: "97742x"). The
    search caps replicas at the samples, so such a plan leaves GPUs idle: refused too."""
    from partitioner.errors import PlanError

    widest = max(plan.stages, key=lambda s: s.replicas)
    if plan.batch_size and widest.replicas > plan.batch_size:
        raise PlanError(
            f"the plan gives stage {widest.index} {widest.replicas} replicas but a minibatch has only "
            f"{plan.batch_size} samples; use fewer --gpus, --straight, or profile a larger --batch-size"
        )
    if plan.batch_size and widest.replicas == plan.batch_size and plan.gpus < plan.cluster.gpus:
        raise PlanError(  # the search caps replicas at the samples: GPUs beyond would sit idle
            f"a minibatch of {plan.batch_size} samples gives work to {plan.gpus} of the "
            f"{plan.cluster.gpus} GPUs; use --gpus {plan.gpus}, or profile a larger --batch-size"
        )


def _write_plan(profile: Any, plan: Any, out_dir: Any, weights: str | None, init: str) -> Any:
    import json
    from pathlib import Path

    from partitioner.atomic import write_text_atomic
    from partitioner.errors import PlanError
    from partitioner.plan import mp_conf, save_plan
    from partitioner.profiler.budget import unbuildable

    too_big = unbuildable(profile)
    if profile.tracer != "pipedream" and too_big is None:
        from partitioner.codegen import write_package

        return write_package(profile, plan, out_dir, Path(weights) if weights else None, init)
    if too_big and (weights or init != "auto"):
        raise PlanError(f"--weights and --init shape the stage code, which is not written: {too_big}")
    if too_big:
        _console(stderr=True).print(
            f"[yellow]note:[/yellow] stage code not written, only plan.json and mp_conf.json: {too_big}",
            soft_wrap=True,
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_plan(plan, out_dir / "plan.json")
    write_text_atomic(out_dir / "mp_conf.json", json.dumps(mp_conf(plan.stages), indent=1) + "\n")
    return plan


@main.command()
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(path_type=str),
    default=None,
    help="profile.json or PipeDream graph.txt  [default: newest profiles/*/profile.json]",
)
@click.option("--gpus", type=int, default=None, help="Devices on one level.")
@click.option(
    "--cluster",
    "cluster_spec",
    default=None,
    metavar="NAME[:NODES]|FILE.json",
    help="A cluster by name: dgx-a100, dgx-h100 or hgx-h200 (8 GPUs a node) times NODES, or a cluster "
    "file; sets the topology, bandwidths and memory (--memory overrides). See docs/devices.md.",
)
@click.option(
    "--topology", default=None, help="Devices per level, innermost first (4,4 = 4 servers of 4 GPUs)."
)
@click.option("--bandwidth", default=None, help="Bytes/s per level: 1e9, 10GB/s, 100Gbit/s  [default: 1e9]")
@click.option(
    "--latency",
    default=None,
    help="Seconds every message costs besides its bytes, per level: 5us, 1.7ms, 0  [default: 1.7ms "
    "for a CPU profile (local gloo ranks, measured), 5.7us for GPUs (NCCL's PCIe estimate)]. "
    "See docs/devices.md.",
)
@click.option("--memory", default=None, help="Memory per device, e.g. 16GiB  [default: unlimited]")
@click.option(
    "--host-cores",
    type=int,
    default=None,
    help="For a profile measured on a CPU: cores of one host (a unit of the innermost level), which its "
    "CPU ranks share; the prediction is at least the time the host needs to run their compute on "
    "them. 0: every rank has cores of its own.  [default: this machine's cores]",
)
@click.option(
    "--schedule",
    type=click.Choice([*SCHEDULES, "auto"]),
    default="pipedream",
    show_default=True,
    help="pipedream: asynchronous 1F1B with weight stashing (slowest stage sets the pace); 1f1b, gpipe: "
    "synchronous, a flush per minibatch; zb1p: zero bubble (ZB-H1), 1f1b with each backward split into "
    "input and weight gradients, the weight half deferred into the bubbles (about a third of 1f1b's "
    "bubble; every stage holds up to min(stages, microbatches) microbatches' activations); zbv: zero bubble "
    "V (ZB-V), 2 x GPUs stages laid out as a V (GPU r holds stages r and 2 x GPUs-1-r), backward split as "
    "zb1p's, a bubble of about (GPUs-1)/(6 x microbatches) of equal stages, each GPU holding 1f1b's "
    "first-stage activations, --microbatches 2 x GPUs by default, gloo only; "
    "interleaved: "
    "Megatron's virtual stages, GPUs x --virtual-stages stages of one GPU, stage s on GPU s mod GPUs, "
    "bubble (GPUs-1)/(V x microbatches); auto: the fastest predicted of them all, each at its best "
    "microbatch count (powers of two that split the batch, up to 4 per GPU; the count that --microbatches "
    "gives, if given; searched only where the profile measured each layer's fixed time per call) and "
    "interleaved at its best of 2, 3 or 4 virtual stages, with a table of each one's best plan "
    "(pipedream among them trains asynchronously, on gradients of weights a few minibatches old).",
)
@click.option(
    "--microbatches",
    type=int,
    default=None,
    help="Microbatches per minibatch (1f1b, gpipe, zb1p, interleaved) [default: 4; interleaved: GPUs x 2; "
    "auto: searched].",
)
@click.option(
    "--virtual-stages",
    "virtual",
    type=int,
    default=None,
    help="With --schedule interleaved: stages per GPU (Megatron's virtual stages)  [default: 2].",
)
@click.option("--optimizer", type=click.Choice(["sgd", "momentum", "adam", "adamw"]), default="sgd",
              show_default=True, help="Training optimizer, for the memory model: state kept per weight byte "
              "(sgd none, momentum 1, adam and adamw 2).")  # fmt: skip
@click.option("--straight", is_flag=True, help="No replication: one device per stage.")
@click.option("--recompute", type=click.Choice(["none", "all", "auto"]), default=None,
              help="Activation recomputation: a recomputing stage keeps only its inputs per microbatch in "
              "flight and runs its forward again in backward (more compute, less memory). none; all "
              "stages; auto: the plan without it if one fits --memory, else recompute exactly the stages "
              "that do not fit without it. Recorded per stage in plan.json; `pipeplan run` obeys "
              "it.  [default: none; with --schedule auto: auto]")  # fmt: skip
@click.option("--solver", type=click.Choice(["dp", "ilp"]), default="dp", show_default=True,
              help="dp: exact search (optimal where it can list every downset); ilp: the same problem "
              "in pulp, for cross-checks on small profiles (one level).")  # fmt: skip
@click.option(
    "--cuts", default=None, help="Fix the plan: last layer of every stage but the last, e.g. fc6,fc7."
)
@click.option("--replicas", default=None, help="With --cuts: replicas per stage, e.g. 3,1.")
@click.option("--explain", is_flag=True, help="Also show data-parallel, straight and balanced baselines.")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=str),
    default=None,
    help="Write the simulated timeline as a Chrome trace (Perfetto).",
)
@click.option(
    "--batch-size",
    type=int,
    default=None,
    help="Samples per minibatch, for profiles that do not record it (PipeDream graph.txt).",
)
@click.option(
    "--no-activation-comm",
    "no_comm",
    is_flag=True,
    help="Charge no activation traffic at cuts (what PipeDream's optimizer computes by default).",
)
@click.option(
    "--weights",
    type=click.Path(path_type=str, dir_okay=False),
    default=None,
    help="Weights the stages start from: a torch.save(state_dict) file, a .safetensors file or a "
    "save_pretrained folder (each rank reads only its stage's tensors).",
)
@click.option(
    "--init",
    type=click.Choice(["auto", "exact", "seeded"]),
    default="auto",
    show_default=True,
    help="Stage initialisation without --weights: exact (as the whole model under the seed; each rank "
    "draws the model's random numbers once, holding only its stage), seeded (per-module seeds; a rank "
    "draws only its stage), auto (exact up to 2 GiB of parameters).",
)
@click.option("--json", "as_json", is_flag=True, help="Print only plan.json on stdout.")
@click.option("-o", "--output", default="models", show_default=True, help="Output root: OUT/<model>/gpus=N/.")
@user_errors
def partition(
    profile_path: str | None, gpus: int | None, cluster_spec: str | None, topology: str | None,
    bandwidth: str | None, latency: str | None,
    memory: str | None, host_cores: int | None, schedule: str, microbatches: int | None, virtual: int | None,
    optimizer: str, straight: bool, recompute: str | None, solver: str, cuts: str | None,
    replicas: str | None, explain: bool,
    trace_path: str | None, batch_size: int | None, no_comm: bool, weights: str | None, init: str,
    as_json: bool, output: str,
) -> None:  # fmt: skip
    """Choose pipeline stages and replicas for a profile -> plan.json + mp_conf.json (+ stage code).

    \b
    Examples:
      pipeplan partition --gpus 4
      pipeplan partition --profile graph.txt --topology 4,4 --bandwidth 4294967296,1250000000
      pipeplan partition --gpus 4 --cuts features.30,classifier.3 --replicas 3,1
      pipeplan partition --gpus 4 --schedule interleaved --virtual-stages 2 --microbatches 8
    """
    import json
    import re
    from dataclasses import replace
    from pathlib import Path

    from partitioner.errors import PlanError
    from partitioner.graph import load_profile
    from partitioner.optimizer import evaluate, solve
    from partitioner.optimizer.options import check_devices, check_microbatches, default_microbatches
    from partitioner.optimizer.pricing.schedules import model as schedule_model
    from partitioner.optimizer.pricing.simulate import gantt, simulate, write_chrome_trace
    from partitioner.optimizer.units import parse_int_list
    from partitioner.plan import plan_to_json
    from partitioner.update import with_update_time

    path = Path(profile_path) if profile_path else _newest_profile()
    profile = load_profile(path)
    if batch_size is not None:
        if batch_size < 1:
            raise PlanError(f"--batch-size must be >= 1, got {batch_size}")
        profile = replace(profile, batch_size=batch_size)
    _check_package_options(profile, weights, init)
    if profile.precision == "fp16" and schedule != "auto" and get_schedule(schedule).stashes:
        raise PlanError(
            f"{path} was measured at fp16, whose loss scaling needs a synchronous schedule: partition with "
            "--schedule 1f1b or gpipe, or profile with --precision bf16 for pipedream"
        )
    profile = with_update_time(profile, optimizer)
    recompute = recompute or ("auto" if schedule == "auto" else "none")  # auto searches recomputation too
    cluster = _cluster(gpus, topology, bandwidth, memory, cluster_spec, latency, profile.device)
    cluster = _cpu_hosts(cluster, profile, host_cores)
    check_devices(profile, cluster.gpus)
    cluster = _estimated_memory(profile, cluster)
    if cluster.memory_bytes is not None:
        from partitioner.optimizer.pricing.price import check_layers_fit

        check_layers_fit(profile, cluster.memory_bytes, optimizer)
    v = _virtual_stages(schedule, virtual, explain)
    if microbatches is not None:
        micro = microbatches
    else:  # (auto tries several counts; 4 is where it starts)
        micro = 4 if schedule == "auto" else schedule_model(schedule).default_microbatches(cluster.gpus, v)
        micro = default_microbatches(profile.batch_size, micro)  # the largest up to it that splits the batch
    auto_table = None
    if (cuts is None) != (replicas is None):
        raise PlanError("--cuts and --replicas go together: give both, or neither")
    if len(profile.layers) < 1:
        raise PlanError("the profile has no layers")
    if cuts is not None and schedule == "auto":
        raise PlanError(
            "--cuts fixes the plan, so there is nothing for --schedule auto to choose: name a schedule"
        )
    if cuts is not None and replicas is not None:
        layers = [c.strip() for c in cuts.split(",") if c.strip()]
        counts = parse_int_list(replicas, "--replicas")
        plan = evaluate(
            profile, cluster, layers, counts, schedule, micro, optimizer, not no_comm, recompute, v
        )
    elif schedule == "auto":
        choice = _auto(profile, cluster, microbatches, optimizer, straight, solver, not no_comm, recompute)
        auto_table = _auto_table(choice, cluster.gpus, microbatches)
        plan, schedule, micro = choice.plan, choice.plan.schedule, choice.plan.microbatches
    else:
        plan = solve(
            profile, cluster, schedule, micro, optimizer, straight, solver, not no_comm, recompute, v
        )
    _check_replicas(plan)
    check_microbatches(profile, plan.schedule, plan.microbatches)  # (after the schedule's own checks)
    plan = replace(plan, profile=str(path), precision=profile.precision)
    name = profile.model if profile.tracer == "pipedream" else _model_name(profile.model)
    out_dir = Path(output) / re.sub(r"[^A-Za-z0-9_.-]+", "_", name or "model") / f"gpus={cluster.gpus}"
    plan = _write_plan(profile, plan, out_dir, weights, init)
    sim = simulate(plan, profile)
    if trace_path:
        write_chrome_trace(sim, trace_path)
    if as_json:
        click.echo(json.dumps(plan_to_json(plan), indent=1))
        return
    console = _console()
    console.print(_plan_table(plan, profile))
    console.print(_plan_summary(plan, sim, profile))
    charged = profile.extra.get("update_charged")
    if charged:
        whole = sum(n.param_bytes for n in profile.nodes) * charged["s_per_byte"] * 1e3
        console.print(
            f"stage compute includes the {optimizer} update of its weights (the profile measured "
            f"{whole:.2f} ms for the whole model; --optimizer to plan for another)",
            soft_wrap=True,
        )
    first = [e.end_s for e in sim.events if e.stage == 0 and e.kind == "B"]
    until = first[min(2, len(first) - 1)] if get_schedule(plan.schedule).stashes and first else None
    console.print("\n".join(gantt(sim, width=60, until_s=until)), highlight=False, markup=False)
    if auto_table is not None:
        console.print(auto_table)
    if explain:
        console.print(_explain(profile, cluster, plan, schedule, micro, optimizer, recompute))
    asked = plan.extra.get("microbatches_asked")
    if asked:
        console.print(
            f"[yellow]note:[/yellow] {plan.microbatches} microbatches instead of {asked}: the synchronous "
            "schedules give a stage's replicas microbatches round-robin: each replica count divides it",
            soft_wrap=True,
        )
    note = _microbatch_note(profile, plan)
    if note:
        console.print(f"[yellow]note:[/yellow] {note}", soft_wrap=True)
    console.print(f"wrote {out_dir}/plan.json and mp_conf.json")


def _auto(
    profile: Any, cluster: Any, micro: int | None, optimizer: str, straight: bool, solver: str, comm: bool,
    recompute: str,
) -> Any:  # fmt: skip
    """--schedule auto: every schedule's best plan (pipedream left out of an fp16 profile's), over the
    microbatch counts auto searches, or at ``micro`` when the user gave one."""
    from partitioner.optimizer.auto import AUTO_SCHEDULES, solve_auto
    from partitioner.optimizer.options import SolveOptions

    names = [s for s in AUTO_SCHEDULES if not (get_schedule(s).stashes and profile.precision == "fp16")]
    opts = SolveOptions("auto", micro or 4, optimizer, straight, solver, comm, recompute)
    return solve_auto(profile, cluster, opts, names, counts=(micro,) if micro else None)


def _auto_table(choice: Any, gpus: int, asked: int | None) -> Any:
    from rich.console import Group
    from rich.text import Text

    from partitioner.optimizer.pricing.schedules import model

    notes = []
    plans, chosen = choice.plans, choice.plan.schedule
    asked_virtual = [
        name for name, plan in plans.items() if plan is None and model(name).virtual_stages is None
    ]
    for name in asked_virtual if gpus >= 2 else ():  # (interleaved: v stages on each GPU, as asked)
        notes.append(f"{name} needs microbatches a multiple of the {gpus} GPUs and {2 * gpus}+ layers")
    if asked is None and len(choice.counts) == 1:
        notes.append("microbatches not searched: the profile has no fixed per-call times")
    elif asked is None:
        notes.append(f"microbatches searched: {', '.join(map(str, choice.counts))}")
    cols = ("schedule", "micro-\nbatches", "stages: replicas", "ms per\nminibatch", "vs best")
    table = _table("--schedule auto: each schedule's best plan", cols, ("schedule", "stages: replicas"))
    best = choice.times[chosen] or 1.0
    for name, plan in plans.items():
        label = name + (" (chosen)" if name == chosen else "")
        if plan is None:
            table.add_row(label, "-", "-", "no plan", "-")
            continue
        t = choice.times[name]
        table.add_row(label, str(plan.microbatches), _stages_cell(plan), f"{t * 1e3:.3f}", f"{t / best:.2f}x")
    return Group(table, *(Text(note) for note in notes))


def _stages_cell(plan: Any) -> str:
    """``3: 2+1+1`` (stages: replicas each); interleaved: ``8 on 4 GPUs (v=2)``; zbv: ``8 on 4 GPUs (V)``."""
    from partitioner.optimizer.pricing.schedules import model

    sched = model(plan.schedule)
    if sched.laid_out:
        shape = f"v={plan.virtual_stages}" if sched.virtual_stages is None else "V"
        return f"{len(plan.stages)} on {plan.cluster.gpus} GPUs ({shape})"
    return f"{len(plan.stages)}: " + "+".join(str(s.replicas) for s in plan.stages)


def _microbatch_note(profile: Any, plan: Any) -> str | None:
    """Say when layer times measured at one batch size are divided into microbatches of another (not
    when the profile measured fixed per-call times: the cost model then charges each microbatch its own)."""
    measured = profile.extra.get("measured_batch_size", profile.batch_size)
    if get_schedule(plan.schedule).stashes or not profile.batch_size or profile.tracer == "pipedream":
        return None
    if any(n.forward_fixed_ms or n.backward_fixed_ms for n in profile.nodes):
        return None
    micro = profile.batch_size / plan.microbatches
    if measured == micro:
        return None
    return (
        f"layer times measured at {measured} samples are scaled to microbatches of {micro:g}; small "
        f"batches cost more per sample, so for this plan profile with --batch-size {profile.batch_size} "
        f"--microbatch-size {max(1, int(micro))}"
    )


def _model_name(spec: str) -> str:
    from partitioner.models import model_name

    return model_name(spec)


# ----------------------------------------------------------------------------- verify
# (owned by code generation: partitioner/codegen.py, partitioner/verify.py)


@main.command()
@click.argument("package", required=False, type=click.Path(path_type=str))
@click.option("--seed", default=0, show_default=True, help="Initialisation seed of both models.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples in the minibatch [default: the plan's].")  # fmt: skip
@click.option("--models-dir", default="models", show_default=True, type=click.Path(path_type=str),
              help="Where to look for the newest package when PACKAGE is not given.")  # fmt: skip
@user_errors
def verify(package: str | None, seed: int, batch_size: int | None, models_dir: str) -> None:
    """Check a generated package against the original model: outputs, loss and every gradient.

    \b
    Stage by stage, as a rank builds it, against the same layers of the original model (its
    weights made one at a time), so the check holds one stage, never the model: outputs, loss,
    initial tensors and every gradient (float32, |a-b| <= 1e-5 + 1e-4*|b|); without --batch-size it
    checks the microbatch size each rank will run too. Exit code 0: they match;
    1: they differ; 2: the folder is not a valid package. PACKAGE defaults to the newest under ./models.

    \b
    Examples:
      pipeplan verify
      pipeplan verify models/vgg16/gpus=4 --batch-size 2
    """
    from pathlib import Path

    import torch

    from partitioner.verify import newest_package, run_batch_sizes, verify_package
    from runtime.heap import map_large_blocks

    folder = Path(package) if package is not None else newest_package(Path(models_dir))
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    map_large_blocks()  # weights are made and dropped one by one: give their memory back each time
    sizes = (batch_size,) if batch_size else run_batch_sizes(folder)
    reports = [verify_package(folder, seed=seed, batch_size=b) for b in sizes]
    for split in reports[:-1]:
        verdict = "[green]match[/green]" if split.ok else "[red]MISMATCH[/red]"
        _console().print(f"{verdict} at the microbatch size {split.batch_size} (what each rank runs)")
    report = next((r for r in reports if not r.ok), reports[-1])
    _console().print(_verify_table(report))
    for tie in report.ties:
        _console().print(f"tied: {tie} (gradients compared as their sum)", soft_wrap=True)
    verdict = "[green]match[/green]" if report.ok else "[red]MISMATCH[/red]"
    _console().print(
        f"{verdict}: {report.model}, {len(report.stages)} stages, batch {report.batch_size}, "
        f"seed {report.seed}; loss {report.loss:.6g} (|diff| {report.loss_error:.2e}), "
        f"output max |diff| {report.output_error:.2e}; tolerance rtol={report.rtol:g} atol={report.atol:g}",
        soft_wrap=True,
    )
    sys.exit(0 if report.ok else 1)


def _verify_table(report: Any) -> Any:
    cols = ("stage", "params", "reads", "returns", "init max\n|diff|", "grad max\n|diff|", "ok")
    table = _table(f"pipeplan verify {report.package}", cols, ("stage", "reads", "returns", "ok"))
    for s in report.stages:
        table.add_row(
            str(s.index), f"{s.params / 1e6:,.2f}M", "\n".join(_tail(n, 16) for n in s.in_names),
            "\n".join(_tail(n, 16) for n in s.out_names),
            f"{s.init_error:.2e}", f"{s.grad_error:.2e}", "[green]yes[/green]" if s.ok else "[red]NO[/red]",
        )  # fmt: skip
    return table


# ----------------------------------------------------------------------------- calibrate
# (partitioner/calibrate.py: measured stage times fed back into the profile)


def _newest_run(models_dir: str) -> Any:
    from pathlib import Path

    from partitioner.errors import PipeplanError

    found = sorted(Path(models_dir).glob("**/run/metrics.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise PipeplanError(f"no package under {models_dir}/ has a run/metrics.json; train one: pipeplan run")
    return found[-1].parent.parent


@main.command()
@click.argument("package", required=False, type=click.Path(file_okay=False, path_type=str))
@click.option("--metrics", "metrics_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="The run's metrics.json  [default: PACKAGE/run/metrics.json]")  # fmt: skip
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="The calibrated profile  [default: calibrated.json beside the profile]")  # fmt: skip
@click.option("--models-dir", default="models", show_default=True, type=click.Path(path_type=str),
              help="Where to look for the newest trained package when PACKAGE is not given.")  # fmt: skip
@click.option(
    "--accept-load",
    is_flag=True,
    help="Calibrate from a run measured while other work loaded the machine (refused otherwise).",
)
@user_errors
def calibrate(
    package: str | None, metrics_path: str | None, output: str | None, models_dir: str, accept_load: bool
) -> None:
    """Scale a profile's layer times to what a run measured per stage -> a calibrated profile.

    \b
    The profiler times each layer alone; `pipeplan run` measures each stage as it really runs
    (threads, microbatch size, neighbours, optimizer step). Plan again from what was measured:
      pipeplan run --steps 20
      pipeplan calibrate
      pipeplan partition --profile profiles/MODEL/calibrated.json --gpus N
    """
    from pathlib import Path

    from partitioner.calibrate import calibrate as calibrated
    from partitioner.calibrate import calibrated_device, device_seconds, load_run_times, load_verdict
    from partitioner.devices import save_device_model
    from partitioner.errors import PipeplanError
    from partitioner.graph import at_microbatches, load_profile, save_profile
    from partitioner.plan import load_plan
    from partitioner.update import with_update_time

    folder = Path(package) if package is not None else _newest_run(models_dir)
    plan = load_plan(folder / "plan.json")
    if not plan.profile:
        raise PipeplanError(f"{folder}/plan.json does not name the profile it was planned from")
    profile = with_update_time(load_profile(plan.profile), plan.optimizer)  # as partition priced it
    run = load_run_times(metrics_path or folder / "run" / "metrics.json")
    if run.model and plan.model and run.model != plan.model:
        raise PipeplanError(
            f"{run.source} measured {run.model}, but {folder} is a package of {plan.model}; "
            "give the metrics of a run of this package (PACKAGE/run/metrics.json)"
        )
    if run.precision != profile.precision:
        raise PipeplanError(
            f"{run.source} trained at {run.precision}, but {plan.profile} was measured at "
            f"{profile.precision}: calibrate from a run with --precision {profile.precision}, or profile "
            f"with --precision {run.precision}"
        )
    refusal, notes = load_verdict(plan, run)
    if refusal is not None and not accept_load:
        raise PipeplanError(refusal)
    for note in notes:
        _console(stderr=True).print(f"[yellow]note:[/yellow] {note}", soft_wrap=True)
    measured = device_seconds(plan, run)
    result = calibrated(profile, plan, measured, run.batch_size, run.source)
    path = Path(output) if output else Path(plan.profile).with_name("calibrated.json")
    save_profile(result, path)
    console = _console()
    forwards = 1 if get_schedule(plan.schedule).stashes else plan.microbatches
    console.print(_calibration_table(at_microbatches(profile, forwards), plan, measured))
    console.print(f"wrote {path}; next: pipeplan partition --profile {path} ...", soft_wrap=True)
    device = calibrated_device(profile, plan, measured, run.batch_size, run.source)
    if device is not None:
        where = save_device_model(device, path.with_name(f"{device.name}-calibrated.json"))
        console.print(
            f"the profile was estimated for {device.name}: its efficiencies corrected to matmul "
            f"{device.matmul_efficiency:.3f}, memory {device.memory_efficiency:.3f}, launch "
            f"{device.launch_s * 1e6:.1f} us; wrote {where} (pipeplan profile MODEL --device-model {where})",
            soft_wrap=True,
        )


def _calibration_table(profile: Any, plan: Any, measured_s: Any) -> Any:
    from partitioner.calibrate import stage_factors

    factors = stage_factors(profile, plan, measured_s)
    table = _table(f"{profile.model}: compute per minibatch", ("stage", "profiled", "measured", "factor"))
    for stage in plan.stages:
        profiled = sum(profile.node(n).compute_ms for n in stage.nodes)
        measured = measured_s.get(stage.index)
        table.add_row(str(stage.index), f"{profiled:.2f} ms", f"{measured * 1e3:.2f} ms" if measured else "-",
                      f"{factors[stage.index]:.2f}x" if stage.index in factors else "-")  # fmt: skip
    return table


# ----------------------------------------------------------------------------- run
# (owned by the runtime: runtime/)


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A click callback: refuse nan, inf and negative numbers (nan trains to a nan loss, exit 0)."""
    import math

    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"{value} is not a finite number >= 0", ctx, param)
    return value


@main.command()
@click.argument("package", required=False, type=click.Path(file_okay=False))
@click.option("--steps", type=click.IntRange(min=1), help="Minibatches to train (in total, with --resume).")
@click.option("--epochs", type=click.IntRange(min=1), help="Passes over the data (default 1) if no --steps.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Samples per minibatch [plan.json].")
@click.option("--microbatches", type=click.IntRange(min=1), help="Microbatches per minibatch [plan.json].")
@click.option("--schedule", type=click.Choice(SCHEDULES),
              help="[plan.json] zb1p: zero bubble H1, each backward split in B (input gradients, "
              "sent at once) and W (weight gradients, run later in the bubbles); exact as 1f1b. "
              "interleaved: Megatron's virtual stages, for a package partitioned with --schedule "
              "interleaved (several stages per rank); gloo only. zbv: zero bubble V, for a package "
              "partitioned with --schedule zbv (2 stages per rank as a V); gloo only.")  # fmt: skip
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto", show_default=True,
              help="auto: nccl when the ranks have GPUs, gloo on CPU.")  # fmt: skip
@click.option("--data", default="synthetic", show_default=True,
              help="synthetic (the package's example_inputs), module:fn or file.py:fn (a Dataset or "
              "DataLoader of (input, target)), imagefolder:DIR (DIR/<class>/<image>; sorted class names "
              "are the targets; images resized to the package's input shape; needs Pillow) or text:FILE "
              "(next-token windows of --seq-len tokens: bytes, or --tokenizer's ids).")  # fmt: skip
@click.option("--seq-len", type=click.IntRange(min=1), default=None,
              help="Tokens per window of text:FILE data "
              "(input tokens[i:i+N], target tokens[i+1:i+N+1]).")  # fmt: skip
@click.option("--tokenizer", type=click.Path(path_type=str), default=None,
              help="A local Hugging Face tokenizer folder for text:FILE data (needs transformers) "
              "[default: bytes, vocabulary 256]. Its ids must fit the model's vocabulary.")  # fmt: skip
@click.option("--data-workers", type=click.IntRange(min=0), default=1, show_default=True,
              help="DataLoader worker processes of each rank that reads imagefolder:/text: data "
              "(0: the rank reads itself).")  # fmt: skip
@click.option("--eval-data", default=None, metavar="SPEC",
              help="Held-out data, any --data form: evaluated forward-only (no dropout) every "
              "--eval-every steps and at the end; mean loss and class accuracy go to the progress "
              "line and metrics.json. Weights: those after the step (pipedream drains its pipeline "
              "there).")  # fmt: skip
@click.option("--eval-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Steps between evaluations of --eval-data (0: only at the end).")  # fmt: skip
@click.option("--optimizer", metavar="[sgd|adam|adamw]", default="sgd", show_default=True,
              help="adamw: Adam with decoupled weight decay.")  # fmt: skip
@click.option(
    "--lr", type=float, default=0.01, show_default=True, callback=_finite, help="Peak learning rate."
)
@click.option(
    "--momentum", type=float, default=0.0, show_default=True, callback=_finite, help="SGD momentum."
)
@click.option("--nesterov", is_flag=True, help="SGD with Nesterov momentum (needs --momentum).")
@click.option("--weight-decay", type=float, default=0.0, show_default=True,
              help="On every parameter: L2 penalty (sgd, adam), decoupled (adamw).")  # fmt: skip
@click.option("--betas", metavar="B1,B2", default="0.9,0.999", show_default=True, help="Adam(W)'s betas.")
@click.option("--lr-schedule", metavar="[constant|linear|cosine]", default="constant", show_default=True,
              help="After the warm-up; linear and cosine reach 0 at the last step.")  # fmt: skip
@click.option("--warmup-steps", type=int, default=0, show_default=True,
              help="Minibatches of linear warm-up from 0 to --lr. The schedule counts minibatches "
              "(a pipedream replica's step covers its round's).")  # fmt: skip
@click.option("--clip-grad-norm", type=float, default=None,
              help="Clip the whole model's gradient norm (all stages, tied weights once) to this "
              "(1f1b, gpipe, zb1p).")  # fmt: skip
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]),
              help="Forwards under autocast to bf16 or fp16 (float32 weights and optimizer state); fp16 "
              "adds dynamic loss scaling and needs a synchronous schedule  [plan.json's]")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Weights and data seed.")
@click.option("--weights", type=click.Path(exists=True, path_type=str), default=None,
              help="Start from these weights (a save_pretrained folder, .safetensors or state_dict file); "
              "each rank reads only its stage's tensors  [default: the package's]")  # fmt: skip
@click.option("--shuffle", is_flag=True, help="Shuffle a user dataset every epoch.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False),
              help="Where step-N/ checkpoints go (torch.distributed.checkpoint, keyed by the model's "
              "parameter names: they resume on any plan of the model)  "
              "[default: PACKAGE/run/checkpoints]")  # fmt: skip
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, help="Steps between checkpoints.")
@click.option("--no-checkpoint", is_flag=True,
              help="Save no checkpoint (by default the last step's, for `pipeplan export`).")  # fmt: skip
@click.option("--checkpoint-async", is_flag=True,
              help="Write checkpoints in the background: training goes on once each rank has copied "
              "its tensors.")  # fmt: skip
@click.option("--keep-checkpoints", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep only the newest N checkpoints (0: all), plus pinned ones (--pin-every, or a "
              "file named 'pinned' in a step folder).")  # fmt: skip
@click.option("--pin-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Never delete checkpoints of steps that are multiples of this (0: none).")  # fmt: skip
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint (of any plan of "
              "the model; another seed, schedule, data, optimizer setting or learning-rate horizon is "
              "refused unless --accept-changes).")  # fmt: skip
@click.option(
    "--accept-changes",
    is_flag=True,
    help="With --resume: continue with settings other than the checkpoint's (each is named).",
)
@click.option("--trace", type=click.Path(dir_okay=False), help="One Chrome trace of all ranks (Perfetto).")
@click.option("--tensorboard", type=click.Path(file_okay=False),
              help="Also write TensorBoard event files into this folder, one run per rank (needs "
              "`pip install 'pipeplan[tensorboard]'`). Every rank always logs one JSON line per step "
              "to PACKAGE/run/steps/rankR.jsonl.")  # fmt: skip
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True), default=None,
              help="One device's peak dense TFLOP/s at the run's precision, for the model FLOP "
              "utilisation (MFU)  [default: the spec sheet's for known GPUs; none on CPUs]")  # fmt: skip
@click.option("--config", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A run.toml of options (keys as these options: steps = 100); flags given here win. "
              "Each run writes its options to PACKAGE/run/run.toml.")  # fmt: skip
@click.option("--measure-memory", is_flag=True,
              help="On a CPU, also measure each rank's peak tensor memory over its first ranks+1 minibatches "
              "by counting the storages its operators make (opt-in: a Python call per operator in those "
              "steps; GPUs always report torch.cuda.max_memory_allocated).")  # fmt: skip
@_node_options
@click.option("--dry-run", is_flag=True, help="Print each node's torchrun command instead of running.")
@user_errors
def run(package: str | None, dry_run: bool, **opts: Any) -> None:
    """Train a generated PACKAGE on its ranks (default: the newest under ./models).

    \b
    Examples:
      pipeplan run --steps 20
      pipeplan run models/vgg16/gpus=4 --schedule 1f1b --microbatches 8 --trace trace.json
      pipeplan run PKG --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
    """
    from pathlib import Path

    from runtime.config import newest_package
    from runtime.optim import parse_betas
    from runtime.options import RunOptions

    package = _with_config(click.get_current_context(), package, opts)
    if opts["steps"] and opts["epochs"]:
        raise click.UsageError("give --steps or --epochs, not both")
    folder = Path(package) if package is not None else newest_package("models")
    if opts.pop("no_checkpoint"):
        keys = ("checkpoint_dir", "checkpoint_every", "checkpoint_async", "resume")
        given = [f"--{k.replace('_', '-')}" for k in keys if opts[k]]
        if given:
            raise click.UsageError(f"--no-checkpoint contradicts {', '.join(given)}; drop one of them")
    elif opts["checkpoint_dir"] is None:
        opts["checkpoint_dir"] = folder / "run" / "checkpoints"
    for key in ("checkpoint_dir", "trace"):
        opts[key] = str(opts[key]) if opts[key] is not None else None
    opts["betas"] = parse_betas(opts["betas"])
    options = RunOptions(package=str(folder), **opts)
    _check_optim(options)
    if dry_run:
        from runtime.launch import schedule_preview, torchrun_commands

        for line in torchrun_commands(options):
            click.echo(line)
        for line in schedule_preview(options):
            click.echo(f"# {line}")
        return
    _run_and_report(options)


@main.command()
@click.option("--gpus", type=click.IntRange(min=1), default=2, show_default=True,
              help="Ranks on this machine (GPUs, or CPU processes), as `run` would start.")  # fmt: skip
@click.option("-o", "--output", default="cluster.json", show_default=True, type=click.Path(dir_okay=False),
              help="The cluster file to write, for `partition --cluster FILE`.")  # fmt: skip
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="cpu: gloo (CPU processes), cuda: NCCL (GPUs), auto: cuda if there is one.")  # fmt: skip
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Repetitions of every figure (the spread is over them).")  # fmt: skip
@click.option("--messages", type=click.IntRange(min=1), default=20, show_default=True,
              help="Round trips (or all-reduces) per round.")  # fmt: skip
@_node_options
@user_errors
def probe(gpus: int, output: str, device: str, **opts: Any) -> None:
    """Measure the links between the ranks a run would use (latency, bandwidth, all-reduce) and write
    a cluster file that `partition --cluster FILE` reads.

    \b
    Examples:
      pipeplan probe --gpus 4 -o cluster.json
      pipeplan probe --gpus 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
    """
    from pathlib import Path

    from runtime.probe import ProbeOptions, probe_device, run_probe

    options = ProbeOptions(gpus=gpus, device=probe_device(device), **opts)
    _console(stderr=True).print(f"probing {options.gpus * options.nnodes} ranks ({options.device}) ...")
    outcome = run_probe(options, Path(output), " ".join(["pipeplan", *sys.argv[1:]]))
    if outcome is None:
        return  # another node: node 0 writes the file
    table = _table(
        f"links, {outcome.ranks} ranks on {outcome.backend} -> {output}", outcome.columns, ["level"]
    )
    for row in outcome.rows:
        table.add_row(*row)
    _console().print(table)
    for line in outcome.notes:
        _console().print(line)


def _with_config(ctx: click.Context, package: str | None, opts: dict[str, Any]) -> str | None:
    """Fill the options not given on the command line from ``--config``'s run.toml, through click's own
    conversions and checks; returns the package (the command line's, else the file's)."""
    from click.core import ParameterSource

    from runtime.run_config import read_config

    path = opts.pop("config")
    if path is None:
        return package
    options = [p for p in ctx.command.params if p.name and p.name not in ("package", "dry_run", "config")]
    values = read_config(path, [p.name for p in options if p.name] + ["package"])
    for param in options:
        if param.name in values and ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT:
            opts[param.name] = param.process_value(ctx, values[param.name])
    return package if package is not None else values.get("package")


def _check_optim(options: Any) -> None:
    """Bad optimizer and precision settings fail here, before any rank starts; a warm-up longer than the
    run, or a precision other than the plan's, is legal but worth a note."""
    from runtime.optim import OptimSettings
    from runtime.worker import job_of

    settings = OptimSettings.of(options)
    job = job_of(options)
    settings.check_schedule(job.schedule)
    if job.precision != job.plan_precision:
        _console(stderr=True).print(
            f"[yellow]note:[/yellow] training at {job.precision}, but the plan was made for "
            f"{job.plan_precision}: its predicted time and memory are {job.plan_precision}'s (profile and "
            f"partition with --precision {job.precision} for a plan of this run)",
            soft_wrap=True,
        )
    if options.steps is not None and settings.warmup_steps >= options.steps:
        _console(stderr=True).print(
            f"[yellow]note:[/yellow] --warmup-steps {settings.warmup_steps} is not below --steps "
            f"{options.steps}: the learning rate stays below --lr for the whole run",
            soft_wrap=True,
        )


def _run_and_report(options: Any) -> None:
    """Launch with a progress bar fed by the loss-reporting rank, then print measured vs predicted."""
    from runtime.launch import holding_run_folder

    with holding_run_folder(options):  # one job per package folder, from the first check to the end
        _report_run(options)


def _report_run(options: Any) -> None:
    from pathlib import Path

    from runtime.data import SYNTHETIC_STEPS
    from runtime.errors import Interrupted, JobFailed
    from runtime.launch import check_launch, launch, resolve_resume

    per_node = check_launch(options)
    options, notes = resolve_resume(options)
    for note in notes:
        _console(stderr=True).print(note, soft_wrap=True, markup=False)
    total = options.steps or (
        (options.epochs or 1) * SYNTHETIC_STEPS if options.data == "synthetic" else None
    )
    with _progress(transient=False) as bar:
        task = bar.add_task(f"training {Path(options.package).name}", total=total)

        held_out = ""

        def on_progress(step: int, loss: float, evaluation: dict[str, Any] | None = None) -> None:
            nonlocal held_out
            if evaluation is not None:
                held_out = _eval_text(evaluation)
            bar.update(task, completed=step, description=f"step {step} loss {loss:.4f}{held_out}")

        try:
            metrics = launch(options, on_progress, per_node)
        except (JobFailed, Interrupted) as exc:
            bar.stop()
            from rich.markup import escape

            failed = isinstance(exc, JobFailed)
            _console(stderr=True).print(
                f"[red]error:[/red] {'training failed: ' if failed else ''}{escape(str(exc))}", soft_wrap=True
            )
            sys.exit(1 if isinstance(exc, JobFailed) else 128 + exc.signum)
    if metrics is not None:
        path = Path(options.run_dir or Path(options.package) / "run") / "metrics.json"
        _print_run_table(metrics, path, options.checkpoint_dir)


def _eval_text(evaluation: dict[str, Any]) -> str:
    """`` eval 1.2345 (acc 67.8%)`` for the progress line."""
    accuracy = evaluation.get("accuracy")
    return f" eval {evaluation['loss']:.4f}" + (f" acc {accuracy:.1%}" if accuracy is not None else "")


def _print_run_table(metrics: dict[str, Any], path: object, checkpoints: object = None) -> None:
    def ms(value: float | None) -> str:
        return f"{value * 1e3:.2f} ms" if value is not None else "-"

    ratio = metrics.get("ratio_measured_over_predicted")
    micro, ranks_n = metrics["microbatches"], metrics["world_size"]
    title = (
        f"{metrics['schedule']}, {_plural(micro, 'microbatch', 'microbatches')}, {_plural(ranks_n, 'rank')}"
    )
    table = _table(title, ("", "measured", "predicted\n(plan.json)", "measured/\npredicted"), ("",))
    table.add_row(
        "time per minibatch",
        ms(metrics["time_per_minibatch_s"]),
        ms(metrics["predicted_time_per_minibatch_s"]),
        f"{ratio:.2f}" if ratio is not None else "-",
    )
    ranks = _table("per rank (seconds over all steps)", ("rank", "stage", "compute", "comm", "idle"))
    for r in metrics["ranks"]:
        ranks.add_row(
            str(r["rank"]),
            ",".join(map(str, r.get("hosted") or ())) or str(r["stage"]),
            *(f"{r[k]:.3f}" for k in ("compute_s", "comm_s", "idle_s")),
        )
    console = _console()
    console.print(table)
    console.print(ranks)
    if (metrics.get("memory") or {}).get("method"):
        console.print(_memory_table(metrics["memory"]))
    losses = metrics["losses"]
    if losses:
        console.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    evals = metrics.get("eval") or []
    if evals:
        steps = ", ".join(f"step {e['step']}{_eval_text(e)}" for e in evals)
        console.print(f"held-out: {steps}", soft_wrap=True)
    console.print(f"metrics: {path}")
    if checkpoints is not None:
        console.print(f"checkpoints: {checkpoints} (`pipeplan export -o model.safetensors` reads the newest)")
    if ratio is None or 0.8 <= ratio <= 1.25:
        return
    share = _cpu_share(metrics)
    shared = (
        f"; the ranks had {share:.0%} of a core while computing ({_cores()} cores for "
        f"{len(metrics['ranks'])} ranks here, other jobs included)"
        if share is not None and share < 0.85
        else ""
    )
    console.print(
        f"[yellow]note:[/yellow] measured/predicted {ratio:.2f}{shared}: `pipeplan calibrate` feeds the "
        "measured stage times back into the profile, so the next `pipeplan partition` plans with them",
        soft_wrap=True,
    )


def _memory_table(memory: dict[str, Any]) -> Any:
    """Per stage: the peak memory its ranks measured next to the plan's prediction."""
    from partitioner.optimizer.pricing.price import gib

    title = f"peak memory per device ({memory['method']}, first {memory['window_minibatches']} minibatches)"
    table = _table(title, ("stage", "measured", "predicted\n(plan.json)", "measured/\npredicted"))
    for s in memory["stages"]:
        got, want, ratio = s["measured_peak_bytes"], s["predicted_bytes"], s["ratio_measured_over_predicted"]
        table.add_row(str(s["stage"]), gib(got) if got is not None else "-", gib(want) if want else "-",
                      f"{ratio:.2f}" if ratio is not None else "-")  # fmt: skip
    return table


# ----------------------------------------------------------------------------- export
# (runtime/export.py: a run's stage checkpoints merged into the original model's state_dict)


@main.command()
@click.argument("package", required=False, type=click.Path(file_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="model.safetensors (safetensors; sharded with an index above --max-shard-size), or "
              "model.pt (torch.save of the model's state_dict()).")  # fmt: skip
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="The checkpoint step to export  [default: the newest complete one]")  # fmt: skip
@click.option("--checkpoint-dir", type=click.Path(file_okay=False),
              help="Where the run wrote step-N/ (a run of any plan of the model)  "
              "[default: PACKAGE/run/checkpoints]")  # fmt: skip
@click.option("--hf-dir", type=click.Path(file_okay=False),
              help="hf: models: the from_pretrained folder (config and safetensors)  [default: beside "
              "-o, named after it: model.pt -> model-hf/]")  # fmt: skip
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="The largest safetensors file; above it the weights are sharded with an index "
              "(Hugging Face's layout). Memory holds one shard at a time.")  # fmt: skip
@click.option("--seed", type=int, default=None,
              help="Seed of tensors no stage holds (never trained; state_dict files only)  "
              "[default: the run's]")  # fmt: skip
@user_errors
def export(
    package: str | None, output: str, step: int | None, checkpoint_dir: str | None, hf_dir: str | None,
    max_shard_size: str, seed: int | None,
) -> None:  # fmt: skip
    """Write a run's checkpoint as the original model's weights.

    \b
    The files load into the model the package was made from:
      pipeplan export -o model.safetensors   (safetensors.torch.load_file)
      pipeplan export -o model.pt            (model.load_state_dict(
                                              torch.load(...), strict=True))

    An hf: model also gets a from_pretrained folder (config and safetensors
    shards). PACKAGE (any plan of the model) defaults to the newest under
    ./models, --step to the newest complete checkpoint.
    """
    from pathlib import Path

    from partitioner.optimizer.units import parse_bytes
    from runtime.config import newest_package
    from runtime.export import export_checkpoint

    folder = Path(package) if package is not None else newest_package("models")
    most = int(parse_bytes(max_shard_size))
    done = export_checkpoint(folder, output, step, checkpoint_dir, hf_dir, seed, most)
    console, merged = _console(), done.merged
    for line in done.skipped:
        _console(stderr=True).print(f"skipped {line}", soft_wrap=True, markup=False)
    shards = f" ({len(done.files)} shards)" if done.path.name.endswith(".index.json") else ""
    console.print(
        f"wrote {done.path}{shards}: step {done.step} of {folder}, {len(merged.loaded)} tensors from the "
        f"checkpoint" + (f", {len(merged.tied)} tied names filled in" if merged.tied else ""),
        soft_wrap=True,
        markup=False,
    )
    if merged.untrained:
        kept = (
            "left out (from_pretrained initialises them)"
            if done.path.suffix in (".safetensors", ".json")
            else f"kept at full_model(seed={done.seed})'s values, untrained"
        )
        console.print(
            f"[yellow]note:[/yellow] no stage holds {len(merged.untrained)} tensors (e.g. "
            f"{merged.untrained[0]}): {kept}",
            soft_wrap=True,
        )
    if merged.tie_max_diff > 0:
        console.print(
            f"[yellow]note:[/yellow] the stages' copies of a tied weight differ by up to "
            f"{merged.tie_max_diff:.3g}; the first stage's copy was kept",
            soft_wrap=True,
        )
    if done.hf_dir is not None:
        console.print(
            f"wrote {done.hf_dir} (config and safetensors; from_pretrained reads it)", soft_wrap=True
        )


@main.command("export-plan")
@click.argument("package", required=False, type=click.Path(file_okay=False))
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="The folder to write  [default: PACKAGE/torch]")  # fmt: skip
@click.option("--schedule", type=click.Choice(["1f1b", "gpipe", "zb1p", "interleaved", "zbv"]), default=None,
              help="[plan.json]")  # fmt: skip
@user_errors
def export_plan(package: str | None, output: str | None, schedule: str | None) -> None:
    """Write a straight plan in the forms torch.distributed.pipelining and torchtitan read.

    \b
    schedule.csv     each rank's actions for one minibatch, as
                     _PipelineScheduleRuntime._load_csv reads them
    stages.json      each stage's rank, module FQNs, inputs and outputs
    torchtitan.toml  the [parallelism] settings that use them

    Each stage's module is the package's stage(k). Torch cannot run replicated
    stages, pipedream's asynchrony, or a tensor that skips a stage: such plans
    are refused.

    \b
    Example:
      pipeplan partition --gpus 4 --straight --schedule 1f1b && pipeplan export-plan
    """
    from pathlib import Path

    from runtime.config import newest_package
    from runtime.torch_plan import export_torch_plan

    folder = Path(package) if package is not None else newest_package("models")
    out = Path(output) if output is not None else folder / "torch"
    plan = export_torch_plan(folder, out, schedule)
    _console().print(
        f"wrote {out}/schedule.csv, stages.json, torchtitan.toml: {len(plan.stages)} stages, "
        f"{plan.schedule}, {plan.microbatches} microbatches per minibatch of {plan.batch_size}",
        soft_wrap=True,
        markup=False,
    )


@main.command("convert-checkpoint")
@click.argument("checkpoint_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--package", "package", required=True, type=click.Path(file_okay=False, exists=True),
              help="The package whose run wrote the checkpoints.")  # fmt: skip
@click.option(
    "--step", type=click.IntRange(min=0), default=None, help="Only this step  [default: every old one]"
)
@user_errors
def convert_checkpoint(checkpoint_dir: str, package: str, step: int | None) -> None:
    """Rewrite per-stage checkpoints of an earlier pipeplan (step-N/stageK.pt) in today's format.

    Today's checkpoints are torch.distributed.checkpoint folders keyed by the
    model's parameter names: they resume on any plan of the model (pipeplan run
    PKG --resume) and export like any other. The old files move to step-N.v1/.

    \b
      pipeplan convert-checkpoint models/vgg16/gpus=2/run/checkpoints \\
          --package models/vgg16/gpus=2
    """
    from pathlib import Path

    from runtime.checkpoint_v1 import convert

    done = convert(Path(checkpoint_dir), Path(package), step)
    _console().print(
        f"converted {', '.join(f'step-{s}' for s in done)} of {checkpoint_dir} (old files in step-N.v1/)",
        soft_wrap=True,
        markup=False,
    )


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def _cpu_share(metrics: dict[str, Any]) -> float | None:
    """The share of a core the CPU ranks had while computing (their compute CPU time over wall time);
    None on GPUs or when the run recorded no CPU time."""
    ranks = metrics.get("ranks", [])
    wall = sum(float(r.get("compute_s", 0.0)) for r in ranks)
    cpu = sum(float(r.get("compute_cpu_s", 0.0)) for r in ranks)
    if metrics.get("device", "cpu") != "cpu" or wall <= 0 or cpu <= 0:
        return None
    return min(1.0, cpu / wall)


if __name__ == "__main__":
    main()
