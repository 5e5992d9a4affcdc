"""Does each process hold one stage, not the model? Peak resident memory of every command of the chain
on a Llama-shaped model of about a billion parameters (fp32: 4.4 GB of weights).

For each command (``profile``, ``partition``, ``verify``, ``run --steps 2``) it runs the whole command
as a user would and records the largest peak resident size (``ru_maxrss``) of any one process it
waited for (the command itself, its launcher; the ranks of ``run`` are not among them and report their
own peak in metrics.json, shown per rank). A process that held the whole model would be above the
model's weight bytes; a rank that holds its stage is near its stage's bytes plus what torch itself
takes (about 0.4 GB of libraries on CPU, measured here as ``python -c "import torch, transformers"``).

Run: ``.venv/bin/python benchmarks/bench_stage_memory.py [--gpus 4] [--layers 16]``. Needs
transformers. Writes benchmarks/results/bench_stage_memory.{json,md}. The profile step is the
profiler's (it measures the model whole, layer by layer); verify, partition and run are this chain's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import write_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
# Llama-3.2-1B's block (hidden 2048, 32 heads over 8 KV heads, MLP 8192), a 32k vocabulary, untied
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_cache": False,
}


def _peak(*args: str) -> tuple[float, int]:
    """(wall s, the largest peak resident bytes of any process) of one command in a fresh child.

    ``ru_maxrss`` of RUSAGE_CHILDREN is the largest of every waited-for descendant, so a fresh child
    that only waits for the command reports the command's own (its launcher, its ranks); this
    process's own figure would carry the earlier commands'.
    """
    code = (
        "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
        "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"error: {' '.join(args)} failed:\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    return wall, int(done.stdout.split("PEAK")[1].split()[0]) * 1024


def _model_bytes(config: Path) -> int:
    import torch

    from runtime.building.hugging_face import factory

    with torch.device("meta"):
        model = factory(f"hf:{config}")()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep the files here (default: a temporary folder); commands whose rows.jsonl line is "
        "already there are not run again (the profile step takes minutes)",
    )
    parser.add_argument(
        "--out", default="bench_stage_memory", help="result file stem under benchmarks/results"
    )
    args = parser.parse_args()
    pipeplan = [sys.executable, "-c", "import sys; sys.argv[0] = 'pipeplan'; from cli import main; main()"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as temporary:
        tmp = args.workdir or Path(temporary)
        done = tmp / "rows.jsonl"
        before = [json.loads(line) for line in done.read_text().splitlines()] if done.is_file() else []
        config = tmp / "llama1b" / "config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps({**CONFIG, "num_hidden_layers": args.layers}))
        model = _model_bytes(config)
        profile, models = tmp / "profile.json", tmp / "models"
        steps: list[tuple[str, list[str]]] = [
            ("imports only", [sys.executable, "-c", "import torch, transformers, cli"]),
            ("profile", [*pipeplan, "profile", f"hf:{config}", "--batch-size", "1", "--input-shape", "128",
                         "--repeats", "1", "--no-fixed-cost", "-o", str(profile)]),
            ("partition", [*pipeplan, "partition", "--profile", str(profile), "--gpus", str(args.gpus),
                           "--straight", "-o", str(models)]),
            ("verify", [*pipeplan, "verify", "PACKAGE"]),
            ("run --steps 2", [*pipeplan, "run", "PACKAGE", "--steps", "2", "--timeout", "600",
                               "--no-checkpoint"]),
        ]  # fmt: skip
        for name, command in steps:
            if any(row["command"] == name for row in before):
                rows.append(next(row for row in before if row["command"] == name))
                continue
            package = next(models.glob(f"*/gpus={args.gpus}"), None)
            command = [str(package) if part == "PACKAGE" else part for part in command]
            load = os.getloadavg()[0]
            wall, peak = _peak(*command)
            rows.append({"command": name, "wall_s": round(wall, 1), "peak_rss_bytes": peak,
                         "loadavg_1min": round(load, 2)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            with done.open("a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
        metrics = json.loads((package / "run" / "metrics.json").read_text()) if package else {"ranks": []}
    ranks = [
        {k: r.get(k) for k in ("rank", "stage_bytes", "build_growth_bytes", "resident_peak_bytes")}
        for r in metrics["ranks"]
    ]
    doc = {"config": {**CONFIG, "num_hidden_layers": args.layers}, "model_bytes": model, "gpus": args.gpus,
           "commands": rows, "ranks": ranks}  # fmt: skip
    write_results(RESULTS, args.out, doc, markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    gb = 1e9
    lines = [
        f"# bench_stage_memory: peak resident memory per process, Llama-shaped "
        f"{doc['config']['num_hidden_layers']}-block model, "
        f"{doc['model_bytes'] / gb:.2f} GB of fp32 weights, {doc['gpus']} stages",
        "",
        "Largest peak resident size of any one process the command waited for (the command or its "
        "launcher); load is the 1-minute load average before it.",
        "",
        "| command | peak RSS GB | / model | wall s | load |",
        "|---|---|---|---|---|",
    ]
    for r in doc["commands"]:
        peak = r["peak_rss_bytes"]
        lines.append(
            f"| {r['command']} | {peak / gb:.2f} | {peak / doc['model_bytes']:.2f} "
            f"| {r['wall_s']} | {r['loadavg_1min']} |"
        )
    lines += [
        "",
        "The run row is the command and its launcher: ranks are not its waited-for children, so each",
        "rank reports its own peak resident size (metrics.json) below.",
        "",
        "| rank | stage GB | build raised its peak by GB | rank's peak RSS GB |",
        "|---|---|---|---|",
    ]
    for r in doc["ranks"]:
        grown, peak = r["build_growth_bytes"], r["resident_peak_bytes"]
        lines.append(
            f"| {r['rank']} | {r['stage_bytes'] / gb:.2f} | {'-' if grown is None else f'{grown / gb:.2f}'} "
            f"| {'-' if peak is None else f'{peak / gb:.2f}'} |"
        )
    lines += [
        "",
        "A rank's build raises its peak by its stage. Training adds the stage's gradients and, under the",
        "plan's default pipedream schedule, the weight versions it stashes for microbatches in flight",
        "(up to stages - rank of them); this measurement does not separate the two (a 1f1b run would).",
        "The profile step is the profiler's: it holds the model whole.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
