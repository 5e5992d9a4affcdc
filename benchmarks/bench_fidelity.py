"""Plan fidelity: does a plan's predicted time per minibatch match what `pipeplan run` then measures,
and does the cost model at least rank candidate plans in the order the runs do?

Everything goes through the real CLI in a temporary folder, as a user would run it:
``pipeplan profile MODEL --threads 1 --clock cpu --microbatch-size B/M`` (each of 2 local ranks gets
one of this machine's cores; layers measured at the plan's microbatch size, as ``partition`` advises
for 1f1b and gpipe, since small batches cost more per sample), ``pipeplan partition --profile ...
--gpus 2`` (the optimizer's plan, or ``--cuts/--replicas`` for a fixed candidate), ``pipeplan run PKG
--steps N`` (N: at least ``--steps``, and enough predicted minibatches for ``--seconds`` of steps, so a
30 ms plan is not judged on 7 steps); measured is ``run/metrics.json``'s median time per minibatch
(slower rank per step, the first step excluded), predicted is ``plan.json``'s.

1. Fidelity: 3 models (vgg16 and resnet18 at 3x64x64 images, the Hugging Face ``hf:llama`` family at
   128 tokens), each planned for every schedule (pipedream; 1f1b, gpipe, zb1p, interleaved and zbv
   with 2 microbatches): measured / predicted time, bubble per stage, memory per stage.
2. Rank correlation: 12 candidate plans of vgg16 (the optimizer's plans for the six schedules and
   1f1b with 4 microbatches, and fixed plans: a cut at 10%, 25% or 50% of the profiled compute, data
   parallelism, 1f1b cut at 25%), Spearman's rank correlation of measured against predicted.
   Both planned on the cluster file ``pipeplan probe`` wrote (the links and the runtime's time per
   action, once; no run before it).
3. Both again after one ``pipeplan calibrate`` per profile (from every plan of the first pass run
   on it, a rank hosting several stages giving each its rank's factor: each layer takes the median
   of its runs; every run with one stage per rank traced, their messages and gradient all-reduces
   correcting a copy of the probed cluster file's latencies, and the idle time after their actions
   setting its time per action, for that profile's plans): what a user gets first, and after
   calibrate.

Besides the wall-clock ratio, every run reports its ranks' compute CPU time against the plan's stage
compute (the profile is CPU time): on a CPU that other jobs share, a rank that gets half a core takes
twice the predicted wall time with a faithful cost model, and the CPU ratio separates the two.

All candidates use 2 ranks: this machine has 2 cores, and 4 ranks would share them, a cluster that no
plan describes. Targets: measured / predicted within 10%, each stage's bubble within 0.05 and memory
within 10%, rank correlation >= 0.9. The 1-minute load average is recorded before every command:
other jobs share this CPU, and a run measured above a load of 1.5 per core is reported, not scored.
The load does not see another tenant of the host slowing this machine's cores, so a fixed one-thread
workload is also timed (CPU time) just before every profile and run (``core_ms``): each run's
figure over its profile's says whether the core was slower or faster than when it was profiled.

Every run also counts its peak memory (``--measure-memory``) against the plan's prediction per stage.

Run:  .venv/bin/python benchmarks/bench_fidelity.py   (writes benchmarks/results/bench_fidelity.{json,md};
``--models hf:llama --rank-model hf:llama --results NAME`` runs a subset into NAME.{json,md};
``--as-planned --results bench_fidelity_as_planned`` the first pass alone)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.schedule import get_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import machine, write_results

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Model:
    """One model of the benchmark: its spec and the profile's shape."""

    spec: str
    batch_size: int
    input_shape: str


@dataclass(frozen=True)
class Candidate:
    """One plan: the optimizer's (``cuts`` None) or a fixed one; ``cuts`` are fractions of the
    profiled compute at which a stage ends (empty: one stage, replicated)."""

    label: str
    schedule: str
    microbatches: int
    cuts: tuple[float, ...] | None = None
    replicas: tuple[int, ...] | None = None


