"""The GPU kit: one command that measures what only a GPU can tell, and writes it into the repository.

A GPU machine is lent to this project now and then, for minutes. This script is prepared and tested
beforehand (its ``--cpu`` mode runs in the test suite on tiny models) so that nothing is improvised there:

1. ``env``: device, driver, torch, the packages the CLI needs;
2. ``ceilings``: the device's measured matrix-product rate per dtype and size, copy bandwidth and launch
   latency (what a device description for planning without the device is built from);
3. ``profile``: ``pipeplan profile`` of each model on the device, whole command timed; fidelity (sum of
   layer times over the whole step) and the profiler's own wall time;
4. ``estimate``: ``pipeplan profile --device-model`` (the preset of this GPU; ``cpu`` in CPU mode) of
   each profiled model, compared layer by layer with the measured profile
   (``partitioner.profiler.compare.compare``: median estimated/measured, spread, worst layers, sums against
   the measured step), the evidence to correct a preset's efficiency factors with;
5. ``run``: ``pipeplan partition --gpus 1`` and ``pipeplan run`` on one rank (nccl on a GPU), measured
   against predicted time and memory, fp32 and bf16; the same model trained plainly in one process, for
   the executor's efficiency (plain / pipelined time; 1.0 is the physical limit);
6. ``big``: Llama-3-8B- and 70B-shaped configs measured layer by layer on the device (bfloat16, 4096
   tokens, one layer real at a time, identical layers once) against the device model's estimate of the
   same layers, and each profile partitioned as the README and docs/big-models.md plan them: the
   predicted minibatch time and model FLOP utilisation from a measured profile beside the estimated
   one's, the check of what a plan made from a laptop promises;
7. ``tests``: the tests marked ``cuda``;
8. ``3d``: on one GPU, the runtime's 3D code paths that a world of one can run, on one process with
   nccl on ``cuda:0`` (``benchmarks/gpu_3d_one_rank.py``; gloo in CPU mode): its mesh, DTensor tensor
   parallelism at degree 1, FSDP2 at every shard level, DCP save and load of the DTensor state dict,
   each against plain training of the same stage in the same process. Every 3D layout has
   ``t * d >= 2`` ranks per stage and NCCL refuses two ranks on one GPU, so no multi-rank path runs
   on one GPU (:data:`NEEDS_SEVERAL_GPUS` says what needs several); with 4 GPUs or more the step
   also runs ``benchmarks/bench_3d.py --only llama --backend nccl`` (3D layouts against plain
   training). Untested on CUDA until a session with a GPU runs it.

Every step runs on its own, with a time limit; a failed step is recorded with its error and the rest go
on. The report (``gpu_<device>_<date>.{json,md}``, or ``cpu_check.{json,md}`` in CPU mode) is rewritten
after every step, so a run cut short still leaves what it measured.

Run:  python benchmarks/gpu_check.py [--cpu] [--out DIR] [--work DIR] [--steps env,ceilings,...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import write_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class ModelCase:
    """One model the kit profiles and runs: the CLI's spec and profile options."""

    name: str
    spec: str
    batch_size: int
    input_shape: str | None
    options: tuple[str, ...] = ()
    run: bool = True


GPU_MODELS = (
    ModelCase("vgg16", "vgg16", 32, "3,224,224"),
    ModelCase("resnet50", "resnet50", 32, "3,224,224"),
    ModelCase("gpt2", "gpt2", 8, "512"),
    ModelCase("gpt2-bf16", "gpt2", 8, "512", ("--precision", "bf16")),
    ModelCase(
        "llama-1b-bf16",
        f"hf:{ROOT}/benchmarks/gpu/llama-1b.json",
        4,
        "512",
        ("--dtype", "bfloat16"),
        run=False,
    ),
)
CPU_MODELS = (ModelCase("tiny-gpt", "tiny-gpt", 8, None),)


@dataclass(frozen=True)
class BigCase:
    """A language model too big to profile whole: its config, the profile's shape, the partition."""

    name: str
    config: str  # a file under benchmarks/configs
    batch_size: int
    tokens: int
    partition: tuple[str, ...]


