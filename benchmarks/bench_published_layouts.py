"""Megatron-LM's published layouts, priced by pipeplan's model without a GPU (issue 40, item 3).

Megatron-LM's README ("Training Speed and Scalability": Megatron-core on H100s, a vocabulary of
131,072, 4096 tokens) publishes, per model, its TP x PP x DP layout and the TFLOP/s a GPU it
reached. Each row here builds the same shape as a weightless Hugging Face config (Llama layers with
Megatron's GPT shapes: multi-head attention, an MLP of 8h/3 gated columns, so 12 h^2 parameters a
layer as GPT's 4h MLP has), estimates it for the ``h100`` device model (``pipeplan profile
--device-model h100``), prices the published layout (``solve_layout``: its t, d and the
distributed optimizer, the cuts and microbatches searched under 1f1b) and reports predicted over
published throughput in tokens a second a GPU. The published TFLOP/s become tokens with Megatron's
own FLOP count (``num_floating_point_operations`` of megatron/training: 12 L h^2 (6 + s/h) + 6 h V
a token, no causal halving). Nothing is calibrated to these rows: the device model is the preset
(its documented factors, measured on one H100; docs/devices.md).

What the README's text does not give (its table is an image) is assumed, per row, in ``ASSUMED``:
the global batch (1152 sequences, the batch of its GPT-3 strong-scaling runs) and, for the 7.1B,
the shape (hidden 4096 x 32 layers: 12 h^2 L + V h = 7.0B). The 32B and 462B rows are listed
unpriced: their shapes are in the image only.

    python benchmarks/bench_published_layouts.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))

from benchmarks.child_runs import estimated_profile  # noqa: E402
from partitioner.graph import load_profile  # noqa: E402
from partitioner.optimizer.layouts import solve_layout, tokens_per_device  # noqa: E402
from partitioner.optimizer.options import SolveOptions  # noqa: E402
from partitioner.optimizer.pricing.layout import Layout  # noqa: E402
from partitioner.partition import cluster_of  # noqa: E402
from partitioner.profiler.update_cost import with_update_time  # noqa: E402

SEQ, VOCAB, BATCH = 4096, 131072, 1152
TOLERANCE = 0.15

#: (name, hidden, layers, heads, t, p, d, published TFLOP/s a GPU, published MFU)
ROWS = (
    ("7.1B", 4096, 32, 32, 2, 1, 48, 465.9, 0.47),
    ("32B", None, None, None, 8, 1, 48, 459.6, 0.46),
    ("70B-class", 8192, 84, 64, 8, 2, 48, 419.7, 0.42),
    ("177B", 12288, 96, 96, 8, 6, 48, 432.8, 0.44),
    ("462B", None, None, None, 8, 16, 48, 459.9, 0.47),
)
ASSUMED = {
    "7.1B": "shape hidden 4096 x 32 layers x 32 heads (from the parameter count); batch 1152",
    "32B": "shape not in the README's text (the table is an image): not priced",
    "70B-class": "batch 1152 (hidden 8192 and 84 layers as published)",
    "177B": "GPT-3's shape (hidden 12288, 96 layers, 96 heads); batch 1152, the README's GPT-3 batch",
    "462B": "shape not in the README's text (the table is an image): not priced",
}


def megatron_flops_per_token(hidden: int, layers: int) -> float:
    """Megatron's count for a GPT of multi-head attention and a 4h MLP, one token, forward and
    backward: 12 L h^2 (6 + s/h) + 6 h V."""
    return 12.0 * layers * hidden**2 * (6.0 + SEQ / hidden) + 6.0 * hidden * VOCAB


def config(hidden: int, layers: int, heads: int) -> dict[str, object]:
    """A Llama-architecture config of Megatron's GPT shape (12 h^2 parameters a layer)."""
    inner = -(-8 * hidden // 3 // 64) * 64  # 8h/3, rounded up to 64
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": inner, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "vocab_size": VOCAB, "max_position_embeddings": SEQ,
        "tie_word_embeddings": False, "use_cache": False, "hidden_act": "silu",
    }  # fmt: skip