MODELS = (Model("vgg16", 8, "3,64,64"), Model("resnet18", 8, "3,64,64"), Model("hf:llama", 8, "128"))
FIDELITY = (
    Candidate("pipedream (optimizer)", "pipedream", 1),
    Candidate("1f1b m=2 (optimizer)", "1f1b", 2),
    Candidate("gpipe m=2 (optimizer)", "gpipe", 2),
    Candidate("zb1p m=2 (optimizer)", "zb1p", 2),
    Candidate("interleaved m=2 (optimizer)", "interleaved", 2),
    Candidate("zbv m=2 (optimizer)", "zbv", 2),
)
CANDIDATES = (
    Candidate("pipedream cut at 10%", "pipedream", 1, (0.1,), (1, 1)),
    Candidate("pipedream cut at 25%", "pipedream", 1, (0.25,), (1, 1)),
    Candidate("pipedream cut at 50%", "pipedream", 1, (0.5,), (1, 1)),
    Candidate("pipedream data parallel", "pipedream", 1, (), (2,)),
    Candidate("1f1b m=2 cut at 25%", "1f1b", 2, (0.25,), (1, 1)),
    Candidate("1f1b m=4 (optimizer)", "1f1b", 4),
)
PASSES = ("as planned", "probe + calibrate")
"""Each plan is made and run twice: from the profile as measured on the cluster ``pipeplan probe``
measured (its links and the runtime's time per action: what a user gets first, before any run),
then from the profile calibrated by the runs of that profile on a copy of the probed cluster file
that calibrate corrected from their traces (what a user gets after ``calibrate``)."""
TIME_WITHIN, BUBBLE_WITHIN, MEMORY_WITHIN = 0.10, 0.05, 0.10
LOAD_PER_CORE = 1.5  # runs measured above this 1-minute load per core are reported, not scored


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties get their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in order[i : j + 1]:
                out[k] = (i + j) / 2 + 1
            i = j + 1
        return out

    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman needs two lists of equal length >= 2")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def cut_layers(profile: dict[str, Any], fractions: tuple[float, ...]) -> list[str]:
    """The layer ids at which the profile's cumulative forward + backward time first reaches each
    fraction of the total (never the last layer, so every stage keeps a layer)."""
    layers = [n for n in profile["nodes"] if n["op"] != "input"]
    total = sum(n["forward_ms"] + n["backward_ms"] for n in layers)
    cuts, done, seen = [], 0.0, 0
    for fraction in fractions:
        while seen < len(layers) - 2 and done + layers[seen]["forward_ms"] + layers[seen]["backward_ms"] < (
            fraction * total
        ):
            done += layers[seen]["forward_ms"] + layers[seen]["backward_ms"]
            seen += 1
        cuts.append(layers[seen]["id"])
        done += layers[seen]["forward_ms"] + layers[seen]["backward_ms"]
        seen += 1
    return cuts


class Cli:
    """The ``pipeplan`` command beside this Python, run in one folder; each command's output goes to
    a log file, and a failing command raises with its last line."""

    def __init__(self, folder: Path) -> None:
        here = Path(sys.executable).parent / "pipeplan"
        self.exe = str(here) if here.exists() else (shutil.which("pipeplan") or "pipeplan")
        self.folder, self.count = folder, 0

    def __call__(self, *args: str) -> float:
        """Run ``pipeplan ARGS``; the 1-minute load average just before it."""
        load = os.getloadavg()[0]
        self.count += 1
        log = self.folder / f"log-{self.count:02d}-{args[0]}.txt"
        with log.open("w") as out:
            done = subprocess.run([self.exe, *args], cwd=self.folder, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode:
            lines = log.read_text().strip().splitlines() or ["(no output)"]
            raise RuntimeError(f"pipeplan {' '.join(args)} failed ({done.returncode}): {lines[-1]}")
        return load


def core_ms() -> float:
    """How fast one core of this machine is now: the CPU milliseconds of a fixed one-thread workload
    (convolutions and matrix products, as the models run), median of 5, timed in this process just
    before a profile or a run (when no rank is running). The load average counts runnable processes
    here, not another tenant's work on the same host's cores; this does (a core shared that way runs
    the same instructions slower, in CPU time as well). A run's figure over its profile's says how
    much slower the core was than when the profile was measured."""
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 32, 32, 32, generator=gen), torch.randn(32, 32, 3, 3, generator=gen)
    a = torch.randn(256, 256, generator=gen)
    times = []
    for _ in range(5):
        started = time.thread_time()
        for _ in range(10):
            torch.conv2d(x, w, padding=1)
            a @ a
        times.append(time.thread_time() - started)
    return 1e3 * statistics.median(times)


def profile(cli: Cli, model: Model, repeats: int, micro: int) -> tuple[Path, dict[str, Any]]:
    """``pipeplan profile`` with one thread and the CPU clock, measured at ``micro`` samples (what
    ``partition`` advises for a 1f1b or gpipe plan); the profile path and a summary."""
    path = Path("profiles") / f"{model.spec.replace(':', '-')}-micro{micro}" / "profile.json"
    core = core_ms()
    started = time.perf_counter()
    load = cli(
        "profile", model.spec, "--batch-size", str(model.batch_size), "--input-shape", model.input_shape,
        "--threads", "1", "--clock", "cpu", "--repeats", str(repeats), "--microbatch-size", str(micro),
        "-o", str(path),
    )  # fmt: skip
    doc = json.loads((cli.folder / path).read_text())
    return path, {
        "model": model.spec,
        "path": str(path),
        "batch_size": model.batch_size,
        "measured_at": micro,
        "input_shape": model.input_shape,
        "layers": sum(1 for n in doc["nodes"] if n["op"] != "input"),
        "profile_wall_s": round(time.perf_counter() - started, 1),
        "fidelity": doc.get("fidelity", doc.get("extra", {}).get("fidelity")),
        "load_1min": load,
        "core_ms": core,
    }