GPU_BIG = (
    BigCase("llama3-8b", "llama3-8b.json", 8, 4096,
            ("--topology", "8", "--bandwidth", "450GB/s", "--memory", "80GiB", "--optimizer", "adamw",
             "--schedule", "1f1b", "--microbatches", "8", "--recompute", "auto")),
    BigCase("llama3-70b", "llama3-70b.json", 64, 4096,
            ("--cluster", "dgx-h100:8", "--optimizer", "adamw", "--schedule", "1f1b", "--microbatches",
             "64", "--recompute", "auto")),
)  # fmt: skip
CPU_BIG = (
    BigCase("llama-h512", "llama-h512.json", 2, 32,
            ("--gpus", "2", "--optimizer", "adamw", "--schedule", "1f1b", "--microbatches", "2")),
)  # fmt: skip


@dataclass(frozen=True)
class Context:
    """What every step reads: the mode, the device, the folders, the models."""

    cpu: bool
    device: str
    work: Path
    models: tuple[ModelCase, ...]
    limit_s: float
    deadline: float  # time.perf_counter() after which no command starts

    def timeout(self) -> float:
        """Seconds the next command may take: its limit, or what is left of the kit's budget."""
        return max(0.0, min(self.limit_s, self.deadline - time.perf_counter()))


# ---------------------------------------------------------------- helpers