def profile_of(folder: Path, name: str, cfg: dict[str, object]) -> Path:
    """``pipeplan profile`` of ``cfg`` for the h100 device model, in ``folder``."""
    spec = folder / f"{name}.json"
    spec.write_text(json.dumps(cfg), encoding="utf-8")
    return estimated_profile(spec, folder / name / "profile.json", BATCH, SEQ)[0]


def price(row: tuple[object, ...], folder: Path) -> dict[str, object]:
    name, hidden, layers, heads, t, p, d, tflops, mfu = row
    out: dict[str, object] = {
        "model": name, "layout": f"TP{t} x PP{p} x DP{d}", "gpus": t * p * d, "published_tflops": tflops,
        "published_mfu": mfu, "assumed": ASSUMED[name],
    }  # fmt: skip
    if hidden is None:
        out["reason"] = ASSUMED[name]
        return out
    assert isinstance(hidden, int) and isinstance(layers, int) and isinstance(heads, int)
    assert isinstance(t, int) and isinstance(p, int) and isinstance(d, int) and isinstance(tflops, float)
    started = time.perf_counter()
    profile = with_update_time(
        load_profile(profile_of(folder, str(name), config(hidden, layers, heads))), "adam"
    )
    cluster = cluster_of(None, None, None, None, f"dgx-h100:{t * p * d // 8}", None, profile.device)
    opts = SolveOptions("1f1b", 1, "adam", True, "dp", True, "auto")
    plan = solve_layout(profile, cluster, Layout(t, d, "optimizer"), opts, ("1f1b",), BATCH)
    if len(plan.stages) != p:  # the published depth: a copy's stages on its t x d groups
        out["reason"] = f"the layout search used {len(plan.stages)} stages, not {p}"
    predicted = tokens_per_device(plan, profile) or 0.0
    published = tflops * 1e12 / megatron_flops_per_token(hidden, layers)
    out.update(
        predicted_tokens_per_gpu=round(predicted, 1), published_tokens_per_gpu=round(published, 1),
        ratio=round(predicted / published, 3), stages=len(plan.stages), microbatches=plan.microbatches,
        recomputing=sum(s.recompute for s in plan.stages),
        memory_gib=round(max(s.memory_bytes for s in plan.stages) / 2**30, 1),
        step_ms=round(plan.extra["layout"]["step_s"] * 1e3, 1),
        seconds=round(time.perf_counter() - started, 1),
    )  # fmt: skip
    if abs(predicted / published - 1.0) > TOLERANCE and "reason" not in out:
        out["reason"] = "outside 15%: see benchmarks/results/bench_published_layouts.md"
    return out


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "# Megatron-LM's published layouts priced by pipeplan (h100 device model, no GPU)",
        "",
        "`python benchmarks/bench_published_layouts.py`; tokens/s a GPU; published TFLOP/s turned into",
        "tokens with Megatron's FLOP count; predicted with the distributed optimizer (`--shard",
        "optimizer`), 1f1b, the cuts and microbatches searched. Nothing calibrated to these rows.",
        "",
        "| model | layout | GPUs | published TFLOP/s (MFU) | published tok/s | predicted tok/s "
        "| predicted/published | GiB a GPU | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['gpus']} | "
            f"{r['published_tflops']} ({r['published_mfu']:.0%}) | "
            f"{r.get('published_tokens_per_gpu', '-')} | {r.get('predicted_tokens_per_gpu', '-')} | "
            f"{r.get('ratio', '-')} | {r.get('memory_gib', '-')} | {r.get('reason', r['assumed'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [price(row, Path(tmp)) for row in ROWS]
        for r in rows:
            print(r, flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_published_layouts.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    (RESULTS / "bench_published_layouts.md").write_text(markdown(rows), encoding="utf-8")


if __name__ == "__main__":
    main()