def cpu_per_stage(metrics: dict[str, Any]) -> dict[int, float]:
    """Per stage, CPU seconds of compute per minibatch (replicas summed, all steps): what the
    ``--clock cpu`` profile predicts, free of the time other jobs took this CPU away from the rank."""
    out: dict[int, float] = {}
    for r in metrics["ranks"]:
        out[r["stage"]] = out.get(r["stage"], 0.0) + r["compute_cpu_s"] / max(1, len(r["step_times_s"]))
    return out


def partition_args(cli: Cli, path: Path, cand: Candidate, cluster: str | None = None) -> list[str]:
    """``pipeplan partition`` arguments of a candidate (without the output folder): 2 ranks, or the
    probed ``cluster`` file (2 ranks too)."""
    where = ["--cluster", cluster] if cluster else ["--gpus", "2"]
    args = ["partition", "--profile", str(path), *where, "--schedule", cand.schedule,
            "--microbatches", str(cand.microbatches)]  # fmt: skip
    if cand.cuts is not None and cand.replicas is not None:
        cuts = cut_layers(json.loads((cli.folder / path).read_text()), cand.cuts)
        args += ["--cuts", ",".join(cuts), "--replicas", ",".join(map(str, cand.replicas))]
    return args


def plan_and_run(
    cli: Cli,
    model: Model,
    args: list[str],
    cand: Candidate,
    index: int,
    length: tuple[int, float],
    traced: bool = False,
) -> dict[str, Any]:
    """Partition (the optimizer's or a fixed plan), run it for at least ``length`` (steps, predicted
    seconds), and pair plan.json with metrics.json."""
    out = f"plans/{index:02d}"
    cli(*args, "-o", out)
    package = next((cli.folder / out).glob("*/gpus=2"))
    where = str(package.relative_to(cli.folder))
    plan = json.loads((package / "plan.json").read_text())
    steps = max(length[0], 1 + math.ceil(length[1] / plan["predicted"]["time_per_minibatch_s"]))
    trace = ["--trace", f"{where}/trace.json"] if traced else []
    core = core_ms()
    load = cli("run", where, "--steps", str(steps), "--timeout", "300", "--measure-memory", "--no-checkpoint",
               *trace)  # fmt: skip
    metrics = json.loads((package / "run" / "metrics.json").read_text())
    measured, predicted = metrics["time_per_minibatch_s"], plan["predicted"]["time_per_minibatch_s"]
    by_stage = {s["stage"]: s["compute_s_per_minibatch"] for s in metrics["stages"]}
    per_stage = {s["stage"]: s for s in metrics["stages"]}  # (runtime.observing.fidelity's figures)
    cpu, ranks = cpu_per_stage(metrics), metrics["ranks"]
    peaks = {m["stage"]: m["measured_peak_bytes"] for m in metrics.get("memory", {}).get("stages", [])}
    return {
        "model": model.spec,
        "plan": cand.label,
        "package": where,
        "schedule": cand.schedule,
        "microbatches": cand.microbatches,
        "cuts": [c for c in args[args.index("--cuts") + 1].split(",") if c] if "--cuts" in args else None,
        "stages": [
            {
                "replicas": s["replicas"],
                "layers": len(s["nodes"]),
                # a rank hosting several stages reports under its first, predictions summed (run's own)
                "predicted_compute_s": _run_side(
                    per_stage, s, "predicted_compute_s_per_minibatch", "compute_s"
                ),
                "predicted_comm_s": _run_side(per_stage, s, "predicted_comm_s_per_minibatch", "comm_s"),
                "measured_compute_s": by_stage.get(s["index"]),
                "measured_compute_cpu_s": cpu.get(s["index"]),
                "predicted_memory_bytes": s["memory_bytes"],
                "measured_memory_bytes": peaks.get(s["index"]),
                "measured_comm_s": per_stage.get(s["index"], {}).get("comm_s_per_minibatch"),
                "predicted_bubble": s.get("bubble_fraction"),
                "measured_bubble": per_stage.get(s["index"], {}).get("bubble_fraction"),
            }
            for s in plan["stages"]
        ],
        "predicted_s": predicted,
        "measured_s": measured,
        "measured_over_predicted": measured / predicted,
        "compute_cpu_over_predicted": sum(cpu.values()) / sum(s["compute_s"] for s in plan["stages"]),
        "bubble_fraction": plan["predicted"].get("bubble_fraction"),
        "cpu_share": sum(r["compute_cpu_s"] for r in ranks) / sum(r["compute_s"] for r in ranks),
        "load_1min": load,
        "core_ms": core,
        "steps": steps,
        "step_times_s_slowest_rank": [
            max(ts) for ts in zip(*(r["step_times_s"] for r in ranks), strict=False)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=8, help="Fewest minibatches per run (the first excluded)."
    )
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="Predicted seconds of steps per run, at least."
    )
    parser.add_argument("--repeats", type=int, default=3, help="Profile repeats per layer.")
    parser.add_argument("--models", default=",".join(m.spec for m in MODELS), help="Subset, comma-separated.")
    parser.add_argument("--rank-model", default="vgg16", help="The model whose candidates are ranked.")
    parser.add_argument("--keep", default=None, help="Work in this folder (kept) instead of a temporary one.")
    parser.add_argument("--from-json", default=None, help="Only write the report again from a result file.")
    parser.add_argument("--results", default="bench_fidelity", help="Result files' name (a subset's own).")
    parser.add_argument(
        "--as-planned", action="store_true", help="Only the first pass (probed cluster, no calibrate)."
    )
    args = parser.parse_args()
    if args.from_json:
        old = json.loads(Path(args.from_json).read_text())
        args = argparse.Namespace(**{**old["setup"], "results": args.results, "from_json": args.from_json})
        load = old["machine"]["load_average_before_after"]
        report(args, old["profiles"], old["runs"], (tuple(load[0]), tuple(load[1])), old["wall_s"])
        return
    chosen = [m for m in MODELS if m.spec in args.models.split(",")]
    started, load_before = time.perf_counter(), os.getloadavg()
    profiles: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        cli = Cli(folder)
        cli("probe", "--gpus", "2", "-o", "cluster.json")
        probed = json.loads((folder / "cluster.json").read_text())["levels"][0]
        for model in chosen:
            cands = (*FIDELITY, *(CANDIDATES if model.spec == args.rank_model else ()))
            paths: dict[int, Path] = {}
            for cand in cands:
                micro = model.batch_size // cand.microbatches
                if micro not in paths:
                    paths[micro], summary = profile(cli, model, args.repeats, micro)
                    profiles.append(summary)
            length = (args.steps, args.seconds)
            probed_file = {micro: "cluster.json" for micro in paths}  # as planned: probed, not calibrated
            done = run_pass(cli, model, cands, paths, probed_file, PASSES[0], runs, length)
            if args.as_planned:
                continue
            calibrated, clusters = calibrate(cli, paths, done, profiles)
            run_pass(cli, model, cands, calibrated, clusters, PASSES[1], runs, length)
    args.probed = {k: probed.get(k) for k in ("latency", "bandwidth")}
    report(args, profiles, runs, (load_before, os.getloadavg()), time.perf_counter() - started)


