"""3D packages for runtime tests: a 2D plan's stages rewritten (tensor_parallel, shard, ranks) before
code generation, until ``partition --tensor-parallel/--shard`` writes them itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["LLAMA", "MIXTRAL", "QWEN2", "bench_models", "config_file", "generate_3d"]

_DECODER = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 128}  # fmt: skip
LLAMA: dict[str, Any] = {"model_type": "llama", **_DECODER}
QWEN2: dict[str, Any] = {"model_type": "qwen2", **_DECODER}
MIXTRAL: dict[str, Any] = {
    "model_type": "mixtral",
    **_DECODER,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def config_file(folder: Path, config: dict[str, Any]) -> str:
    """An ``hf:`` spec of ``config`` written as a config.json under ``folder``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{config['model_type']}.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return f"hf:{path}"


def bench_models(folder: Path) -> dict[str, str]:
    """The three models the 3D benchmarks run, by name: the llama- and qwen2-shaped configs (written
    under ``folder``) and the user MLP file, each as the spec ``pipeplan profile`` reads."""
    return {
        "hf:llama-shaped": config_file(folder, LLAMA),
        "hf:qwen2-shaped": config_file(folder, QWEN2),
        "mlp file": f"{Path('tests/runtime/mlp3d_model.py').resolve()}:model",
    }


def generate_3d(
    out: Path,
    profile: Any,
    layouts: Sequence[tuple[int, int, str]],
    schedule: str = "1f1b",
    microbatches: int = 4,
    batch_size: int = 8,
    cuts: Sequence[float] | None = None,
    recompute: bool = False,
) -> Path:
    """A package of ``profile`` with one stage per ``(t, d, shard)`` of ``layouts``, cut at equal
    layer counts (or at ``cuts``, fractions of the layers), each stage on ``t * d`` consecutive
    ranks, data-major. ``schedule`` zbv lays stage ``s`` and ``2p - 1 - s`` on one copy's ranks,
    interleaved stage ``s`` on copy ``s mod p``. ``recompute``: every stage recomputes its forward."""
    from partitioner import plan
    from partitioner.generation import codegen

    ids = [n.id for n in profile.nodes]
    count = len(layouts)
    fractions = list(cuts) if cuts is not None else [i / count for i in range(1, count)]
    edges = [0, *(round(f * len(ids)) for f in fractions), len(ids)]
    ranks = _ranks(layouts, schedule)
    stages = tuple(
        replace(
            plan.Stage(k, tuple(ids[edges[k] : edges[k + 1]]), d, ranks[k]),
            tensor_parallel=t,
            shard=shard,
            recompute=recompute,
        )
        for k, (t, d, shard) in enumerate(layouts)
    )
    gpus = len({r for rs in ranks for r in rs})
    made = plan.Plan(
        gpus=gpus,
        cluster=plan.Cluster.flat(gpus),
        schedule=schedule,
        microbatches=microbatches,
        stages=stages,
        predicted=plan.Prediction(0.01),
        solver=plan.SolverInfo("test", 0.0, True),
        batch_size=batch_size,
        model=profile.model,
        virtual_stages=2 if schedule in ("zbv", "interleaved") else 1,
    )
    codegen.write_package(profile, made, out)
    return out


def _ranks(layouts: Sequence[tuple[int, int, str]], schedule: str) -> list[tuple[int, ...]]:
    sizes = [t * d for t, d, _ in layouts]
    if schedule not in ("zbv", "interleaved"):
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [tuple(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]
    p = len(layouts) // 2
    if schedule == "interleaved":  # stage s on copy s mod p
        return [tuple(range(sum(sizes[: k % p]), sum(sizes[: k % p]) + sizes[k])) for k in range(2 * p)]
    down = [sum(sizes[:k]) for k in range(p)]
    return [
        tuple(range(down[k], down[k] + sizes[k]))
        if k < p
        else tuple(range(down[2 * p - 1 - k], down[2 * p - 1 - k] + sizes[k]))
        for k in range(2 * p)
    ]
