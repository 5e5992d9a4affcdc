"""The ``pipeplan`` command: profile -> partition -> verify -> run.

Each command is parse -> call -> render: click declares and parses the options (the long stacks of
profile, partition and run in cli_options.py), one call into the library (partitioner/, runtime/)
does the work and returns a value, and cli_render/ prints it with rich. The library and the
renderers are imported lazily, inside the commands (only the options and the error handling,
light, at the top), so ``pipeplan --help`` stays fast.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click
from click.core import ParameterSource

from cli_options import node_options, partition_options, profile_options, run_options
from cli_render.errors import OneLineErrors, user_errors

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
@profile_options
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

    from cli_render.profile import print_profile, profile_progress
    from partitioner.graph import profile_to_json, save_profile
    from partitioner.profiler.profile import profile_model
    from partitioner.profiler.request import prepare

    ctx = click.get_current_context()
    given = [name for name in ctx.params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE]
    shape, path = prepare(model, output, batch_size, input_shape, dtype, precision, device_model, given)
    with profile_progress(model) as progress:
        result = profile_model(
            model, batch_size, shape, device, dtype, leaf_modules, repeats, progress, clock, threads,
            microbatch_size, precision, fixed_cost, materialize=materialize, reuse=reuse,
            device_model=device_model,
        )  # fmt: skip
    save_profile(result, path)
    if as_json:
        click.echo(json.dumps(profile_to_json(result), indent=1))
        return
    print_profile(result, path, top, clock)


# ----------------------------------------------------------------------------- partition


@main.command()
@partition_options
@user_errors
def partition(
    profile_path: str | None, gpus: int | None, cluster_spec: str | None, topology: str | None,
    bandwidth: str | None, latency: str | None,
    memory: str | None, host_cores: int | None, schedule: str, microbatches: int | None, virtual: int | None,
    optimizer: str, straight: bool, recompute: str | None, solver: str, cuts: str | None,
    replicas: str | None, tensor_parallel: int | None, shard: str | None, explain: bool,
    trace_path: str | None, batch_size: int | None, no_comm: bool, weights: str | None, init: str,
    as_json: bool, output: str, force: bool,
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
    checks the microbatch size each rank will run too. A 3D package (tensor_parallel > 1 or a
    shard level) is then run on its ranks over gloo, each such stage split and sharded as
    `pipeplan run` builds it, against the plain stage. Exit code 0: they match; 1: they differ;
    2: the folder is not a valid package, or a rank failed. PACKAGE defaults to the newest under ./models.

    \b
    Examples:
      pipeplan verify
      pipeplan verify models/vgg16/gpus=4 --batch-size 2
    """
    from pathlib import Path

    import torch

    from cli_render.verify import print_verify, verify_progress
    from partitioner.plan import load_plan
    from partitioner.verification.on_ranks import is_3d, verify_on_ranks
    from partitioner.verification.verify import run_batch_sizes, verify_package
    from runtime.files.find_newest import newest_package
    from runtime.observing.resident_memory import map_large_blocks

    folder = Path(package) if package is not None else newest_package(Path(models_dir))
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    map_large_blocks()  # weights are made and dropped one by one: give their memory back each time
    sizes = (batch_size,) if batch_size else run_batch_sizes(folder)
    with verify_progress(folder) as step:  # (one check per microbatch size, the plan's last)
        reports = [verify_package(folder, seed=seed, batch_size=size, progress=step) for size in sizes]
        ranks = None
        if is_3d(load_plan(folder / "plan.json")):  # (a 3D package also as it runs: on its ranks)
            ranks = verify_on_ranks(folder, seed=seed, batch_size=reports[-1].batch_size, progress=step)
    sys.exit(0 if print_verify(reports, ranks) else 1)


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
    from partitioner.calibration.link_latency import calibrate_with_links
    from partitioner.calibration.stage_times import newest_run

    folders = [Path(p) for p in packages] or [newest_run(opts["models_dir"])]
    if metrics_path is None and run_dir is not None:
        metrics_path = str(Path(run_dir) / "metrics.json")
    kept = (opts["output"], opts["accept_load"], opts["traces"], opts["cluster"])
    print_calibration(*calibrate_with_links(folders, metrics_path, *kept))


# ----------------------------------------------------------------------------- run


@main.command()
@run_options
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
    from cli_render.run import RunDisplay, print_run
    from runtime.executing.optimizer import parse_betas
    from runtime.files.find_newest import newest_package
    from runtime.job.run_job import RunEvents, RunRequest, run_job
    from runtime.settings.run_options import RunOptions

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
    request = RunRequest(RunOptions.of(str(folder), **opts), checkpoints, dry_run)
    with RunDisplay() as shown:
        done = run_job(request, RunEvents(note, shown.resume, shown.start, shown.progress))
    print_run(done)


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
@click.option("--actions/--no-actions", default=True, show_default=True,
              help="Also time the runtime's own cost per action: a short traced run of tiny-mlp on two "
              "ranks, one stage each (one machine only), written as the file's action_overhead.")  # fmt: skip
@node_options
@user_errors
def probe(gpus: int, output: str, device: str, actions: bool, **opts: Any) -> None:
    """Measure the links between the ranks a run would use (latency, bandwidth, all-reduce) and write
    a cluster file that `partition --cluster FILE` reads.

    \b
    Examples:
      pipeplan probe --gpus 4 -o cluster.json
      pipeplan probe --gpus 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
    """
    from pathlib import Path

    from cli_render.probe import print_probe, print_probing
    from runtime.job.link_probe import ProbeOptions, probe_device, run_probe

    options = ProbeOptions(gpus=gpus, device=probe_device(device), **opts)
    print_probing(options)
    print_probe(run_probe(options, Path(output), " ".join(["pipeplan", *sys.argv[1:]])), output)
    if actions and options.nnodes == 1 and gpus >= 2:
        from cli_render.probe import print_actions, print_timing_actions
        from partitioner.calibration.action_probe import HOSTING, probe_actions, record_actions

        print_timing_actions()
        device = "cuda" if options.device == "cuda" else "cpu"
        found = probe_actions(2, device)
        hosting = {name: probe_actions(2, device, schedule=name) for name in HOSTING}
        record_actions(Path(output), found, hosting)
        print_actions(found, Path(output), hosting)


def _with_config(ctx: click.Context, package: str | None, opts: dict[str, Any]) -> str | None:
    """Fill the options not given on the command line from ``--config``'s run.toml, through click's own
    conversions and checks; returns the package (the command line's, else the file's)."""

    from runtime.settings.run_toml import read_config

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
    from runtime.exporting.model_weights import export_checkpoint
    from runtime.files.find_newest import newest_package

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

    from cli_render.export import print_torch_plan
    from runtime.exporting.torch_plan import export_torch_plan
    from runtime.files.find_newest import newest_package

    folder = Path(package) if package is not None else newest_package("models")
    out = Path(output) if output is not None else folder / "torch"
    print_torch_plan(export_torch_plan(folder, out, schedule), out)


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

    from cli_render.export import print_converted
    from runtime.checkpoints.convert_v1 import convert

    print_converted(convert(Path(checkpoint_dir), Path(package), step), checkpoint_dir)


if __name__ == "__main__":
    main()