def _run_side(per_stage: dict[int, dict[str, Any]], stage: dict[str, Any], key: str, plan_key: str) -> float:
    """A stage's prediction as its run compares it (metrics.json's ``stages``, where a rank's hosted
    stages are summed under its first), else plan.json's own."""
    value = per_stage.get(stage["index"], {}).get(key)
    return float(value if value is not None else stage[plan_key])


def run_pass(
    cli: Cli,
    model: Model,
    cands: tuple[Candidate, ...],
    paths: dict[int, Path],
    clusters: dict[int, str],
    label: str,
    runs: list[dict[str, Any]],
    length: tuple[int, float],
) -> dict[int, list[str]]:
    """Plan and run every candidate from ``paths`` (profile per microbatch size; a size missing is
    skipped) on its profile's cluster file (none: ``--gpus 2``); per profile, the packages of its
    runs, those with one stage per rank first and traced (``trace.json`` in each: calibrate --trace
    reads no other)."""
    readable: dict[int, list[str]] = {}
    seen: set[tuple[str, ...]] = set()
    for cand in cands:
        micro = model.batch_size // cand.microbatches
        if micro not in paths:
            continue
        plan_args = partition_args(cli, paths[micro], cand, clusters.get(micro))
        if tuple(plan_args) in seen:  # two fractions that fall on one layer: one plan
            print(f"{model.spec:10s} {cand.label:28s} skipped: the same plan as an earlier one")
            continue
        seen.add(tuple(plan_args))
        traced = get_schedule(cand.schedule).placement is None
        runs.append({**plan_and_run(cli, model, plan_args, cand, len(runs), length, traced), "pass": label})
        mine = readable.setdefault(micro, [])
        first = sum((cli.folder / p / "trace.json").exists() for p in mine)  # (calibrate: traces in order)
        mine.insert(first if traced else len(mine), runs[-1]["package"])
        ratio = runs[-1]["measured_over_predicted"]
        print(f"{model.spec:10s} {label:16s} {cand.label:28s} measured/predicted {ratio:.2f}", flush=True)
    return readable


