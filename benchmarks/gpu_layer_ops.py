"""One decoder layer of a big Llama shape on the GPU: where its time goes, and what an explicit mask costs.

The profiles of Hugging Face models are traced with torch.export, and under export transformers builds
the causal mask as a tensor and passes it to ``scaled_dot_product_attention`` (it skips the mask only in
eager mode): the stage code runs attention with an explicit boolean mask, which rules out the flash
kernel. This script times one ``LlamaDecoderLayer`` (bfloat16, one sequence of ``--tokens``), forward
and backward, with CUDA events (median of ``--repeats`` after warm-up):

- ``causal``: no mask, ``is_causal`` (what an eager Hugging Face model runs on unpadded sequences);
- ``masked``: the boolean causal mask the exported graph passes (``[1, 1, T, T]``);
- ``linears``: the layer's seven matrix products alone (forward), the matmul share of the layer;

and, under ``torch.profiler``, the masked and causal layers' kernels grouped (matrix products,
attention, the rest), so a device model's estimate can be checked part by part.

Run:  python benchmarks/gpu_layer_ops.py [--configs llama3-8b,llama3-70b] [--tokens 4096] [--out DIR]
      python benchmarks/gpu_layer_ops.py --cpu   (a small config, the script's plumbing)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_check import timed_ms  # noqa: E402 (the repository root first, as a script)
from benchmarks.reporting import write_results  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"


def _layer(config_file: Path, device: torch.device) -> tuple[Any, Any, Any]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    doc = {k: v for k, v in json.loads(config_file.read_text()).items() if k != "architectures"}
    config = LlamaConfig(**doc)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
        rotary = LlamaRotaryEmbedding(config)
    return config, layer, rotary


def _kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "efficient_attention", "attention", "sdpa", "cutlassf")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "sm90_xmma", "cublas", "matmul", "addmm", "aten::mm")):
        return "matmul"
    return "other"


def _breakdown(step: Callable[[], Any], cuda: bool) -> dict[str, Any]:
    """Device time of one forward+backward by kind of kernel (self time; CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    top = []
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us <= 0:
            continue
        kinds[_kind(event.key)] = kinds.get(_kind(event.key), 0.0) + us / 1e3
        top.append((us / 1e3, event.key[:90]))
    top.sort(reverse=True)
    return {"ms": {k: round(v, 3) for k, v in kinds.items()}, "top": [[round(t, 3), k] for t, k in top[:10]]}


def measure(config_file: Path, tokens: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """The layer's forward and backward with and without the explicit mask, its linears, its kernels."""
    cuda = device.type == "cuda"
    config, layer, rotary = _layer(config_file, device)
    x = torch.randn(1, tokens, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(tokens, device=device)[None]
    cos, sin = rotary(x, position_ids)
    mask = torch.ones(tokens, tokens, device=device, dtype=torch.bool).tril()[None, None]
    grad = torch.randn_like(x)

    def forward(masked: bool) -> torch.Tensor:
        out = layer(x, attention_mask=mask if masked else None, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    def step(masked: bool) -> Callable[[], None]:
        def run() -> None:
            forward(masked).backward(grad)

        return run

    def fwd(masked: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                forward(masked)

        return run

    weights = [m.weight for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    flat = x.detach().reshape(tokens, -1)
    inter = torch.randn(tokens, config.intermediate_size, device=device, dtype=torch.bfloat16)

    def linears() -> None:
        with torch.no_grad():
            for w in weights:
                (inter if w.shape[1] == config.intermediate_size else flat) @ w.T

    row: dict[str, Any] = {"tokens": tokens, "hidden": config.hidden_size}
    for name, masked in (("causal", False), ("masked", True)):
        f = timed_ms(fwd(masked), device.type, repeats, warmup=3)
        s = timed_ms(step(masked), device.type, repeats, warmup=3)
        row[name] = {"forward_ms": round(f, 3), "backward_ms": round(s - f, 3), "step_ms": round(s, 3)}
        row[name]["kinds"] = _breakdown(step(masked), cuda)
    row["linears_forward_ms"] = round(timed_ms(linears, device.type, repeats, warmup=3), 3)
    params = sum(w.numel() for w in weights)
    row["linear_tflop"] = round(2 * params * tokens / 1e12, 3)
    row["linears_tflops"] = round(row["linear_tflop"] / row["linears_forward_ms"] * 1e3, 1)
    return row


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# One decoder layer on {report['device']}, {report['date']}", "",
             f"torch {report['torch']}; command: `{report['command']}`", "",
             "| config | tokens | attention | forward ms | backward ms | kernels: matmul ms | attention ms "
             "| other ms |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in report["rows"].items():
        for kind in ("causal", "masked"):
            r = row[kind]
            ms = r["kinds"]["ms"]
            cells = [name, str(row["tokens"]), kind, str(r["forward_ms"]), str(r["backward_ms"]),
                     *(str(ms.get(k, 0.0)) for k in ("matmul", "attention", "other"))]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| config | linears forward ms | TFLOP | TFLOP/s |", "|---|---|---|---|"]
    for name, row in report["rows"].items():
        lines.append(
            f"| {name} | {row['linears_forward_ms']} | {row['linear_tflop']} | {row['linears_tflops']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="a small config on the CPU (the plumbing)")
    parser.add_argument("--configs", default="llama3-8b,llama3-70b", help="files under benchmarks/configs")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="folder for the .json and .md [print only]")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    configs = ["llama-h512"] if args.cpu else args.configs.split(",")
    tokens = 64 if args.cpu else args.tokens
    report: dict[str, Any] = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["benchmarks/gpu_layer_ops.py", *(argv if argv is not None else sys.argv[1:])]),
        "rows": {},
    }  # fmt: skip
    for name in configs:
        report["rows"][name] = measure(
            CONFIGS / f"{name}.json", tokens, device, 2 if args.cpu else args.repeats
        )
        print(f"[layer_ops] {name} done", flush=True)
    page = markdown(report)
    if args.out:
        write_results(args.out, "layer_ops", report, page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