def pipeplan(ctx: Context, *args: str, timeout: float | None = None, log: str) -> dict[str, Any]:
    """Run the CLI as a user would (a whole process); its output goes to ``work/logs/<log>.log``."""
    logs = ctx.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", COLUMNS="100")
    started, limit = time.perf_counter(), timeout or ctx.timeout()
    if limit < 5:
        return {"rc": None, "wall_s": 0.0, "tail": [], "skipped": "the kit's --budget is spent"}
    with open(logs / f"{log}.log", "w") as out:
        try:
            rc = subprocess.run(
                [sys.executable, str(ROOT / "cli.py"), *args], cwd=ctx.work, env=env, stdout=out,
                stderr=subprocess.STDOUT, timeout=limit,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - started
    tail = (logs / f"{log}.log").read_text(errors="replace").strip().splitlines()[-3:]
    return {"rc": rc, "wall_s": round(wall, 2), "tail": tail}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` after ``warmup`` calls (CUDA events on a GPU)."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


# ---------------------------------------------------------------- steps


def step_env(ctx: Context) -> dict[str, Any]:
    """The machine, the driver, torch and the packages the CLI imports."""
    import importlib.metadata as md

    import torch

    versions = {}
    for name in ("torch", "transformers", "click", "rich", "networkx", "numpy", "pulp", "pytest"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": versions,
        "cuda_available": torch.cuda.is_available(),
    }
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 2), capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), nccl=".".join(
                str(v) for v in torch.cuda.nccl.version()),
        )  # fmt: skip
        smi = shutil.which("nvidia-smi")
        if smi:
            query = "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit"
            line = subprocess.run([smi, query, "--format=csv,noheader"], capture_output=True, text=True)
            info["nvidia_smi"] = line.stdout.strip()
    else:
        info["gpu"] = None
    return info


def step_ceilings(ctx: Context) -> dict[str, Any]:
    """Matrix products per dtype and size, a device-to-device copy, and one tiny kernel's launch time."""
    import torch

    dev = ctx.device
    sizes = (256, 512, 1024) if ctx.cpu else (1024, 2048, 4096, 8192)
    dtypes = {"float32": torch.float32} if ctx.cpu else {
        "bfloat16": torch.bfloat16, "float16": torch.float16, "tf32": torch.float32, "float32": torch.float32,
    }  # fmt: skip
    matmul: dict[str, dict[str, float]] = {}
    for label, dtype in dtypes.items():
        if dev == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = label == "tf32"
        rates = {}
        for n in sizes:
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            ms = timed_ms(lambda a=a, b=b: a @ b, dev, repeats=5 if ctx.cpu else 20)
            rates[str(n)] = round(2 * n**3 / (ms * 1e-3) / 1e12, 4)
        matmul[label] = rates
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    numel = (64 if ctx.cpu else 1024) * 2**20 // 4
    src = torch.randn(numel, device=dev)
    dst = torch.empty_like(src)
    copy_ms = timed_ms(lambda: dst.copy_(src), dev, repeats=10)
    tiny = torch.zeros(1, device=dev)
    launch_us = timed_ms(lambda: [tiny.add_(1) for _ in range(100)], dev, repeats=5) * 10  # 100 launches
    return {
        "matmul_tflops": matmul,
        "copy_gb_s": round(2 * src.numel() * 4 / (copy_ms * 1e-3) / 1e9, 1),
        "launch_us": round(launch_us, 2),
        "note": "matmul: 2n^3 / median time of an n x n x n product on random data; copy counts bytes "
        "read plus written; launch: 100 one-element adds in a row, per add",
    }


def _layer_sums(profile: dict[str, Any]) -> tuple[float, float, int]:
    nodes = profile["nodes"]
    fwd = sum(float(n.get("forward_ms", 0.0)) for n in nodes)
    bwd = sum(float(n.get("backward_ms", 0.0)) for n in nodes)
    return fwd, bwd, len(nodes)


def step_profile(ctx: Context) -> dict[str, Any]:
    """``pipeplan profile`` of every model on the device: the command's wall time and what it measured."""
    results = {}
    for case in ctx.models:
        out = ctx.work / "profiles" / f"{case.name}.json"
        args = ["profile", case.spec, "--batch-size", str(case.batch_size), "--device", ctx.device,
                "-o", str(out), *case.options]  # fmt: skip
        if case.input_shape:
            args += ["--input-shape", case.input_shape]
        ran = pipeplan(ctx, *args, log=f"profile-{case.name}")
        if ran["rc"] == 0 and out.exists():
            prof = json.loads(out.read_text())
            fwd, bwd, layers = _layer_sums(prof)
            extra = prof.get("extra", {})
            ran.update(
                layers=layers, forward_ms=round(fwd, 3), backward_ms=round(bwd, 3),
                step_ms=round(float(prof["step_ms"]), 3),
                fidelity=round((fwd + bwd) / float(prof["step_ms"]), 3) if prof["step_ms"] else None,
                profile_wall_s=extra.get("profile_wall_s"), tracer=prof.get("tracer"),
                params=sum(int(n.get("param_bytes", 0)) for n in prof["nodes"]),
            )  # fmt: skip
        results[case.name] = ran
    return results


def _preset(ctx: Context) -> str | None:
    """The device model that describes this device: ``cpu`` in CPU mode, a GPU preset by name."""
    if ctx.cpu:
        return "cpu"
    import torch

    name = torch.cuda.get_device_name().lower()
    known = (("h200", "h200"), ("h100", "h100"), ("a100", "a100-80gb"))
    return next((preset for key, preset in known if key in name), None)


def step_estimate(ctx: Context) -> dict[str, Any]:
    """Each measured profile against the device model's estimate of the same model and batch."""
    from partitioner.graph import load_profile
    from partitioner.profiler.compare import compare

    preset = _preset(ctx)
    if preset is None:
        return {"skipped": "no device model describes this device"}
    results: dict[str, Any] = {"device_model": preset}
    for case in ctx.models:
        measured = ctx.work / "profiles" / f"{case.name}.json"
        if not measured.exists():
            results[case.name] = {"skipped": "no measured profile (the profile step did not run or failed)"}
            continue
        out = ctx.work / "estimates" / f"{case.name}.json"
        args = ["profile", case.spec, "--batch-size", str(case.batch_size), "--device-model", preset,
                "-o", str(out), *case.options]  # fmt: skip
        if case.input_shape:
            args += ["--input-shape", case.input_shape]
        ran = pipeplan(ctx, *args, log=f"estimate-{case.name}")
        if ran["rc"] == 0 and out.exists():
            ran["compare"] = compare(load_profile(measured), load_profile(out))
        results[case.name] = ran
    return results


def _plain_step_ms(ctx: Context, case: ModelCase, precision: str, microbatches: int) -> dict[str, Any]:
    """The model trained plainly in this process (SGD, gradient accumulation over ``microbatches``)."""
    import torch

    from partitioner.models.specs import load_model
    from runtime.precision import autocast

    shape = tuple(int(d) for d in case.input_shape.split(",")) if case.input_shape else None
    bundle = load_model(case.spec, case.batch_size, shape)
    model = bundle.module.to(ctx.device)
    inputs = [t.to(ctx.device) for t in bundle.inputs]
    targets = bundle.targets.to(ctx.device)
    optim = torch.optim.SGD(model.parameters(), lr=1e-4)
    dev = torch.device(ctx.device)

    def step() -> None:
        chunks = zip(*(t.chunk(microbatches) for t in inputs), strict=True)
        for chunk, target in zip(chunks, targets.chunk(microbatches), strict=True):
            with autocast(precision, dev):
                loss = bundle.loss_fn(model(*chunk), target)
            loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    if ctx.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = timed_ms(step, ctx.device, repeats=5 if ctx.cpu else 20, warmup=3)
    peak = torch.cuda.max_memory_allocated() if ctx.device == "cuda" else None
    return {"step_ms": round(ms, 3), "peak_memory_bytes": peak}


@dataclass(frozen=True)
class Variant:
    """One way of running a model on one rank: the partition options and the precisions it runs at."""

    name: str
    partition: tuple[str, ...]
    precisions: tuple[str, ...]


VARIANTS = (
    Variant("1 stage", (), ("fp32", "bf16")),
    # Two stages on the one rank as a V: the executor's own cost against plain gradient accumulation.
    Variant("zbv, 2 stages", ("--schedule", "zbv", "--microbatches", "4"), ("fp32",)),
)


def _run_row(
    ctx: Context, case: ModelCase, variant: Variant, package: Path, precision: str
) -> dict[str, Any]:
    """``pipeplan run`` of one package at one precision, and the same model trained plainly."""
    tag = f"{case.name}-{variant.name.split(',')[0].replace(' ', '')}-{precision}"
    trace = ctx.work / f"trace-{tag}.json"
    ran = pipeplan(ctx, "run", str(package), "--steps", "6" if ctx.cpu else "20", "--precision", precision,
                   "--lr", "0.0001", "--trace", str(trace), "--no-checkpoint", log=f"run-{tag}")  # fmt: skip
    row: dict[str, Any] = {"model": case.name, "variant": variant.name, "precision": precision, **ran}
    metrics_path = package / "run" / "metrics.json"
    if ran["rc"] == 0 and metrics_path.exists():
        metrics = json.loads(metrics_path.read_text())
        shutil.copy(metrics_path, ctx.work / f"metrics-{tag}.json")
        stages = (metrics.get("memory") or {}).get("stages", [])
        row.update(
            measured_ms=round(1e3 * metrics["time_per_minibatch_s"], 3),
            predicted_ms=round(1e3 * metrics["predicted_time_per_minibatch_s"], 3),
            ratio=round(metrics["ratio_measured_over_predicted"], 3),
            microbatches=metrics["microbatches"], device=metrics["device"],
            memory_predicted_mib=[round(st["predicted_bytes"] / 2**20, 1) for st in stages],
            memory_measured_mib=[_mib(st.get("measured_peak_bytes")) for st in stages],
            trace_bytes=trace.stat().st_size if trace.exists() else None,
        )  # fmt: skip
    try:
        row["plain"] = _plain_step_ms(ctx, case, precision, int(row.get("microbatches", 1)))
        if "measured_ms" in row:
            row["efficiency_plain_over_pipelined"] = round(row["plain"]["step_ms"] / row["measured_ms"], 3)
    except Exception as exc:  # recorded; the kit goes on
        row["plain"] = {"error": f"{type(exc).__name__}: {exc}"}
    return row


def _mib(size: int | None) -> float | None:
    return None if size is None else round(size / 2**20, 1)


def step_run(ctx: Context) -> dict[str, Any]:
    """One-rank packages trained by ``pipeplan run``, against prediction and against plain training."""
    rows: list[dict[str, Any]] = []
    for case in (c for c in ctx.models if c.run):
        prof = ctx.work / "profiles" / f"{case.name}.json"
        if not prof.exists():
            rows.append({"model": case.name, "skipped": "no profile"})
            continue
        for number, variant in enumerate(VARIANTS):
            pkg_root = ctx.work / "models" / f"{case.name}-{number}"
            part = pipeplan(ctx, "partition", "--profile", str(prof), "--gpus", "1", "-o", str(pkg_root),
                            *variant.partition, log=f"partition-{case.name}-{number}")  # fmt: skip
            if part["rc"] != 0:
                rows.append({"model": case.name, "variant": variant.name, "partition": part})
                continue
            package = next(pkg_root.glob("*/gpus=1"))  # -o is the models root
            rows += [_run_row(ctx, case, variant, package, precision) for precision in variant.precisions]
    return {"rows": rows}


def _plan_row(
    folder: Path, profile: Path, config: dict[str, Any], case: BigCase, peak: float | None
) -> dict[str, Any] | None:
    """plan.json's prediction and the model FLOP utilisation it implies (PaLM's count, as bench_big)."""
    found = sorted(folder.glob("*/gpus=*/plan.json"))
    if not found:
        return None
    plan = json.loads(found[-1].read_text())
    from benchmarks.bench_big import training_flops_per_token

    _, per_token = training_flops_per_token(config, json.loads(profile.read_text()), case.tokens)
    rate = float(plan["predicted"]["throughput_samples_per_s"]) * case.tokens * per_token
    stages = plan["stages"]
    return {
        "gpus": plan["gpus"], "stages": len(stages), "replicas": [s["replicas"] for s in stages],
        "recomputing": sum(1 for s in stages if s.get("recompute")),
        "max_memory_gib": round(max(s["memory_bytes"] for s in stages) / 2**30, 2),
        "minibatch_ms": round(1e3 * float(plan["predicted"]["time_per_minibatch_s"]), 1),
        "samples_per_s": round(float(plan["predicted"]["throughput_samples_per_s"]), 2),
        "mfu": round(rate / plan["gpus"] / peak, 3) if peak else None,
    }  # fmt: skip


def step_big(ctx: Context) -> dict[str, Any]:
    """Big language models measured layer by layer on the device against the device model's estimate,
    each partitioned as a user would: what a plan from a laptop promises against one from the GPU."""
    from partitioner.graph import load_profile
    from partitioner.hardware.devices import load_device_model
    from partitioner.profiler.compare import compare

    preset = _preset(ctx)
    if preset is None:
        return {"skipped": "no device model describes this device"}
    peak = None if ctx.cpu else float(load_device_model(preset).peak_flops["bfloat16"])  # cpu: measured
    results: dict[str, Any] = {"device_model": preset}
    for case in CPU_BIG if ctx.cpu else GPU_BIG:
        config_path = ROOT / "benchmarks" / "configs" / case.config
        common = ["profile", f"hf:{config_path}", "--batch-size", str(case.batch_size), "--microbatch-size",
                  "1", "--input-shape", str(case.tokens), "--dtype", "bfloat16"]  # fmt: skip
        row: dict[str, Any] = {}
        for kind, extra in (("measured", ["--materialize", "layer", "--device", ctx.device]),
                            ("estimated", ["--device-model", preset])):  # fmt: skip
            out = ctx.work / "big" / f"{case.name}-{kind}.json"
            ran = pipeplan(ctx, *common, *extra, "-o", str(out), log=f"big-{case.name}-{kind}")
            models = ctx.work / "big" / f"models-{case.name}-{kind}"
            if ran["rc"] == 0:
                ran["partition"] = pipeplan(ctx, "partition", "--profile", str(out), *case.partition, "-o",
                                            str(models), log=f"big-{case.name}-{kind}-partition")  # fmt: skip
                ran["plan"] = _plan_row(models, out, json.loads(config_path.read_text()), case, peak)
            row[kind] = ran
        both = [ctx.work / "big" / f"{case.name}-{k}.json" for k in ("measured", "estimated")]
        if all(p.exists() for p in both):
            row["compare"] = compare(load_profile(both[0]), load_profile(both[1]))
        results[case.name] = row
    return results


def step_tests(ctx: Context) -> dict[str, Any]:
    """The tests marked ``cuda`` (skipped without a GPU; this step is what runs them)."""
    if ctx.cpu:
        return {"skipped": "CPU mode: the cuda tests skip themselves without a GPU"}
    started = time.perf_counter()
    log = ctx.work / "logs" / "pytest-cuda.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        try:
            rc = subprocess.run(
                [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=out, stderr=subprocess.STDOUT,
                timeout=max(5.0, ctx.timeout()),
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return {"rc": rc, "wall_s": round(time.perf_counter() - started, 2), "tail": tail}


NEEDS_SEVERAL_GPUS = (
    "PP2 x TP2 (4 GPUs): weights split 2 ways (heads and features divided), Megatron's f/g "
    "all-reduces between 2 ranks over nccl",
    "PP2 x DP2 optimizer/gradients/full (4 GPUs): FSDP2's all-gather and reduce-scatter of real "
    "shards over nccl",
    "PP2 x DP2 x TP2 replicated and full (8 GPUs): FSDP2 over DTensor weights on a 2 x 2 mesh",
    "any 3D layout (4 GPUs): every rank creating every stage's groups (stage_meshes), activations "
    "and gradients sent between stages over nccl, a DCP checkpoint written by several ranks' shards",
    "zbv or interleaved on nccl (several stages to a rank): refused by the runtime on more than one "
    "rank (its streams are told apart by tag, which NCCL ignores), so bench_3d's zbv rows record that",
)
"""What the ``3d`` step cannot run on one GPU, and why each needs the GPUs it says."""


def _script(ctx: Context, args: list[str], log: str) -> dict[str, Any]:
    """``python <args>`` from the repository root under the next command's time limit; its output
    goes to ``work/logs/<log>.log``."""
    path = ctx.work / "logs" / f"{log}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    started, limit = time.perf_counter(), ctx.timeout()
    if limit < 5:
        return {"rc": None, "wall_s": 0.0, "tail": [], "skipped": "the kit's --budget is spent"}
    with open(path, "w") as out:
        try:
            rc = subprocess.run(
                [sys.executable, *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=out,
                stderr=subprocess.STDOUT, timeout=limit,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    tail = path.read_text(errors="replace").strip().splitlines()[-3:]
    return {"rc": rc, "wall_s": round(time.perf_counter() - started, 2), "tail": tail}


ONE_RANK_MODELS = {"cpu": ("mlp",), "cuda": ("llama", "mlp")}
"""The models of the one-rank 3D paths (``benchmarks/gpu_3d_one_rank.py --model``): on the GPU the
llama-shaped config and the MLP file (biases, LayerNorm); in CPU mode the MLP alone (the llama's
profile alone takes 15 s on the two loaded cores the suite runs on)."""


def _one_rank_3d(ctx: Context, model: str) -> dict[str, Any]:
    """``benchmarks/gpu_3d_one_rank.py`` in a process of its own (a hung collective ends at the time
    limit; the paths done by then are in its report): each path ran or not, its result, its error."""
    tag = f"3d-one-rank-{model}"
    out, backend = ctx.work / f"{tag}.json", "gloo" if ctx.cpu else "nccl"
    ran = _script(ctx, ["benchmarks/gpu_3d_one_rank.py", "--backend", backend, "--model", model, "--work",
                        str(ctx.work / tag), "--out", str(out)], tag)  # fmt: skip
    report = json.loads(out.read_text()) if out.exists() else {}
    keep = ("backend", "device", "torch", "steps", "microbatches", "tolerance", "package_s", "plain_s",
            "plain_moved", "plain_noise", "error", "running", "paths")  # fmt: skip
    return {**ran, **{k: report[k] for k in keep if k in report}}


def step_3d(ctx: Context) -> dict[str, Any]:
    """The runtime's 3D paths at degree 1 on one rank (:func:`_one_rank_3d`), and 3D layouts on nccl
    where the machine has the GPUs (``benchmarks/bench_3d.py``)."""
    one_rank = {model: _one_rank_3d(ctx, model) for model in ONE_RANK_MODELS[ctx.device]}
    result: dict[str, Any] = {"one_rank": one_rank, "needs": list(NEEDS_SEVERAL_GPUS)}
    if ctx.cpu:
        return {
            **result,
            "skipped": "CPU mode: the multi-rank layouts run on gloo in tests/runtime/test_3d_training.py",
        }
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 4:
        return {**result, "skipped": f"{gpus} GPU(s): every 3D layout needs 4 or more"}
    out = ctx.work / "bench_3d"
    ran = _script(ctx, ["benchmarks/bench_3d.py", "--only", "llama", "--backend", "nccl", "--out", str(out),
                        "--most-ranks", str(gpus)], "bench-3d")  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else []
    return {**result, "rc": ran["rc"], "wall_s": ran["wall_s"], "rows": rows}


STEPS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "env": step_env,
    "ceilings": step_ceilings,
    "profile": step_profile,
    "estimate": step_estimate,
    "run": step_run,
    "big": step_big,
    "tests": step_tests,
    "3d": step_3d,
}


# ---------------------------------------------------------------- report


def markdown(report: dict[str, Any]) -> str:
    """The report as a page a person reads: one table per step."""
    env = report["steps"].get("env", {})
    lines = [f"# GPU kit: {env.get('gpu') or 'CPU mode'}, {report['date']}", ""]
    lines.append(f"torch {env.get('packages', {}).get('torch')}, CUDA {env.get('cuda')}, "
                 f"driver/clocks {env.get('nvidia_smi')}, {env.get('cpus')} CPUs; "
                 f"command: `{report['command']}`; wall {report.get('wall_s')} s")  # fmt: skip
    ceil = report["steps"].get("ceilings", {})
    if "matmul_tflops" in ceil:
        lines += ["", "## Ceilings", "", "| dtype | " + " | ".join(
            f"n={n}" for n in next(iter(ceil["matmul_tflops"].values()))) + " |"]  # fmt: skip
        lines.append("|---" * (1 + len(next(iter(ceil["matmul_tflops"].values())))) + "|")
        for dtype, rates in ceil["matmul_tflops"].items():
            lines.append(f"| {dtype} TFLOP/s | " + " | ".join(str(r) for r in rates.values()) + " |")
        lines += [
            "",
            f"copy {ceil['copy_gb_s']} GB/s (read + write); launch {ceil['launch_us']} us per kernel",
        ]
    prof = report["steps"].get("profile", {})
    if prof and "error" not in prof:
        lines += ["", "## Profiles", "",
                  "| model | rc | command s | layers | fwd+bwd ms | step ms | fidelity |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in prof.items():
            fb = (r.get("forward_ms") or 0) + (r.get("backward_ms") or 0)
            lines.append(f"| {name} | {r['rc']} | {r['wall_s']} | {r.get('layers', '-')} | "
                         f"{fb:.2f} | {r.get('step_ms', '-')} | {r.get('fidelity', '-')} |")  # fmt: skip
    lines += _estimate_lines(report["steps"].get("estimate", {}))
    lines += _big_lines(report["steps"].get("big", {}))
    rows = report["steps"].get("run", {}).get("rows", [])
    if rows:
        lines += ["", "## One-rank runs", "",
                  "| model | variant | precision | rc | measured ms | predicted ms | ratio | memory MiB "
                  "(pred / meas) | plain ms | plain/pipelined |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            pairs = zip(r.get("memory_predicted_mib", []), r.get("memory_measured_mib", []), strict=True)
            memory = ", ".join(f"{p:.0f} / {'-' if m is None else f'{m:.0f}'}" for p, m in pairs) or "-"
            lines.append(f"| {r['model']} | {r.get('variant', '-')} | {r.get('precision', '-')} | "
                         f"{r.get('rc', '-')} | {r.get('measured_ms', '-')} | {r.get('predicted_ms', '-')} | "
                         f"{r.get('ratio', '-')} | {memory} | {r.get('plain', {}).get('step_ms', '-')} | "
                         f"{r.get('efficiency_plain_over_pipelined', '-')} |")  # fmt: skip
    lines += _three_d_lines(report["steps"].get("3d", {}))
    errors = {k: v["error"] for k, v in report["steps"].items() if isinstance(v, dict) and "error" in v}
    if errors:
        lines += ["", "## Failed steps", ""] + [f"- {k}: {v}" for k, v in errors.items()]
    return "\n".join(lines) + "\n"


def _three_d_lines(three: dict[str, Any]) -> list[str]:
    """The 3d step: each one-rank path's result, then the layouts that ran or what they need."""
    if not three:
        return []
    lines = ["", "## 3D layouts", ""]
    for model, one in three.get("one_rank", {}).items():
        lines.append(f"One rank, {model}, {one.get('backend')} on {one.get('device')} (rc {one.get('rc')}, "
                     f"{one.get('wall_s')} s): the runtime's 3D paths at degree 1, against plain "
                     "training")  # fmt: skip
        lines += [f"- error: {one['error']}"] if "error" in one else []
        lines += [f"- cut short while running: {one['running']}"] if "running" in one else []
        for precision, moved in one.get("plain_moved", {}).items():
            noise = one.get("plain_noise", {}).get(precision)
            lines.append(f"- plain training, {precision}: moved the weights {moved:.2e}, run again "
                         f"{'-' if noise is None else f'{noise:.1e}'} from itself")  # fmt: skip
        for name, row in one.get("paths", {}).items():
            err = row.get("max_rel_error")
            detail = row.get("error") or (f"max rel. error {err:.1e}" if err is not None else "")
            lines.append(f"- {name}: {row.get('result')}" + (f" ({detail})" if detail else ""))
        lines.append("")
    lines += [f"- {three['skipped']}"] if "skipped" in three else []
    lines += [f"- needs several GPUs: {need}" for need in three.get("needs", [])]
    lines += [f"- {r['model']} {r['layout']} {r['schedule']}: {r['result']}" for r in three.get("rows", [])]
    return lines


def _estimate_lines(estimate: dict[str, Any]) -> list[str]:
    """The estimate step's table: estimated over measured per layer (median, 10th-90th percentile) and
    summed, against the layers' sum and the whole measured step."""
    done = {k: v["compare"] for k, v in estimate.items() if isinstance(v, dict) and "compare" in v}
    if not done:
        return []
    lines = ["", f"## Device model `{estimate.get('device_model')}` against the measured profiles", "",
             "| model | layers | fwd median | bwd median | layer p10-p90 | sum est/meas | est/step |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, c in done.items():
        total = c["total"]

        def r(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        cells = [name, str(c["layers"]), r(c["forward"]["median"]), r(c["backward"]["median"]),
                 f"{r(total['p10'])}-{r(total['p90'])}", r(c["sum_ratio"]), r(c["step_ratio"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _big_lines(big: dict[str, Any]) -> list[str]:
    """The big step's table: per model, the measured and the estimated profile and their plans."""
    cases = {k: v for k, v in big.items() if isinstance(v, dict) and ("measured" in v or "estimated" in v)}
    if not cases:
        return []
    lines = ["", f"## Big models: measured layer by layer against the `{big.get('device_model')}` estimate",
             "", "| model | profile | command s | plan | minibatch ms | samples/s | MFU |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in cases.items():
        for kind in ("measured", "estimated"):
            r = row.get(kind, {})
            plan = r.get("plan") or {}
            shape = (f"{plan['stages']} stages on {plan['gpus']}, {plan['recomputing']} recomputing"
                     if plan else f"rc {r.get('partition', {}).get('rc', r.get('rc'))}")  # fmt: skip
            mfu = f"{100 * plan['mfu']:.1f}%" if plan.get("mfu") else "-"
            cells = [
                name,
                f"{kind} (rc {r.get('rc')})",
                str(r.get("wall_s", "-")),
                shape,
                str(plan.get("minibatch_ms", "-")),
                str(plan.get("samples_per_s", "-")),
                mfu,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    compared = {k: v["compare"] for k, v in cases.items() if "compare" in v}
    lines += _estimate_lines({"device_model": big.get("device_model"), **{k: {"compare": c}
                              for k, c in compared.items()}})  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode: tiny models, the kit's plumbing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the report goes")
    parser.add_argument("--work", type=Path, default=None, help="profiles, packages, logs [a temp folder]")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    parser.add_argument("--models", default=None, help="comma-separated names of the mode's models [all]")
    parser.add_argument("--limit", type=float, default=240.0, help="seconds each command may take")
    parser.add_argument("--budget", type=float, default=780.0, help="seconds for the whole kit")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --cpu for the CPU mode")
    unknown = set(args.steps.split(",")) - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {', '.join(STEPS)}")
    models = CPU_MODELS if args.cpu else GPU_MODELS
    if args.models:
        names = args.models.split(",")
        unknown_models = sorted(set(names) - {m.name for m in models})
        if unknown_models:
            parser.error(f"unknown models {unknown_models}; choose from {', '.join(m.name for m in models)}")
        models = tuple(m for m in models if m.name in names)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"pipeplan-gpu-check-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.cpu, "cpu" if args.cpu else "cuda", work.resolve(),
                  models, args.limit,
                  time.perf_counter() + args.budget)  # fmt: skip
    report: dict[str, Any] = {
        "schema": "pipeplan.gpu_check/1", "date": dt.date.today().isoformat(), "mode": ctx.device,
        "command": " ".join(["benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "work": str(ctx.work), "steps": {}, "step_wall_s": {},
    }  # fmt: skip
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.steps.split(","):
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            report["steps"][name] = STEPS[name](ctx)
        except Exception as exc:  # recorded; the kit goes on
            report["steps"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        report["step_wall_s"][name] = round(time.perf_counter() - t0, 2)
        report["wall_s"] = round(time.perf_counter() - started, 1)
        stem = "cpu_check" if args.cpu else _stem(report)
        write_results(args.out, stem, report, markdown(report))
        print(f"[gpu_check] {name} done in {report['step_wall_s'][name]} s", flush=True)
    print(markdown(report))
    return 0


def _stem(report: dict[str, Any]) -> str:
    gpu = str(report["steps"].get("env", {}).get("gpu") or "gpu").lower()
    short = next((w for w in ("h100", "h200", "a100", "l4", "v100") if w in gpu), gpu.replace(" ", "-"))
    return f"gpu_{short}_{report['date']}"


if __name__ == "__main__":
    sys.exit(main())