def calibrate(
    cli: Cli, paths: dict[int, Path], packages: dict[int, list[str]], profiles: list[dict[str, Any]]
) -> tuple[dict[int, Path], dict[int, str]]:
    """One ``pipeplan calibrate`` per profile, from every run of it (each layer takes the median of
    its runs), the traced runs' messages and all-reduces correcting a copy of the probed cluster
    file's latencies that the profile's second pass plans for; a
    refusal (a loaded machine) is recorded on the profile's summary and its plans get no second pass.
    Returns the calibrated profiles and cluster files per microbatch size."""
    out: dict[int, Path] = {}
    clusters: dict[int, str] = {}
    for micro, path in paths.items():
        target = path.with_name("calibrated.json")
        cluster = path.with_name("cluster.json")
        shutil.copyfile(cli.folder / "cluster.json", cli.folder / cluster)
        summary = next(p for p in profiles if p["measured_at"] == micro and p.get("path") == str(path))
        traces = [f"{p}/trace.json" for p in packages[micro] if (cli.folder / p / "trace.json").exists()]
        pairs = [arg for trace in traces for arg in ("--trace", trace)]
        try:
            cli("calibrate", *packages[micro], "-o", str(target), *pairs, "--cluster", str(cluster))
            out[micro], clusters[micro] = target, str(cluster)
            summary["calibrated_from"] = packages[micro]
            written = json.loads((cli.folder / cluster).read_text())
            summary["calibrated_cluster"] = written["levels"][0]
            summary["calibrated_action_s"] = written.get("action_overhead")
            split = json.loads((cli.folder / target).read_text())["extra"].get("split_backward")
            summary["split_backward"] = split["factor"] if split else None
        except RuntimeError as exc:
            summary["calibrate_refused"] = str(exc)
    return out, clusters


def _scored(run: dict[str, Any], cpus: int) -> bool:
    return bool(run["load_1min"] / cpus <= LOAD_PER_CORE)


def _bubble_gap(run: dict[str, Any]) -> float | None:
    """The largest |measured - predicted| bubble over a run's stages (None: nothing to compare)."""
    pairs = [(t.get("measured_bubble"), t.get("predicted_bubble")) for t in run["stages"]]
    gaps = [abs(m - p) for m, p in pairs if m is not None and p is not None]
    return max(gaps) if gaps else None


