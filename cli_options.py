"""The options of `pipeplan profile`, `partition` and `run` (and the node options `run` shares with
`probe`): click declares, converts and checks them here, each stack one decorator that cli.py puts
on its command, so that cli.py reads as its commands (help, parse, call, render).

An option's help is what ``pipeplan CMD --help`` prints; each option of `run` is described in
docs/run.md.
"""

from __future__ import annotations

from typing import Any

import click

from cli_render.errors import F
from runtime.schedule import SCHEDULES

__all__ = ["node_options", "partition_options", "profile_options", "run_options"]


def finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A click callback: refuse nan, inf and negative numbers (nan trains to a nan loss, exit 0)."""
    import math

    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(f"{value} is not a finite number >= 0", ctx, param)
    return value


def node_options(func: F) -> F:
    """The options that place a job's ranks on machines, shared by `run` and `probe`."""
    options = [
        click.option("--timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
                     callback=finite, help="Seconds a rank waits on its peers before the job is stopped."),
        click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True, help="Machines."),
        click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
                     help="This machine's index (run the same command on every node)."),
        click.option("--master-addr", default="127.0.0.1", show_default=True,
                     help="Node 0's address (rendezvous)."),
        click.option("--master-port", type=click.IntRange(min=0, max=65535), default=0,
                     help="0: a free port."),
    ]  # fmt: skip
    return _stacked(func, options)


def _stacked(func: F, decorators: list[Any]) -> F:
    """``func`` under ``decorators`` as if written above it in this order (click lists options in it)."""
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


PROFILE: list[Any] = [
    click.argument("model"),
    click.option(
        "-o",
        "--output",
        type=click.Path(path_type=str),
        default=None,
        help="Where to write the profile  [default: profiles/<model>/profile.json]",
    ),
    click.option(
        "--batch-size",
        type=int,
        default=8,
        show_default=True,
        help="Samples per minibatch: the plan, the package and `pipeplan run` use it. Profile at the size "
        "you train at; at batch 1 fixed per-layer costs dominate and the plan is unrealistic.",
    ),
    click.option(
        "--input-shape",
        default=None,
        help="One sample's shape, e.g. 3,224,224 (images) or 128 (tokens).",
    ),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
    click.option(
        "--dtype",
        type=click.Choice(["float32", "float16", "bfloat16"]),
        default="float32",
        show_default=True,
    ),
    click.option(
        "--leaf-module",
        "leaf_modules",
        multiple=True,
        metavar="CLASS",
        help="Keep every module of this class as one layer run eagerly (repeatable; torch.fx and "
        "torch.export alike), e.g. GPT2Block.",
    ),
    click.option(
        "--repeats",
        type=int,
        default=3,
        show_default=True,
        help="Timed runs per layer, after a warm-up (fewer for layers over 0.5 s); the median is kept.",
    ),
    click.option(
        "--clock",
        type=click.Choice(["wall", "cpu"]),
        default="wall",
        show_default=True,
        help="cpu: process CPU time, steadier on a CPU shared with other jobs (CPU only).",
    ),
    click.option(
        "--threads",
        type=int,
        default=None,
        help="CPU threads while measuring [default: 1 on a CPU]. `pipeplan run` gives each rank "
        "cores / ranks per machine (at least 1): profile at that count for predictions that match.",
    ),
    click.option(
        "--microbatch-size",
        type=int,
        default=None,
        help="Measure at this many samples and scale to --batch-size: the per-microbatch cost a 1f1b or "
        "gpipe pipeline sees (partition with --microbatches = batch size / this).",
    ),
    click.option(
        "--fixed-cost/--no-fixed-cost",
        default=True,
        show_default=True,
        help="Also measure every layer at an eighth of the batch, for its fixed time per call: what "
        "`partition --schedule auto` weighs microbatch counts with (a second, smaller pass over the layers).",
    ),
    click.option(
        "--precision",
        type=click.Choice(["fp32", "bf16", "fp16"]),
        default="fp32",
        show_default=True,
        help="Measure under autocast to bf16 or fp16 (float32 weights), as `pipeplan run --precision` "
        "trains; partition carries it into plan.json.",
    ),
    click.option(
        "--materialize",
        type=click.Choice(["auto", "whole", "layer"]),
        default="auto",
        show_default=True,
        help="whole: build the model on the device and time the whole step too; layer: build it without "
        "weights and make one layer real at a time (memory of one layer, no whole-step time); auto: whole "
        "while the weights take at most an eighth of the free memory, and layer for a model that repeats a "
        "block 8 times or more unless fixed per-call times are measured (--batch-size 2 or more).",
    ),
    click.option(
        "--device-model",
        default=None,
        metavar="NAME|FILE.json",
        help="Estimate every layer for a device that is not here instead of measuring: h100, a100-80gb, "
        "h200, cpu (this machine's measured rates) or a device model file (docs/devices.md). Nothing is "
        "allocated: plans a 70B model on a laptop.",
    ),
    click.option(
        "--reuse/--no-reuse",
        default=True,
        show_default=True,
        help="Measure identical layers (same code, shapes and dtypes) once and share the result.",
    ),
    click.option("--top", type=int, default=10, show_default=True, help="Layers shown in the summary table."),
    click.option("--json", "as_json", is_flag=True, help="Print only the profile JSON on stdout."),
]


