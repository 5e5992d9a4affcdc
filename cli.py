"""The ``pipeplan`` command: profile -> partition -> verify -> run.

Each command is parse -> call -> render: click declares and parses the options, one call into the
library (partitioner/, runtime/) does the work and returns a value, and cli_render/ prints it with
rich. The library and the renderers are imported lazily, inside the commands (only the error
handling, light, at the top), so ``pipeplan --help`` stays fast.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click
from click.core import ParameterSource

from cli_render.errors import F, OneLineErrors, user_errors
from runtime.schedule import SCHEDULES

__all__ = ["main"]


@click.group(
    cls=OneLineErrors,
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
    "while the weights take at most an eighth of the free memory, and layer for a model that repeats a "
    "block 8 times or more unless fixed per-call times are measured (--batch-size 2 or more).",
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
    model: str, output: str | None, batch_size: int, input_shape: str | None, device: str, dtype: str,
    leaf_modules: tuple[str, ...], repeats: int, clock: str, threads: int | None,
    microbatch_size: int | None, fixed_cost: bool, precision: str, materialize: str, reuse: bool,
    device_model: str | None, top: int, as_json: bool,
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

    from cli_render.profile import print_profile
    from cli_render.progress import progress as progress_bar
    from partitioner.graph import profile_to_json, save_profile
    from partitioner.profiler import profile_model
    from partitioner.profiler.request import prepare

    ctx = click.get_current_context()
    given = [name for name in ctx.params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE]
    shape, path = prepare(model, output, batch_size, input_shape, dtype, precision, device_model, given)
    with progress_bar(transient=True) as bar:
        task = bar.add_task(f"tracing {model}", total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=f"measuring {name}")

        result = profile_model(
            model, batch_size, shape, device, dtype, leaf_modules, repeats, progress, clock, threads,
            microbatch_size, precision, fixed_cost, materialize=materialize, reuse=reuse,
            device_model=device_model,
        )  # fmt: skip
        bar.update(task, description="whole-step timing")
    save_profile(result, path)
    if as_json:
        click.echo(json.dumps(profile_to_json(result), indent=1))
        return
    print_profile(result, path, top, clock)


# ----------------------------------------------------------------------------- partition


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
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=None,
              help="Split every stage over T devices of one node (docs/layout-3d.md); the cuts, copies, "
              "schedule and microbatches are searched.  [default: searched by --schedule auto where the "
              "profile has layers to split]")  # fmt: skip
@click.option("--shard", type=click.Choice(["none", "optimizer", "gradients", "full"]), default=None,
              help="What every stage's data-parallel copies share: nothing, the optimizer state (ZeRO-1), "
              "gradients too (ZeRO-2) or everything (FSDP).  [default: searched]")  # fmt: skip
@click.option("--explain", is_flag=True, help="Also show the baselines other tools pick.")
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
    replicas: str | None, tensor_parallel: int | None, shard: str | None, explain: bool,
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
      pipeplan partition --cluster dgx-h100:8 --tensor-parallel 8 --shard optimizer
    """
    import json

    from cli_render.common import note
    from cli_render.plan import print_partition
    from partitioner.partition import PartitionRequest
    from partitioner.partition import partition as write_plan
    from partitioner.plan import plan_to_json

    params = click.get_current_context().params
    done = write_plan(PartitionRequest(**{k: v for k, v in params.items() if k != "as_json"}), note)
    if as_json:
        click.echo(json.dumps(plan_to_json(done.plan), indent=1))
        return
    print_partition(done, optimizer, microbatches)


# ----------------------------------------------------------------------------- verify


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

    from cli_render.verify import print_verify, verify_with_progress
    from partitioner.verify import newest_package, run_batch_sizes
    from runtime.heap import map_large_blocks

    folder = Path(package) if package is not None else newest_package(Path(models_dir))
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    map_large_blocks()  # weights are made and dropped one by one: give their memory back each time
    sizes = (batch_size,) if batch_size else run_batch_sizes(folder)
    reports = verify_with_progress(folder, sizes, seed)
    sys.exit(0 if print_verify(reports).ok else 1)