def device_memory(run: dict[str, Any]) -> list[float | None]:
    """Per stage, the predicted peak of the device ``run --measure-memory`` reports it under: a rank
    hosting several stages (interleaved, zbv) reports under its first, so there the sum of its
    stages' predictions (the plan's model of that device) and None under the others."""
    predicted = [s.get("predicted_memory_bytes") for s in run["stages"]]
    placed = get_schedule(run["schedule"]).placement if "schedule" in run else None
    if placed is None or None in predicted:
        return predicted
    ranks = int(run["package"].rsplit("gpus=", 1)[1])
    layout = placed(ranks, len(predicted) // ranks)
    out: list[float | None] = [None] * len(predicted)
    for rank in range(ranks):
        hosted = [k for k, on in enumerate(layout) if rank in on]
        out[min(hosted)] = sum(predicted[k] for k in hosted)
    return out


def memory_ratios(run: dict[str, Any]) -> list[float | None]:
    """Per stage, measured over predicted peak memory of its device (None where either is missing)."""
    return [m / p if m and p else None
            for m, p in zip((s.get("measured_memory_bytes") for s in run["stages"]), device_memory(run),
                            strict=True)]  # fmt: skip


def _scores(runs: list[dict[str, Any]], rank_model: str, cpus: int) -> dict[str, Any]:
    """One pass against the targets: the optimizer's plans of every schedule (time, bubble), every
    stage's memory, and the rank correlation over the rank model's plans; runs measured above
    ``LOAD_PER_CORE`` count as not scored."""
    scored = [r for r in runs if _scored(r, cpus)]
    fidelity = [r for r in scored if r["plan"] in {c.label for c in FIDELITY}]
    gaps = [g for g in map(_bubble_gap, fidelity) if g is not None]
    memory = [m for r in scored for m in memory_ratios(r) if m is not None]
    ranked = [r for r in scored if r["model"] == rank_model]

    def rho(key: str) -> float | None:
        return (
            spearman([r["predicted_s"] for r in ranked], [r[key] for r in ranked])
            if len(ranked) > 1
            else None
        )

    def share(values: list[float], within: float) -> str:
        return f"{sum(1 for v in values if abs(v - 1.0) <= within)} of {len(values)}"

    times = [r["measured_over_predicted"] for r in fidelity]
    return {
        "runs": len(runs),
        "not_scored": len(runs) - len(scored),
        "time_within_10_percent": share(times, TIME_WITHIN),
        "time_within_25_percent": share(times, 0.25),
        "time_within_10_percent_full_core": share(
            [r["full_core_over_predicted"] for r in fidelity], TIME_WITHIN
        ),
        "median_measured_over_predicted": _median(fidelity, "measured_over_predicted"),
        "worst_measured_over_predicted": max(times, key=lambda t: abs(math.log(t)), default=None),
        "bubble_within_0_05": f"{sum(1 for g in gaps if g <= BUBBLE_WITHIN)} of {len(gaps)}",
        "largest_bubble_gap": max(gaps, default=None),
        "memory_within_10_percent": share(memory, MEMORY_WITHIN),
        "rank_candidates": len(ranked),
        "rank_correlation_spearman": rho("measured_s"),
        "rank_correlation_spearman_full_core": rho("full_core_s"),
    }


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    return statistics.median(r[key] for r in runs) if runs else None


def report(
    args: argparse.Namespace,
    profiles: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    load: tuple[tuple[float, ...], tuple[float, ...]],
    wall_s: float,
) -> None:
    """bench_fidelity.json (every run's plan and metrics summary) and bench_fidelity.md."""

    for r in runs:  # an estimate, not a measurement: the wall time had each rank had its core
        r["full_core_s"] = r["measured_s"] * r["cpu_share"]
        r["full_core_over_predicted"] = r["full_core_s"] / r["predicted_s"]
        r["core_over_profile"] = _core_over_profile(r, profiles)
    cpus = os.cpu_count() or 1
    doc = {
        "benchmark": "bench_fidelity",
        "setup": {**vars(args), "ranks": 2, "backend": "gloo",
                  "profile": "--threads 1 --clock cpu --microbatch-size batch/microbatches",
                  "targets": {"time_within": TIME_WITHIN, "bubble_within": BUBBLE_WITHIN,
                              "memory_within": MEMORY_WITHIN, "scored_up_to_load_per_core": LOAD_PER_CORE}},
        "machine": machine(load, note="CPU shared with other jobs; load_1min recorded before every command"),
        "wall_s": round(wall_s, 1),
        "profiles": profiles,
        "median_cpu_share": _median(runs, "cpu_share"),
        "rank_model": args.rank_model,
        "passes": {label: _scores([r for r in runs if r.get("pass", PASSES[0]) == label],
                                  args.rank_model, cpus)
                   for label in PASSES if any(r.get("pass", PASSES[0]) == label for r in runs)},
        "runs": runs,
    }  # fmt: skip
    tables = (_runs_table(doc["runs"]), _worst_stage_table(doc["runs"]), _memory_table(doc["runs"]))
    md = [*_header(doc), *(line for table in tables for line in table), *_summary(doc)]
    write_results(RESULTS, args.results, doc, md)
    print("\n".join(md))


def _header(doc: dict[str, Any]) -> list[str]:
    load, setup, machine = doc["machine"]["load_average_before_after"], doc["setup"], doc["machine"]
    return [
        "# bench_fidelity: predicted (plan.json) against measured (`pipeplan run`) time per minibatch",
        "",
        f"2 gloo ranks on a {machine['cpu_count']}-core CPU shared with other jobs (1-min load average "
        f"{load[0][0]:.2f} before, {load[1][0]:.2f} after; per run below), torch {machine['torch']}. "
        f"Profiles: `pipeplan profile MODEL --threads 1 --clock cpu --repeats {setup['repeats']} "
        "--microbatch-size B/M` (the microbatch size of the plans made from it, as `partition` "
        f"advises); "
        f"runs: `pipeplan run PKG --steps N`, N at least {setup['steps']} and "
        f"{setup.get('seconds', 0):g} s of predicted steps (median step of the slower rank, first step "
        f"excluded). {_probed(setup.get('probed'))}Whole benchmark {doc['wall_s']:.0f} s.",
        "",
        "| model | batch | measured at | input | layers | profile s | profile fidelity | load "
        "| calibrated latency, all-reduce latency (ms) | per action (ms) | split backward |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|",
        *(
            f"| {p['model']} | {p['batch_size']} | {p['measured_at']} | {p['input_shape']} | {p['layers']} "
            f"| {p['profile_wall_s']} | {p['fidelity'] or 0:.2f} | {p['load_1min']:.2f} "
            f"| {_calibrated_links(p.get('calibrated_cluster'))} "
            f"| {f'{a * 1e3:.2f}' if (a := p.get('calibrated_action_s')) else '-'} "
            f"| {f'{g:.2f}x' if (g := p.get('split_backward')) else '-'} |"
            for p in doc["profiles"]
        ),
        "",
    ]


def _calibrated_links(level: dict[str, float] | None) -> str:
    """The profile's cluster file after calibrate --trace: its latency and all-reduce latency."""
    if not level:
        return "-"
    sync = level.get("allreduce_latency")
    return f"{level['latency'] * 1e3:.2f}, " + (f"{sync * 1e3:.2f}" if sync is not None else "as a message")


def _probed(probed: dict[str, float] | None) -> str:
    """What ``pipeplan probe`` measured for the second pass's cluster file (older results: nothing)."""
    if not probed:
        return ""
    latency, bandwidth = probed["latency"] * 1e3, probed["bandwidth"] / 1e9
    return f"Probed link: latency {latency:.2f} ms, bandwidth {bandwidth:.2f} GB/s. "


def _core_over_profile(run: dict[str, Any], profiles: list[dict[str, Any]]) -> float | None:
    """The core reference before the run over the one before its profile (:func:`core_ms`; > 1: the
    core was slower during the run); None where either was not recorded."""
    for p in profiles:
        mine = p["model"] == run["model"] and p["measured_at"] == p["batch_size"] // run["microbatches"]
        if mine and p.get("core_ms") and run.get("core_ms"):
            return float(run["core_ms"] / p["core_ms"])
    return None


def _runs_table(runs: list[dict[str, Any]]) -> list[str]:
    def stages(r: dict[str, Any]) -> str:
        return " / ".join(
            f"{1e3 * s['predicted_compute_s']:.0f}:{1e3 * (s['measured_compute_s'] or 0):.0f}"
            f":{1e3 * (s['measured_compute_cpu_s'] or 0):.0f}"
            + (f" x{s['replicas']}" if s["replicas"] > 1 else "")
            for s in r["stages"]
        )

    return [
        "Stage compute in ms per minibatch, predicted : measured wall : measured CPU (metrics.json, "
        "replicas summed). CPU share: the ranks' compute CPU time / compute wall time (1.0 = a core "
        "each, no other job running; the profile is CPU time, so a share of 0.5 alone makes "
        "measured/predicted ~2). x share / predicted: measured x CPU share / predicted, an estimate of the "
        "ratio had each rank had its own core (it assumes other jobs slowed every part of a step alike). "
        "core: a fixed one-thread workload's CPU time just before the run over just before its profile "
        "(> 1: the machine's core was slower than when the profile was measured; `core_ms`).",
        "",
        "| model | pass | plan | stages pred:wall:cpu ms | bubble | predicted s | measured s "
        "| measured/predicted | CPU/predicted compute | CPU share | x share / predicted | load | core |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['model']} | {r.get('pass', PASSES[0])} | {r['plan']} | {stages(r)} "
            f"| {r['bubble_fraction'] or 0:.2f} "
            f"| {r['predicted_s']:.4f} | {r['measured_s']:.4f} | {r['measured_over_predicted']:.2f} "
            f"| {r['compute_cpu_over_predicted']:.2f} | {r['cpu_share']:.2f} "
            f"| {r['full_core_over_predicted']:.2f} | {r['load_1min']:.2f} "
            f"| {'-' if r.get('core_over_profile') is None else format(r['core_over_profile'], '.2f')} |"
            for r in runs
        ),
        "",
    ]


