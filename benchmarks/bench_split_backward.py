"""What the runtime's split backward (zb1p, zbv: B then W) costs against one fused backward.

The cost model splits a stage's profiled backward into B and W that add up to it (``W_SHARE``).
The runtime's split (``runtime.executing.split_backward``) computes the input gradients in B, then each weight
gradient in W with one ``torch.autograd.grad`` call per boundary node (a ``Linear``'s
``AddmmBackward``, a norm's weight multiply): correct, never re-running the input chain, but each
call has a fixed cost that a small layer's matrices do not amortise. This times a stack of Llama
decoder layers (transformers' own, random weights) three ways on one thread: the fused backward,
B, and W, each from a fresh forward, medians of ``--rounds``, after 3 warm-up rounds.

Run:  .venv/bin/python benchmarks/bench_split_backward.py   (about 6 minutes on 2 cores)
(writes benchmarks/results/bench_split_backward.{json,md})
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.executing.split_backward import backward_input, backward_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a script
from benchmarks.reporting import write_results

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((64, 128, 2), (256, 1024, 2), (512, 2048, 2))  # hidden, sequence, layers


def _stack(hidden: int, layers: int) -> tuple[torch.nn.ModuleList, Any]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=layers, attn_implementation="sdpa",
    )  # fmt: skip
    return torch.nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(layers)), LlamaRotaryEmbedding(cfg)


def measure(hidden: int, seq: int, layers: int, batch: int, rounds: int) -> dict[str, Any]:
    """Median milliseconds of the fused backward, B and W of ``layers`` decoder layers."""
    stack, rope = _stack(hidden, layers)
    x0 = torch.randn(batch, seq, hidden)
    pe = rope(x0, torch.arange(seq)[None])
    grad = torch.randn_like(x0)
    params = list(stack.parameters())

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_(True)
        y = x
        for layer in stack:
            out = layer(y, position_embeddings=pe)
            y = out[0] if isinstance(out, tuple) else out
        return x, y

    def fused() -> tuple[float, ...]:
        _, y = forward()
        start = time.perf_counter()
        torch.autograd.backward([y], [grad])
        stack.zero_grad(set_to_none=True)
        return (time.perf_counter() - start,)

    def split() -> tuple[float, ...]:
        x, y = forward()
        start = time.perf_counter()
        _, work = backward_input([y], [grad], [x], params)
        middle = time.perf_counter()
        backward_weight(work)
        return middle - start, time.perf_counter() - middle, len(work.boundary), len(work.rest)

    def medians(run: Callable[[], tuple[float, ...]]) -> list[float]:
        for _ in range(3):
            run()
        samples = [run() for _ in range(rounds)]
        return [statistics.median(s[i] for s in samples) for i in range(len(samples[0]))]

    (plain,) = medians(fused)
    b, w, boundary, rest = medians(split)
    return {
        "hidden": hidden, "seq": seq, "layers": layers, "batch": batch,
        "fused_ms": plain * 1e3, "b_ms": b * 1e3, "w_ms": w * 1e3, "split_over_fused": (b + w) / plain,
        "w_calls": int(boundary) + (1 if rest else 0),
    }  # fmt: skip


def markdown(doc: dict[str, Any]) -> str:
    rows = [
        f"| {r['hidden']} | {r['seq']} | {r['layers']} | {r['fused_ms']:.2f} | {r['b_ms']:.2f} | "
        f"{r['w_ms']:.2f} | {r['w_calls']} | {r['split_over_fused']:.2f} |"
        for r in doc["rows"]
    ]
    return "\n".join([
        "# bench_split_backward: the runtime's B + W against one fused backward",
        "",
        f"`{doc['command']}`, {doc['date']}, torch {doc['torch']}, 1 thread, batch {doc['batch']}, "
        f"medians of {doc['rounds']} rounds. Llama decoder layers (transformers), random weights.",
        "",
        "| hidden | sequence | layers | fused backward ms | B ms | W ms | W's calls | (B + W) / fused |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [measure(h, s, n, args.batch, args.rounds) for h, s, n in SHAPES]
    for r in rows:
        ratio = r["split_over_fused"]
        print(f"hidden {r['hidden']:4d}: fused {r['fused_ms']:8.2f} ms, B {r['b_ms']:8.2f}, "
              f"W {r['w_ms']:8.2f} ({r['w_calls']} calls), (B + W) / fused {ratio:.2f}")  # fmt: skip
    doc = {
        "command": "python benchmarks/bench_split_backward.py", "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__, "machine": platform.machine(), "rounds": args.rounds, "batch": args.batch,
        "rows": rows,
    }  # fmt: skip
    write_results(RESULTS, "bench_split_backward", doc, markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
