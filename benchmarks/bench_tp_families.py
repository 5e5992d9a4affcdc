"""Tensor parallelism on Hugging Face families beyond the test suite's, by hand: each family's small
config profiled, planned as PP2 x TP2 (TP2 x DP2, one stage, where its embeddings are tied), trained
4 SGD steps on 4 CPU ranks over gloo and compared with plain single-process training.

    PYTHONPATH=. python benchmarks/bench_tp_families.py [--only olmo2]

Prints, per family, the layers kept whole by the dry run (partitioner/profiler/tensor_check.py),
the plan styles not understood, how many layers tensor_plan.json splits, and how many tensors
ended equal to plain training within 1e-5 of their largest value (the 3D tests' criterion).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

# family -> the spec's source: a FAMILIES name, or a config written here (glm4 has no small default)
GLM4 = {"model_type": "glm4", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 128, "pad_token_id": 0, "eos_token_id": 0, "bos_token_id": 0,
        "tie_word_embeddings": False}  # fmt: skip
FAMILIES = ("gemma2", "phi3", "olmo2", "glm4")


def check(family: str, tmp: Path) -> str:
    """One family's row: what the plan splits and whether its weights end as plain training's."""
    import torch

    from partitioner.profiler.profile import profile_model
    from tests.runtime.helpers import run
    from tests.runtime.packages3d import config_file, generate_3d
    from tests.runtime.reference3d import assert_trained_as_plain, plain_state

    torch.set_num_threads(1)
    start = time.perf_counter()
    spec = config_file(tmp, GLM4) if family == "glm4" else f"hf:{family}"
    profile = profile_model(spec, batch_size=8, repeats=1)
    tied = bool(profile.tied)
    layouts = [(2, 2, "none")] if tied else [(2, 1, "none")] * 2
    pkg = generate_3d(tmp / "pkg", profile, layouts, "1f1b", 4, 8)
    split = (pkg / "tensor_plan.json").read_text(encoding="utf-8").count('"name"')
    sgd = {"lr": 0.05, "momentum": 0.9}
    run(pkg, steps=4, checkpoint_dir=str(tmp / "ckpt"), **sgd)
    equal = assert_trained_as_plain(tmp / "ckpt", 4, len(layouts), plain_state(pkg, 4, 4, 8, **sgd))
    whole = sorted(profile.extra.get("tensor_parallel_whole", {}))
    unknown = profile.extra.get("tensor_parallel_unknown_styles", {})
    layout = "TP2 x DP2" if tied else "PP2 x TP2"
    return (
        f"{family}: {layout}, {split} layers split, kept whole {whole or 'none'}, styles not understood "
        f"{unknown or 'none'}; {equal} tensors equal to plain training ({time.perf_counter() - start:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=FAMILIES)
    args = parser.parse_args()
    for family in (args.only,) if args.only else FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            print(check(family, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
