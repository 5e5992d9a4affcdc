"""Where `pipeplan profile`'s time goes as a model gets deeper: CPU time per phase, by depth and mode.

Llama configs identical but for their depth (hidden 512, as bench_big.py's ``blocks`` section) are
profiled at batch 1 x 128 tokens, ``--materialize layer`` and ``whole``, each in a fresh process.
The profiler's phases (building, tracing, the layer measurements, the whole step, the optimizer
update) are timed by wrapping their functions: process CPU time (robust to the other jobs of a
shared machine) and wall time, with the 1-minute load average. A phase whose CPU time grows with
the depth is where the per-block cost goes.

``--variant stack-traces`` traces as torch.export does by default, recording a Python stack for
every graph node (the profiler turns that off: ``partitioner.profiler.trace._no_stack_traces``),
to measure what turning it off saves.

Run:  .venv/bin/python benchmarks/bench_profile_phases.py [--depths 2,32] [--variants none,stack-traces]
(writes benchmarks/results/bench_profile_phases.{json,md})
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.files.atomic import write_text_atomic

HERE = Path(__file__).resolve().parent
PHASES = (
    "load_model", "trace_model", "trace_weightless", "LayerProfiler.profile", "LayerwiseProfiler.profile",
    "measure_step", "measure_update", "measure_fixed",
)  # fmt: skip


def child(spec: str, mode: str, variant: str) -> dict[str, Any]:
    """Profile ``spec`` in this process with its phases timed: the row."""
    import partitioner.profiler.profile as profiler
    from partitioner.profiler import layerwise, measure, trace

    if variant == "stack-traces":
        trace._no_stack_traces = contextlib.nullcontext  # type: ignore[assignment]
    spent: dict[str, list[float]] = {}

    def timed(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                total = spent.setdefault(label, [0.0, 0.0])
                total[0] += time.process_time() - cpu
                total[1] += time.perf_counter() - wall

        setattr(owner, name, wrapper)

    for name in (
        "load_model",
        "trace_model",
        "trace_weightless",
        "measure_step",
        "measure_update",
        "measure_fixed",
    ):
        timed(profiler, name, name)
    timed(measure.LayerProfiler, "profile", "LayerProfiler.profile")
    timed(layerwise.LayerwiseProfiler, "profile", "LayerwiseProfiler.profile")
    load = os.getloadavg()[0]
    cpu, wall = time.process_time(), time.perf_counter()
    result = profiler.profile_model(spec, 1, (128,), materialize=mode)
    measured = result.extra.get("layers_measured", {})
    return {
        "mode": mode, "variant": variant,
        "layers": measured.get("layers"), "distinct": measured.get("distinct"),
        "cpu_s": round(time.process_time() - cpu, 2), "wall_s": round(time.perf_counter() - wall, 2),
        "loadavg_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
        "phases": {k: {"cpu_s": round(v[0], 2), "wall_s": round(v[1], 2)} for k, v in spent.items()},
    }  # fmt: skip


def llama(folder: Path, layers: int) -> str:
    sys.path.insert(0, str(HERE))
    from bench_big import llama as config

    return config(folder, f"blocks{layers}", 512, layers)


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# bench_profile_phases: where profile's time goes as the model gets deeper",
        "",
        f"{doc['machine']}; Llama, hidden 512, batch 1 x 128 tokens; CPU seconds of profile_model "
        "(imports and process start not counted) and of each phase (wall in the JSON); load = 1-minute "
        "load average before and after.",
        "",
        "| mode | variant | blocks | cpu s | wall s | load | " + " | ".join(p for p in PHASES) + " |",
        "|" + "---|" * (6 + len(PHASES)),
    ]
    for r in doc["rows"]:
        phases = [str(r["phases"].get(p, {}).get("cpu_s", "")) for p in PHASES]
        load = "-".join(str(x) for x in r["loadavg_1min"])
        lines.append(
            f"| {r['mode']} | {r['variant']} | {r['depth']} | {r['cpu_s']} | {r['wall_s']} | {load} | "
            + " | ".join(phases)
            + " |"
        )
    return "\n".join([*lines, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="2,32")
    parser.add_argument("--modes", default="layer,whole")
    parser.add_argument("--variants", default="none,stack-traces")
    parser.add_argument("--child", nargs=3, metavar=("SPEC", "MODE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-phases-") as tmp:
        for variant in args.variants.split(","):
            for mode in args.modes.split(","):
                for depth in (int(d) for d in args.depths.split(",")):
                    spec = llama(Path(tmp), depth)
                    command = [sys.executable, __file__, "--child", spec, mode, variant]
                    done = subprocess.run(command, capture_output=True, text=True, check=True)
                    rows.append({"depth": depth, **json.loads(done.stdout.strip().splitlines()[-1])})
                    print(json.dumps(rows[-1]), flush=True)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    doc = {"machine": f"{os.cpu_count()} CPUs, {ram:.0f} GiB", "rows": rows}
    write_text_atomic(HERE / "results" / "bench_profile_phases.json", json.dumps(doc, indent=1) + "\n")
    write_text_atomic(HERE / "results" / "bench_profile_phases.md", markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