def profile_options(func: F) -> F:
    """`pipeplan profile MODEL`'s options."""
    return _stacked(func, PROFILE)


PARTITION: list[Any] = [
    click.option(
        "--profile",
        "profile_path",
        type=click.Path(path_type=str),
        default=None,
        help="profile.json or PipeDream graph.txt  [default: newest profiles/*/profile.json]",
    ),
    click.option("--gpus", type=int, default=None, help="Devices on one level."),
    click.option(
        "--cluster",
        "cluster_spec",
        default=None,
        metavar="NAME[:NODES]|FILE.json",
        help="A cluster by name: dgx-a100, dgx-h100 or hgx-h200 (8 GPUs a node) times NODES, or a cluster "
        "file; sets the topology, bandwidths and memory (--memory overrides). See docs/devices.md.",
    ),
    click.option(
        "--topology",
        default=None,
        help="Devices per level, innermost first (4,4 = 4 servers of 4 GPUs).",
    ),
    click.option(
        "--bandwidth", default=None, help="Bytes/s per level: 1e9, 10GB/s, 100Gbit/s  [default: 1e9]"
    ),
    click.option(
        "--latency",
        default=None,
        help="Seconds every message costs besides its bytes, per level: 5us, 1.7ms, 0  [default: 1.7ms "
        "for a CPU profile (local gloo ranks, measured), 5.7us for GPUs (NCCL's PCIe estimate)]. "
        "See docs/devices.md.",
    ),
    click.option("--memory", default=None, help="Memory per device, e.g. 16GiB  [default: unlimited]"),
    click.option(
        "--host-cores",
        type=int,
        default=None,
        help="For a profile measured on a CPU: cores of one host (a unit of the innermost level), which its "
        "CPU ranks share; the prediction is at least the time the host needs to run their compute on "
        "them. 0: every rank has cores of its own.  [default: this machine's cores]",
    ),
    click.option(
        "--schedule",
        type=click.Choice([*SCHEDULES, "auto"]),
        default="pipedream",
        show_default=True,
        help="pipedream: asynchronous 1F1B with weight stashing (slowest stage sets the pace); 1f1b, gpipe: "
        "synchronous, a flush per minibatch; zb1p: zero bubble (ZB-H1), 1f1b with each backward split into "
        "input and weight gradients, the weight half deferred into the bubbles (about a third of 1f1b's "
        "bubble; every stage holds up to min(stages, microbatches) microbatches' activations); zbv: zero "
        "bubble V (ZB-V), 2 x GPUs stages laid out as a V (GPU r holds stages r and 2 x GPUs-1-r), backward "
        "split as "
        "zb1p's, a bubble of about (GPUs-1)/(6 x microbatches) of equal stages, each GPU holding 1f1b's "
        "first-stage activations, --microbatches 2 x GPUs by default, gloo only; "
        "interleaved: "
        "Megatron's virtual stages, GPUs x --virtual-stages stages of one GPU, stage s on GPU s mod GPUs, "
        "bubble (GPUs-1)/(V x microbatches); auto: the fastest predicted of them all, each at its best "
        "microbatch count (powers of two that split the batch, up to 4 per GPU; the count that "
        "--microbatches "
        "gives, if given; searched only where the profile measured each layer's fixed time per call) and "
        "interleaved at its best of 2, 3 or 4 virtual stages, with a table of each one's best plan "
        "(pipedream among them trains asynchronously, on gradients of weights a few minibatches old).",
    ),
    click.option(
        "--microbatches",
        type=int,
        default=None,
        help="Microbatches per minibatch (1f1b, gpipe, zb1p, interleaved) [default: 4; interleaved: "
        "GPUs x 2; auto: searched].",
    ),
    click.option(
        "--virtual-stages",
        "virtual",
        type=int,
        default=None,
        help="With --schedule interleaved: stages per GPU (Megatron's virtual stages)  [default: 2].",
    ),
    click.option(
        "--optimizer",
        type=click.Choice(["sgd", "momentum", "adam", "adamw"]),
        default="sgd",
        show_default=True,
        help="Training optimizer, for the memory model: state kept per weight byte "
        "(sgd none, momentum 1, adam and adamw 2).",
    ),
    click.option("--straight", is_flag=True, help="No replication: one device per stage."),
    click.option(
        "--recompute",
        type=click.Choice(["none", "all", "auto"]),
        default=None,
        help="Activation recomputation: a recomputing stage keeps only its inputs per microbatch in "
        "flight and runs its forward again in backward (more compute, less memory). none; all "
        "stages; auto: the plan without it if one fits --memory, else recompute exactly the stages "
        "that do not fit without it. Recorded per stage in plan.json; `pipeplan run` obeys "
        "it.  [default: none; with --schedule auto: auto]",
    ),
    click.option(
        "--solver",
        type=click.Choice(["dp", "ilp"]),
        default="dp",
        show_default=True,
        help="dp: exact search (optimal where it can list every downset); ilp: the same problem "
        "in pulp, for cross-checks on small profiles (one level).",
    ),
    click.option(
        "--cuts",
        default=None,
        help="Fix the plan: last layer of every stage but the last, e.g. fc6,fc7.",
    ),
    click.option("--replicas", default=None, help="With --cuts: replicas per stage, e.g. 3,1."),
    click.option(
        "--tensor-parallel",
        type=click.IntRange(min=1),
        default=None,
        help="Split every stage over T devices of one node (docs/layout-3d.md); the cuts, copies, "
        "schedule and microbatches are searched.  [default: searched by --schedule auto where the "
        "profile has layers to split]",
    ),
    click.option(
        "--shard",
        type=click.Choice(["none", "optimizer", "gradients", "full"]),
        default=None,
        help="What every stage's data-parallel copies share: nothing, the optimizer state (ZeRO-1), "
        "gradients too (ZeRO-2) or everything (FSDP).  [default: searched]",
    ),
    click.option("--explain", is_flag=True, help="Also show the baselines other tools pick."),
    click.option(
        "--trace",
        "trace_path",
        type=click.Path(path_type=str),
        default=None,
        help="Write the simulated timeline as a Chrome trace (Perfetto).",
    ),
    click.option(
        "--batch-size",
        type=int,
        default=None,
        help="Samples per minibatch, for profiles that do not record it (PipeDream graph.txt).",
    ),
    click.option(
        "--no-activation-comm",
        "no_comm",
        is_flag=True,
        help="Charge no activation traffic at cuts (what PipeDream's optimizer computes by default).",
    ),
    click.option(
        "--weights",
        type=click.Path(path_type=str, dir_okay=False),
        default=None,
        help="Weights the stages start from: a torch.save(state_dict) file, a .safetensors file or a "
        "save_pretrained folder (each rank reads only its stage's tensors).",
    ),
    click.option(
        "--init",
        type=click.Choice(["auto", "exact", "seeded"]),
        default="auto",
        show_default=True,
        help="Stage initialisation without --weights: exact (as the whole model under the seed; each rank "
        "draws the model's random numbers once, holding only its stage), seeded (per-module seeds; a rank "
        "draws only its stage), auto (exact up to 2 GiB of parameters).",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print only plan.json on stdout."),
    click.option(
        "-o",
        "--output",
        default="models",
        show_default=True,
        help="Output root: OUT/<model>/gpus=N/.",
    ),
    click.option(
        "--force",
        is_flag=True,
        help="Replace a trained package (runs/ in it) with another plan; its runs move to runs.<time>/. "
        "Without it, that is refused.",
    ),
]


def partition_options(func: F) -> F:
    """`pipeplan partition`'s options."""
    return _stacked(func, PARTITION)


RUN: list[Any] = [
    click.argument("package", required=False, type=click.Path(file_okay=False)),
    click.option(
        "--steps",
        type=click.IntRange(min=1),
        help="Minibatches in all, resumed ones included  [default: one epoch; synthetic: 8]",
    ),
    click.option(
        "--epochs",
        type=click.IntRange(min=1),
        help="Passes over the data without --steps  [default: 1]",
    ),
    click.option(
        "--batch-size",
        type=click.IntRange(min=1),
        help="Samples per minibatch  [default: plan.json's]",
    ),
    click.option("--microbatches", type=click.IntRange(min=1), help="Per minibatch  [default: plan.json's]"),
    click.option("--schedule", type=click.Choice(SCHEDULES), help="[default: plan.json's]"),
    click.option(
        "--backend",
        type=click.Choice(["auto", "gloo", "nccl"]),
        default="auto",
        show_default=True,
        help="auto: nccl on GPUs, gloo on CPUs.",
    ),
    click.option(
        "--data",
        default="synthetic",
        show_default=True,
        help="Or module:fn, file.py:fn, imagefolder:DIR, text:FILE.",
    ),
    click.option(
        "--seq-len", type=click.IntRange(min=1), default=None, help="Tokens per window of text: data."
    ),
    click.option(
        "--tokenizer",
        type=click.Path(path_type=str),
        default=None,
        help="A local tokenizer folder for text: data  [default: bytes]",
    ),
    click.option(
        "--data-workers",
        type=click.IntRange(min=0),
        default=1,
        show_default=True,
        help="DataLoader workers per reading rank.",
    ),
    click.option("--eval-data", default=None, metavar="SPEC", help="Held-out data (any --data form)."),
    click.option(
        "--eval-every",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Steps between evaluations (0: at the end).",
    ),
    click.option("--optimizer", metavar="[sgd|adam|adamw]", default="sgd", show_default=True),
    click.option(
        "--lr",
        type=float,
        default=0.01,
        show_default=True,
        callback=finite,
        help="Peak learning rate.",
    ),
    click.option(
        "--momentum",
        type=float,
        default=0.0,
        show_default=True,
        callback=finite,
        help="SGD momentum.",
    ),
    click.option("--nesterov", is_flag=True, help="SGD with Nesterov momentum."),
    click.option(
        "--weight-decay",
        type=float,
        default=0.0,
        show_default=True,
        help="L2 (sgd, adam), decoupled (adamw).",
    ),
    click.option("--betas", metavar="B1,B2", default="0.9,0.999", show_default=True, help="Adam(W)'s betas."),
    click.option(
        "--lr-schedule",
        metavar="[constant|linear|cosine]",
        default="constant",
        show_default=True,
        help="After the warm-up.",
    ),
    click.option("--warmup-steps", type=int, default=0, show_default=True, help="Linear warm-up from 0."),
    click.option("--clip-grad-norm", type=float, default=None, help="Clip the whole model's gradient norm."),
    click.option(
        "--precision",
        type=click.Choice(["fp32", "bf16", "fp16"]),
        help="Autocast  [default: plan.json's]",
    ),
    click.option("--seed", type=int, default=0, show_default=True, help="Weights and data seed."),
    click.option(
        "--weights",
        type=click.Path(exists=True, path_type=str),
        default=None,
        help="Initial weights  [default: the package's]",
    ),
    click.option("--shuffle", is_flag=True, help="Shuffle a user dataset every epoch."),
    click.option("--run-dir", type=click.Path(file_okay=False), help="[default: a new PACKAGE/runs/<time>/]"),
    click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="[default: RUN-DIR/checkpoints]"),
    click.option(
        "--checkpoint-every",
        type=click.IntRange(min=0),
        default=0,
        help="Steps between checkpoints  [default: the last]",
    ),
    click.option("--no-checkpoint", is_flag=True, help="Save none (export reads one)."),
    click.option("--checkpoint-async", is_flag=True, help="Write checkpoints in the background."),
    click.option(
        "--keep-checkpoints",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Keep the newest N (0: all) and pinned.",
    ),
    click.option(
        "--pin-every",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Keep steps that are multiples of N.",
    ),
    click.option("--resume", is_flag=True, help="Continue the newest run's checkpoint."),
    click.option("--accept-changes", is_flag=True, help="With --resume: allow changed settings."),
    click.option("--trace", type=click.Path(dir_okay=False), help="A Chrome trace of all ranks."),
    click.option(
        "--tensorboard", type=click.Path(file_okay=False), help="Also write TensorBoard events here."
    ),
    click.option(
        "--peak-tflops",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="A device's peak, for MFU  [default: known GPUs']",
    ),
    click.option(
        "--config",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        help="A run.toml of options; flags win.",
    ),
    click.option("--measure-memory", is_flag=True, help="On a CPU, count peak tensor memory."),
    node_options,
    click.option("--dry-run", is_flag=True, help="Print the torchrun commands instead."),
]


def run_options(func: F) -> F:
    """`pipeplan run [PACKAGE]`'s options (docs/run.md describes each)."""
    return _stacked(func, RUN)