# ----------------------------------------------------------------------------- calibrate


@main.command()
@click.argument("packages", nargs=-1, type=click.Path(file_okay=False, path_type=str))
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="The run to calibrate from  [default: the newest, PACKAGE/run]")  # fmt: skip
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
@click.option("--trace", "traces", multiple=True, type=click.Path(dir_okay=False, path_type=str),
              help="A package's run's Chrome trace (run --trace); repeat for several packages, in their "
                   "order.")  # fmt: skip
@click.option("--cluster", type=click.Path(dir_okay=False, path_type=str),
              help="A cluster file the traces' messages and all-reduces correct, in place.")  # fmt: skip
@user_errors
def calibrate(packages: tuple[str, ...], metrics_path: str | None, run_dir: str | None, **opts: Any) -> None:
    """Scale a profile's layer times to what runs measured per stage -> a calibrated profile.

    \b
    The profiler times each layer alone; `pipeplan run` measures each stage as it really runs
    (threads, microbatch size, neighbours, optimizer step). Plan again from what was measured:
      pipeplan run --steps 20
      pipeplan calibrate
      pipeplan partition --profile profiles/MODEL/calibrated.json --gpus N
    Several packages of one profile (PACKAGE...: each one's newest run) calibrate together, each
    layer scaled by the median of its runs, so that one noisy run does not set the scale.
    A traced run's messages and gradient all-reduces correct a probed cluster file's latencies too
    (a --trace per package, in order: a pipeline's messages and a data-parallel plan's all-reduces):
      pipeplan calibrate --trace trace.json --cluster cluster.json
    """
    from pathlib import Path

    from cli_render.calibrate import print_calibration
    from partitioner.calibrate import newest_run
    from partitioner.link_calibration import calibrate_with_links

    folders = [Path(p) for p in packages] or [newest_run(opts["models_dir"])]
    if metrics_path is None and run_dir is not None:
        metrics_path = str(Path(run_dir) / "metrics.json")
    kept = (opts["output"], opts["accept_load"], opts["traces"], opts["cluster"])
    print_calibration(*calibrate_with_links(folders, metrics_path, *kept))


