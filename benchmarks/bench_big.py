"""Big models on a small machine: profile time against depth, profile memory against size, and the
two commands of issue 20's first "Done when" lines, each timed as a user waits for it.

Every row runs the real command (``pipeplan profile`` / ``partition``) as a child process and
records its wall time, its peak resident memory (the child's ``ru_maxrss``) and the 1-minute load
average before it (this machine is shared: wall times include waiting for other jobs).

- ``blocks``: Llama configs identical but for their depth (2, 8, 32 decoder layers), profiled at
  batch 1 x 128 tokens, ``--materialize`` auto (the default), layer and whole: with identical
  layers measured once, the default's time should not grow with the depth (target: 32 blocks
  within 1.5x of 2). Rounds alternate the order.
- ``memory``: Llama configs of growing size (hidden 1024: 2 to 32 layers, 0.1B to 0.5B parameters)
  profiled layer by layer and whole: layer by layer, peak memory should follow the largest layer,
  not the model.
- ``8b``: a Llama-3-8B-shaped config (benchmarks/configs/llama3-8b.json), ``pipeplan profile
  --batch-size 1 --input-shape 512 --dtype bfloat16`` under an 8 GiB address-space limit (what
  ``prlimit --as=8589934592`` sets), then ``pipeplan partition --topology 8 --bandwidth 450GB/s
  --memory 80GiB --optimizer adamw``.
- ``package``: ``partition`` writing the stage code of Hugging Face models it never builds:
  a Llama config of 1.1B parameters (Llama-3.2-1B's block, 16 layers, a 32k vocabulary: what
  bench_stage_memory.py runs) and the Llama-3-8B-shaped config, each estimated for the h100 preset
  (a profile in seconds, traced as the measured ones are: torch.export, static shapes) and then
  partitioned onto 4 and 8 GPUs under an 8 GiB address-space limit: peak RSS, wall time, and
  whether the stage code was written (the export graph is traced on fake tensors of a model built
  without its weights, so peak memory should not follow the model).
- ``70b``: a Llama-3-70B-shaped config (benchmarks/configs/llama3-70b.json) estimated for the h100
  preset at 4096 tokens (64 sequences a minibatch, estimated at 1 and scaled), then partitioned on
  8 nodes of 8 (``--topology 8,8 --bandwidth 450GB/s,50GB/s --memory 80GiB --optimizer adamw
  --schedule 1f1b --microbatches 64 --recompute auto``): both commands' wall time (target: under 60
  s together), and the model FLOP utilisation plan.json's throughput implies:
  MFU = samples/s x tokens x (6 N + 12 L d T) / (GPUs x peak), N the parameters outside the
  embeddings, L layers, d the hidden size, T the tokens (PaLM's count, appendix B).

Run:  .venv/bin/python benchmarks/bench_big.py [--sections blocks,memory,8b,package,70b] [--rounds 2]
(writes benchmarks/results/bench_big.{json,md}; sections not run keep their earlier results there)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.files.atomic import write_text_atomic

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CONFIGS = HERE / "configs"
SECTIONS = ("blocks", "memory", "8b", "package", "70b")
GIB = 2**30


def _exe() -> str:
    here = Path(sys.executable).parent / "pipeplan"
    return str(here) if here.exists() else (shutil.which("pipeplan") or "pipeplan")


def run(folder: Path, *args: str, address_space: int | None = None) -> dict[str, Any]:
    """``pipeplan ARGS`` in ``folder``: wall seconds, peak RSS (GiB), exit status, load before, and
    the last line of its output (the error, when it failed)."""

    def limit() -> None:
        if address_space:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    load = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    with (folder / "log.txt").open("a") as log:
        log.write(f"\n$ pipeplan {' '.join(args)}\n")
        log.flush()
        child = subprocess.Popen([_exe(), *args], cwd=folder, stdout=log, stderr=log, preexec_fn=limit)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    lines = (folder / "log.txt").read_text().strip().splitlines()
    return {
        "args": list(args),
        "rc": os.waitstatus_to_exitcode(status),
        "wall_s": round(wall, 1),
        "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "loadavg_1min": load,
        "last_line": lines[-1] if lines else "",
    }


def llama(folder: Path, name: str, hidden: int, layers: int, vocab: int = 32000) -> str:
    """A Llama config of ``layers`` decoder layers of width ``hidden`` (8 KV heads of 64): its spec."""
    doc = json.loads((CONFIGS / "llama3-8b.json").read_text())
    heads = hidden // 64
    doc.update(
        hidden_size=hidden, intermediate_size=hidden * 7 // 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=min(8, heads), head_dim=64, vocab_size=vocab,
    )  # fmt: skip
    path = folder / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1))
    return f"hf:{path}"


def _profile_row(folder: Path, out: str, result: dict[str, Any]) -> dict[str, Any]:
    if result["rc"] == 0:
        doc = json.loads((folder / out).read_text())
        measured = doc["extra"].get("layers_measured", {})
        result.update(
            layers=measured.get("layers"), distinct=measured.get("distinct"),
            materialized=doc["extra"].get("materialized"),
            weights_gib=round(sum(n["param_bytes"] for n in doc["nodes"]) / GIB, 3),
            largest_layer_gib=round(max(n["param_bytes"] for n in doc["nodes"]) / GIB, 3),
        )  # fmt: skip
    return result


def blocks(folder: Path, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for r in range(rounds):
        for depth in (2, 8, 32) if r % 2 == 0 else (32, 8, 2):
            spec = llama(folder, f"blocks{depth}", 512, depth)
            for mode in ("auto", "layer", "whole"):
                row = _small(folder, spec, f"blocks{depth}", mode)
                rows.append({"round": r + 1, "depth": depth, "mode": mode, **row})
    return rows


def memory(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for depth in (2, 8, 32):
        spec = llama(folder, f"size{depth}", 1024, depth)
        for mode in ("layer", "whole"):
            rows.append({"depth": depth, **_small(folder, spec, f"size{depth}", mode)})
    return rows


def _small(folder: Path, spec: str, name: str, mode: str) -> dict[str, Any]:
    """``spec`` profiled at batch 1 x 128 tokens, ``--materialize mode``: its row."""
    out = f"{name}-{mode}.json"
    args = ("profile", spec, "--batch-size", "1", "--input-shape", "128", "--materialize", mode, "-o", out)
    return _profile_row(folder, out, run(folder, *args))


def eight_b(folder: Path) -> dict[str, Any]:
    spec = f"hf:{CONFIGS / 'llama3-8b.json'}"
    args = (
        "profile",
        spec,
        "--batch-size",
        "1",
        "--input-shape",
        "512",
        "--dtype",
        "bfloat16",
        "-o",
        "8b.json",
    )
    profile = _profile_row(folder, "8b.json", run(folder, *args, address_space=8 * GIB))
    plan = run(
        folder, "partition", "--profile", "8b.json", "--topology", "8", "--bandwidth", "450GB/s", "--memory",
        "80GiB", "--optimizer", "adamw", "-o", "models", "--json",
    )  # fmt: skip
    return {"profile": profile, "partition": plan, "plan": _plan(folder / "models")}


def package(folder: Path) -> list[dict[str, Any]]:
    """Estimated profiles of a 1.1B and an 8B Llama, then ``partition`` under 8 GiB: its rows."""
    one_b = llama(folder, "llama1b", 2048, 16)
    doc = json.loads((folder / "llama1b.json").read_text())
    doc.update(num_attention_heads=32, intermediate_size=8192, head_dim=64, tie_word_embeddings=False)
    (folder / "llama1b.json").write_text(json.dumps(doc, indent=1))
    rows = []
    for name, spec, tokens, gpus, limits in (
        ("1.1B", one_b, "128", "4", (None, 8 * GIB)),
        ("8B", f"hf:{CONFIGS / 'llama3-8b.json'}", "512", "8", (8 * GIB,)),
    ):
        out = f"package-{name}.json"
        profile = run(
            folder, "profile", spec, "--device-model", "h100", "--batch-size", "1", "--input-shape", tokens,
            "--dtype", "bfloat16", "-o", out,
        )  # fmt: skip
        for limit in limits:
            models = f"package-{name}-{limit}"
            result = run(
                folder, "partition", "--profile", out, "--gpus", gpus, "--straight", "-o", models,
                address_space=limit,
            )  # fmt: skip
            plan = _plan(folder / models)
            rows.append({
                "model": name, "profile_rc": profile["rc"],
                "limit": f"{limit // GIB} GiB" if limit else "none", **result,
                "stage_code": bool(plan and plan["stage_code"]), "stages": plan and plan["stages"],
            })  # fmt: skip
    return rows


def seventy_b(folder: Path) -> dict[str, Any]:
    spec = f"hf:{CONFIGS / 'llama3-70b.json'}"
    profile = _profile_row(folder, "70b.json", run(
        folder, "profile", spec, "--device-model", "h100", "--batch-size", "64", "--microbatch-size", "1",
        "--input-shape", "4096", "--dtype", "bfloat16", "-o", "70b.json",
    ))  # fmt: skip
    plan_run = run(
        folder, "partition", "--profile", "70b.json", "--topology", "8,8", "--bandwidth", "450GB/s,50GB/s",
        "--memory", "80GiB", "--optimizer", "adamw", "--schedule", "1f1b", "--microbatches", "64",
        "--recompute", "auto", "-o", "models70",
    )  # fmt: skip
    plan = _plan(folder / "models70")
    config = json.loads((CONFIGS / "llama3-70b.json").read_text())
    result = {"profile": profile, "partition": plan_run, "plan": plan}
    if plan:
        tokens = 4096
        params, per_token = training_flops_per_token(
            config, json.loads((folder / "70b.json").read_text()), tokens
        )
        rate = plan["throughput_samples_per_s"] * tokens * per_token
        result.update(
            both_wall_s=round(profile["wall_s"] + plan_run["wall_s"], 1),
            params_b=round(params / 1e9, 2),
            model_tflops_per_gpu=round(rate / plan["gpus"] / 1e12, 1),
            mfu=round(rate / plan["gpus"] / 989.4e12, 3),
        )  # fmt: skip
    return result


def training_flops_per_token(
    config: dict[str, Any], profile: dict[str, Any], tokens: int
) -> tuple[float, float]:
    """(parameters of a bfloat16 profile, training FLOPs per token at ``tokens`` a sequence): PaLM's
    count (appendix B), 6 per parameter outside the embeddings plus 12 L d T for attention."""
    params = sum(int(n.get("param_bytes", 0)) for n in profile["nodes"]) / 2
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    embeddings = (1 if config.get("tie_word_embeddings") else 2) * config["vocab_size"] * hidden
    return params, 6 * (params - embeddings) + 12 * layers * hidden * tokens


def _plan(root: Path) -> dict[str, Any] | None:
    found = sorted(root.glob("*/gpus=*/plan.json"))
    if not found:
        return None
    doc = json.loads(found[-1].read_text())
    stages = doc["stages"]
    return {
        "gpus": doc["gpus"],
        "schedule": doc["schedule"],
        "microbatches": doc["microbatches"],
        "stages": len(stages),
        "replicas": [s["replicas"] for s in stages],
        "recomputing": sum(1 for s in stages if s.get("recompute")),
        "max_memory_gib": round(max(s["memory_bytes"] for s in stages) / GIB, 2),
        "time_per_minibatch_s": doc["predicted"]["time_per_minibatch_s"],
        "throughput_samples_per_s": doc["predicted"]["throughput_samples_per_s"],
        "bubble_fraction": doc["predicted"]["bubble_fraction"],
        "stage_code": (found[-1].parent / "stage0.py").exists(),
    }


def _table(title: str, columns: dict[str, str], rows: list[dict[str, Any]]) -> list[str]:
    """A markdown section: ``columns`` maps each header to the row key it shows."""
    out = [f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(r.get(key, "")) for key in columns.values()) + " |" for r in rows]
    return [*out, ""]


def _depth_ratios(rows: list[dict[str, Any]]) -> list[str]:
    """Per ``--materialize`` mode, 32 blocks against 2: the ratio of their summed CPU and wall seconds
    over the rounds (CPU seconds are the fair figure on a shared machine)."""
    lines = []
    for mode in dict.fromkeys(r.get("mode", r.get("materialized")) for r in rows):

        def total(depth: int, key: str, mode: Any = mode) -> float:
            return sum(
                r[key] for r in rows if r.get("mode", r.get("materialized")) == mode and r["depth"] == depth
            )

        if total(2, "cpu_s") and total(2, "wall_s"):
            cpu, wall = total(32, "cpu_s") / total(2, "cpu_s"), total(32, "wall_s") / total(2, "wall_s")
            lines.append(
                f"- {mode}: 32 blocks took {cpu:.2f}x the CPU time of 2 blocks ({wall:.2f}x the wall time)"
            )
    return lines


def markdown(doc: dict[str, Any]) -> str:
    kept = f" (sections kept from an earlier run: {', '.join(doc['kept'])})" if doc.get("kept") else ""
    header = f"{doc['machine']}; wall {doc['wall_s']} s{kept}."
    lines = ["# bench_big: big models on this machine", "", header, ""]
    timing = {"wall s": "wall_s", "cpu s": "cpu_s", "peak RSS GiB": "peak_rss_gib", "load": "loadavg_1min"}
    if "blocks" in doc:
        title = "Profile time against identical blocks (Llama, hidden 512, batch 1 x 128 tokens)"
        columns = {"round": "round", "blocks": "depth", "--materialize": "mode",
                   "materialized": "materialized",
                   **timing, "layers": "layers", "distinct": "distinct"}  # fmt: skip
        lines += _table(title, columns, doc["blocks"])
        lines += [*_depth_ratios(doc["blocks"]), ""]
    if "memory" in doc:
        title = "Profile peak memory against model size (Llama, hidden 1024, batch 1 x 128 tokens)"
        columns = {"blocks": "depth", "materialize": "materialized", "weights GiB": "weights_gib",
                   "largest layer GiB": "largest_layer_gib", **timing}  # fmt: skip
        lines += _table(title, columns, doc["memory"])
    if "package" in doc:
        title = "partition writes the stage code of models it never builds"
        columns = {"model": "model", "address space": "limit", "rc": "rc", **timing, "stages": "stages",
                   "stage code": "stage_code"}  # fmt: skip
        lines += _table(title, columns, doc["package"])
    for key, title in (
        ("8b", "Llama-3-8B shape, measured here under an 8 GiB address space"),
        ("70b", "Llama-3-70B shape, estimated for H100s, planned on 8 x 8"),
    ):
        if key not in doc:
            continue
        d = doc[key]
        rows = [{"command": d[part]["args"][0], **d[part]} for part in ("profile", "partition")]
        lines += _table(title, {"command": "command", "rc": "rc", **timing, "last line": "last_line"}, rows)
        lines += [f"plan: `{json.dumps(d.get('plan'))}`", ""]
        if d.get("mfu") is not None:
            lines += [
                f"both commands {d['both_wall_s']} s; {d['params_b']}B parameters; "
                f"{d['model_tflops_per_gpu']} TFLOP/s of model FLOPs per GPU: MFU {100 * d['mfu']:.1f}% of "
                "the h100 preset's 989.4 TFLOP/s (bfloat16 dense peak).",
                "",
            ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    wanted = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section {unknown[0]}; choose from {', '.join(SECTIONS)}")
    started = time.perf_counter()
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    doc: dict[str, Any] = {"machine": f"{os.cpu_count()} CPUs, {ram:.0f} GiB"}
    with tempfile.TemporaryDirectory(prefix="bench-big-") as tmp:
        folder = Path(tmp)
        if "blocks" in wanted:
            doc["blocks"] = blocks(folder, args.rounds)
        if "memory" in wanted:
            doc["memory"] = memory(folder)
        if "8b" in wanted:
            doc["8b"] = eight_b(folder)
        if "package" in wanted:
            doc["package"] = package(folder)
        if "70b" in wanted:
            doc["70b"] = seventy_b(folder)
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    previous_file = args.out / "bench_big.json"
    previous = json.loads(previous_file.read_text()) if previous_file.is_file() else {}
    kept = [s for s in SECTIONS if s in previous and s not in wanted]  # sections not run: as they were
    doc.update({s: previous[s] for s in kept}, kept=kept)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "bench_big.json", json.dumps(doc, indent=1) + "\n")
    write_text_atomic(args.out / "bench_big.md", markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