def _label(run: dict[str, Any]) -> str:
    """A run's plan, marked when it was made after probe and calibrate."""
    return f"{run['plan']}, calibrated" if run.get("pass") == PASSES[1] else str(run["plan"])


def _worst_stage(stages: list[dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    """The stage whose measured compute is furthest from its prediction (by the ratio's logarithm:
    2x and 0.5x are as far), None where no stage has both."""

    def off(ks: tuple[int, dict[str, Any]]) -> float:
        return abs(math.log(ks[1]["measured_compute_s"] / ks[1]["predicted_compute_s"]))

    known = [(k, s) for k, s in enumerate(stages) if s.get("measured_compute_s") and s["predicted_compute_s"]]
    return max(known, key=off, default=None)


def _worst_stage_table(runs: list[dict[str, Any]]) -> list[str]:
    """Per plan, its worst stage's predicted against measured compute, communication, bubble and
    memory (``run``'s per-stage table), and the plan's largest bubble gap over all its stages."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{1e3 * value:.1f}"

    def two(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = []
    for r in runs:
        worst = _worst_stage(r["stages"])
        if worst is None:
            continue
        k, s = worst
        mem = memory_ratios(r)[k]
        both = [t for t in r["stages"] if None not in (t.get("measured_bubble"), t.get("predicted_bubble"))]
        gaps = [abs(t["measured_bubble"] - t["predicted_bubble"]) for t in both]
        rows.append(
            f"| {r['model']} | {_label(r)} | {k} "
            f"| {ms(s['predicted_compute_s'])} : {ms(s['measured_compute_s'])} "
            f"| {two(s['measured_compute_s'] / s['predicted_compute_s'])} "
            f"| {ms(s['predicted_comm_s'])} : {ms(s.get('measured_comm_s'))} "
            f"| {two(s.get('predicted_bubble'))} : {two(s.get('measured_bubble'))} | {two(mem)} "
            f"| {two(max(gaps)) if gaps else '-'} | {r['load_1min']:.2f} |"
        )
    return [
        "Worst stage per plan (the one whose measured compute is furthest from its prediction), "
        "predicted : measured per minibatch (metrics.json's `stages`). Comm: the plan's is its "
        "messages' wire time, the run's the time the rank was blocked, waiting for its peer included, "
        "so they are not compared; the waiting shows in the bubble (the share of a device's time not "
        "computing; predicted by the plan's simulation). Bubble gap: the largest |measured - predicted| "
        "bubble over the plan's stages (target 0.05).",
        "",
        "| model | plan | stage | compute ms | measured/predicted | comm ms | bubble "
        "| memory measured/predicted | bubble gap | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def _memory_table(runs: list[dict[str, Any]]) -> list[str]:
    """Per stage, the plan's predicted peak memory per device against what ``run --measure-memory``
    counted (live tensor storages: byte for byte the same from run to run, whatever the load)."""

    def mib(value: float | None) -> str:
        return "-" if value is None else f"{value / 2**20:.1f}"

    rows = [
        f"| {r['model']} | {_label(r)} | {k} | {mib(device)} | {mib(s.get('measured_memory_bytes'))} | "
        + ("-" if ratio is None else f"{ratio:.2f}") + " |"
        for r in runs
        for k, (s, device, ratio) in enumerate(
            zip(r["stages"], device_memory(r), memory_ratios(r), strict=True))
    ]  # fmt: skip
    return [
        "Peak memory per device, MiB: plan.json's prediction against `run --measure-memory`; a rank "
        "hosting several stages (interleaved, zbv) under its first, its stages' predictions summed.",
        "",
        "| model | plan | stage | predicted MiB | measured MiB | measured/predicted |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def _summary(doc: dict[str, Any]) -> list[str]:
    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    models = len({p["model"] for p in doc["profiles"]})
    lines = [
        f"Targets: every schedule's optimizer plan within {TIME_WITHIN:.0%} of its measured time and its "
        f"stages' bubble within {BUBBLE_WITHIN} of the measured one, every stage's memory within "
        f"{MEMORY_WITHIN:.0%}, Spearman >= 0.9 over the rank model's plans; runs measured above a load "
        f"of {LOAD_PER_CORE} per core are listed but not scored.",
        "",
        "| pass | runs (not scored) | time within 10% | within 25% | median / worst measured/predicted "
        "| bubble within 0.05 (largest gap) | memory within 10% | Spearman (plans) | x share: within 10%, "
        "Spearman |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, p in doc["passes"].items():
        lines.append(
            f"| {label} | {p['runs']} ({p['not_scored']}) | {p['time_within_10_percent']} "
            f"| {p['time_within_25_percent']} | {num(p['median_measured_over_predicted'])} / "
            f"{num(p['worst_measured_over_predicted'])} | {p['bubble_within_0_05']} "
            f"({num(p['largest_bubble_gap'])}) | {p['memory_within_10_percent']} "
            f"| {num(p['rank_correlation_spearman'])} ({p['rank_candidates']}) "
            f"| {p['time_within_10_percent_full_core']}, {num(p['rank_correlation_spearman_full_core'])} |"
        )
    cores = sorted(r["core_over_profile"] for r in doc["runs"] if r.get("core_over_profile") is not None)
    core = f"; core reference over its profile's {cores[0]:.2f} to {cores[-1]:.2f}" if cores else ""
    return [*lines, "", f"{models} models x {len(FIDELITY)} schedules; median CPU share of all runs "
            f"{num(doc['median_cpu_share'])}{core}."]  # fmt: skip


if __name__ == "__main__":
    main()