# ----------------------------------------------------------------------------- run


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A click callback: refuse nan, inf and negative numbers (nan trains to a nan loss, exit 0)."""
    import math

    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"{value} is not a finite number >= 0", ctx, param)
    return value


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


@main.command()
@click.argument("package", required=False, type=click.Path(file_okay=False))
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    help="Minibatches in all, resumed ones included  [default: one epoch; synthetic: 8]",
)
@click.option(
    "--epochs", type=click.IntRange(min=1), help="Passes over the data without --steps  [default: 1]"
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), help="Samples per minibatch  [default: plan.json's]"
)
@click.option("--microbatches", type=click.IntRange(min=1), help="Per minibatch  [default: plan.json's]")
@click.option("--schedule", type=click.Choice(SCHEDULES), help="[default: plan.json's]")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto", show_default=True,
              help="auto: nccl on GPUs, gloo on CPUs.")  # fmt: skip
@click.option("--data", default="synthetic", show_default=True,
              help="Or module:fn, file.py:fn, imagefolder:DIR, text:FILE.")  # fmt: skip
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="Tokens per window of text: data.")
@click.option("--tokenizer", type=click.Path(path_type=str), default=None,
              help="A local tokenizer folder for text: data  [default: bytes]")  # fmt: skip
@click.option("--data-workers", type=click.IntRange(min=0), default=1, show_default=True,
              help="DataLoader workers per reading rank.")  # fmt: skip
@click.option("--eval-data", default=None, metavar="SPEC", help="Held-out data (any --data form).")
@click.option("--eval-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Steps between evaluations (0: at the end).")  # fmt: skip
@click.option("--optimizer", metavar="[sgd|adam|adamw]", default="sgd", show_default=True)
@click.option(
    "--lr", type=float, default=0.01, show_default=True, callback=_finite, help="Peak learning rate."
)
@click.option(
    "--momentum", type=float, default=0.0, show_default=True, callback=_finite, help="SGD momentum."
)
@click.option("--nesterov", is_flag=True, help="SGD with Nesterov momentum.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True,
              help="L2 (sgd, adam), decoupled (adamw).")  # fmt: skip
@click.option("--betas", metavar="B1,B2", default="0.9,0.999", show_default=True, help="Adam(W)'s betas.")
@click.option("--lr-schedule", metavar="[constant|linear|cosine]", default="constant", show_default=True,
              help="After the warm-up.")  # fmt: skip
@click.option("--warmup-steps", type=int, default=0, show_default=True, help="Linear warm-up from 0.")
@click.option("--clip-grad-norm", type=float, default=None, help="Clip the whole model's gradient norm.")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]),
              help="Autocast  [default: plan.json's]")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Weights and data seed.")
@click.option("--weights", type=click.Path(exists=True, path_type=str), default=None,
              help="Initial weights  [default: the package's]")  # fmt: skip
@click.option("--shuffle", is_flag=True, help="Shuffle a user dataset every epoch.")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="[default: a new PACKAGE/runs/<time>/]")  # fmt: skip
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="[default: RUN-DIR/checkpoints]")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0,
              help="Steps between checkpoints  [default: the last]")  # fmt: skip
@click.option("--no-checkpoint", is_flag=True, help="Save none (export reads one).")
@click.option("--checkpoint-async", is_flag=True, help="Write checkpoints in the background.")
@click.option("--keep-checkpoints", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep the newest N (0: all) and pinned.")  # fmt: skip
@click.option("--pin-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep steps that are multiples of N.")  # fmt: skip
@click.option("--resume", is_flag=True, help="Continue the newest run's checkpoint.")
@click.option("--accept-changes", is_flag=True, help="With --resume: allow changed settings.")
@click.option("--trace", type=click.Path(dir_okay=False), help="A Chrome trace of all ranks.")
@click.option("--tensorboard", type=click.Path(file_okay=False), help="Also write TensorBoard events here.")
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True), default=None,
              help="A device's peak, for MFU  [default: known GPUs']")  # fmt: skip
@click.option("--config", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A run.toml of options; flags win.")  # fmt: skip
@click.option("--measure-memory", is_flag=True, help="On a CPU, count peak tensor memory.")
@_node_options
@click.option("--dry-run", is_flag=True, help="Print the torchrun commands instead.")
@user_errors
def run(package: str | None, dry_run: bool, **opts: Any) -> None:
    """Train a generated PACKAGE on its ranks (default: the newest under ./models).

    Each option is described in docs/run.md.

    \b
    Examples:
      pipeplan run --steps 20
      pipeplan run models/vgg16/gpus=4 --schedule 1f1b --trace trace.json
      pipeplan run PKG --resume --steps 100 --checkpoint-every 20
      pipeplan run --nnodes 2 --node-rank 0 --master-addr h0 --master-port 29500
    """
    from pathlib import Path

    from cli_render.common import note
    from cli_render.run import train
    from runtime.config import newest_package
    from runtime.launch import holding_run_folder
    from runtime.optim import parse_betas
    from runtime.options import RunOptions
    from runtime.run_checks import check_run
    from runtime.runs import begin as begin_run
    from runtime.runs import discard_if_empty

    package = _with_config(click.get_current_context(), package, opts)
    if opts["steps"] and opts["epochs"]:
        raise click.UsageError("give --steps or --epochs, not both")
    folder = Path(package) if package is not None else newest_package("models")
    checkpoints = not opts.pop("no_checkpoint")
    if not checkpoints:
        keys = ("checkpoint_dir", "checkpoint_every", "checkpoint_async", "resume")
        given = [f"--{k.replace('_', '-')}" for k in keys if opts[k]]
        if given:
            raise click.UsageError(f"--no-checkpoint contradicts {', '.join(given)}; drop one of them")
    for key in ("checkpoint_dir", "trace", "run_dir"):
        opts[key] = str(opts[key]) if opts[key] is not None else None
    opts["betas"] = parse_betas(opts["betas"])
    options = RunOptions.of(str(folder), **opts)
    for line in check_run(options):
        note(line)
    if dry_run:
        from runtime.launch import schedule_preview, torchrun_commands
        from runtime.runs import begin

        options = begin(options, checkpoints, create=False)
        for line in torchrun_commands(options):
            click.echo(line)
        for line in schedule_preview(options):
            click.echo(f"# {line}")
        return
    with holding_run_folder(options):  # one job per package folder, from the first check to the end
        options = begin_run(options, checkpoints)
        try:
            train(options)
        finally:
            discard_if_empty(options)


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
@click.option("--idle", is_flag=True, help="Measure CPU ranks idle, not computing on a run's threads "
              "as by default (GPU ranks: never loaded).")  # fmt: skip
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

    from cli_render.probe import print_probe
    from runtime.probe import ProbeOptions, probe_device, run_probe

    options = ProbeOptions(gpus=gpus, device=probe_device(device), **opts)
    print_probe(
        options, lambda: run_probe(options, Path(output), " ".join(["pipeplan", *sys.argv[1:]])), output
    )


def _with_config(ctx: click.Context, package: str | None, opts: dict[str, Any]) -> str | None:
    """Fill the options not given on the command line from ``--config``'s run.toml, through click's own
    conversions and checks; returns the package (the command line's, else the file's)."""

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


# ----------------------------------------------------------------------------- export


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
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="The run whose checkpoints to export  [default: the newest, PACKAGE/run]")  # fmt: skip
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
    package: str | None, output: str, step: int | None, checkpoint_dir: str | None, run_dir: str | None,
    hf_dir: str | None,
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

    from cli_render.export import print_export
    from partitioner.optimizer.units import parse_bytes
    from runtime.config import newest_package
    from runtime.export import export_checkpoint

    folder = Path(package) if package is not None else newest_package("models")
    most = int(parse_bytes(max_shard_size))
    if checkpoint_dir is None and run_dir is not None:
        checkpoint_dir = str(Path(run_dir) / "checkpoints")
    print_export(export_checkpoint(folder, output, step, checkpoint_dir, hf_dir, seed, most), folder)


@main.command("export-plan")
@click.argument("package", required=False, type=click.Path(file_okay=False))
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="The folder to write  [default: PACKAGE/torch]")  # fmt: skip
@click.option("--schedule", type=click.Choice(["1f1b", "gpipe", "zb1p", "interleaved", "zbv"]), default=None,
              help="[plan.json]")  # fmt: skip
@user_errors
def export_plan(package: str | None, output: str | None, schedule: str | None) -> None:
    """Write a straight or 3D plan in the forms torch.distributed.pipelining and torchtitan read.

    \b
    schedule.csv     each rank's actions for one minibatch, as
                     _PipelineScheduleRuntime._load_csv reads them
    stages.json      each stage's rank, module FQNs, inputs and outputs
    torchtitan.toml  the [parallelism] settings that use them

    Each stage's module is the package's stage(k). A 3D plan (one t x d and
    shard level for every stage) is written as one copy's pipeline with
    torchtitan's tensor and data-parallel degrees (its optimizer and gradients
    levels as FSDP kept unsharded: torchtitan has no ZeRO-1). Torch cannot run
    replicated stages of different widths, pipedream's asynchrony, or a tensor
    that skips a stage: such plans are refused.

    \b
    Example:
      pipeplan partition --gpus 4 --straight --schedule 1f1b && pipeplan export-plan
    """
    from pathlib import Path

    from cli_render.common import console
    from runtime.config import newest_package
    from runtime.torch_plan import export_torch_plan

    folder = Path(package) if package is not None else newest_package("models")
    out = Path(output) if output is not None else folder / "torch"
    plan = export_torch_plan(folder, out, schedule)
    console().print(
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

    from cli_render.common import console
    from runtime.checkpoint_v1 import convert

    done = convert(Path(checkpoint_dir), Path(package), step)
    console().print(
        f"converted {', '.join(f'step-{s}' for s in done)} of {checkpoint_dir} (old files in step-N.v1/)",
        soft_wrap=True,
        markup=False,
    )


if __name__ == "__main__":
    main()
