"""Golden plans: every plan the benchmarks and the schedules make on PipeDream's profiles, kept as
digests so a change to the optimizer's structure can show it changed no plan, bit for bit.

A case is a name and a thunk returning a ``Plan`` (or raising a ``PipeplanError``, whose message is
the golden value). A plan's digest is the SHA-256 of its plan.json with the solve time zeroed (the
one field that varies from run to run); the file keeps a short summary beside it so a mismatch
reads as what changed.

    .venv/bin/python -m tests.partitioner.optimizer.golden --write   # regenerate tests/golden/plans.json
    .venv/bin/python -m tests.partitioner.optimizer.golden           # compare every case, say which differ
    .venv/bin/python -m tests.partitioner.optimizer.golden --dump DIR --against OLD
                 # also keep every plan's JSON in DIR, and list field by field how they differ from OLD's

The cases: bench_optimizer's 56 (14 profiles x 4, 8, 16 GPUs and a 4x4 hierarchy, with and without
activation charges, and its three baselines) and 28 memory-limited ones (16 GPUs at 16 and 8 GiB);
bench_sync's 42 (1f1b, 8 microbatches, 4, 8, 16 GPUs, its straight plan and four baselines); every
schedule at 4, 8, 16 GPUs with 2 microbatches per GPU (interleaved with 2 virtual stages); and, on
the small profiles, the other ways in: recomputation under a memory limit, the ILP, hierarchies of
the synchronous schedules, ``evaluate`` of fixed cuts under every schedule, and ``--schedule auto``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

from partitioner.errors import PipeplanError
from partitioner.graph import Profile, read_graph_txt
from partitioner.optimizer import SolveOptions, evaluate, solve
from partitioner.optimizer.auto import solve_auto
from partitioner.optimizer.pricing.simulate import Simulation, simulate
from partitioner.optimizer.search.candidates import data_parallel, parameter_balanced, time_balanced, uniform
from partitioner.plan import Cluster, Level, Plan, plan_to_json
from tests.data import PIPEDREAM_PROFILES

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "plans.json"
SCHEDULES = ("pipedream", "1f1b", "gpipe", "zb1p", "interleaved", "zbv")
CLUSTERS = {
    "4": Cluster.flat(4, 1e9),
    "8": Cluster.flat(8, 1e9),
    "16": Cluster.flat(16, 1e9),
    "4,4": Cluster((Level(4, 4294967296.0), Level(4, 1250000000.0))),
}
EXTRA = ("alexnet", "vgg16", "squeezenet1_0", "resnet18", "gnmt")
"""Profiles small enough for the extra cases (memory limits, recomputation, ILP, hierarchies...)."""
QUICK = {"alexnet": True, "resnet18": True, "squeezenet1_0": False, "vgg16": False}
"""The profiles whose cases the test suite checks (seconds), and whether their extra cases too."""

Case = tuple[str, Callable[[], Plan | Simulation]]


def _batch_sizes() -> dict[str, int]:
    """Folder -> batch size from the profiles' README table (as bench_optimizer reads it)."""
    sizes: dict[str, int] = {}
    for line in (PIPEDREAM_PROFILES / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[2].replace("/", "").replace(" ", "").isdigit():
            continue
        names = [n.strip() for n in cells[0].split("/")]
        values = [int(v) for v in cells[2].split("/")]
        sizes.update(zip(names, values, strict=False))
    return sizes


@cache
def profile(name: str) -> Profile:
    return read_graph_txt(PIPEDREAM_PROFILES / name / "graph.txt", _batch_sizes().get(name))


def profiles() -> list[str]:
    return sorted(p.parent.name for p in PIPEDREAM_PROFILES.glob("*/graph.txt"))


def _optimizer_cases(name: str) -> Iterator[Case]:
    p = profile(name)
    for label, cluster in CLUSTERS.items():
        yield f"optimizer/{name}/{label}", lambda c=cluster: solve(p, c)
        yield f"optimizer/{name}/{label}/no-comm", lambda c=cluster: solve(p, c, activation_comm=False)
        for make in (parameter_balanced, uniform, time_balanced):
            yield (
                f"optimizer/{name}/{label}/{make.__name__}",
                lambda c=cluster, f=make: f(p, c, "pipedream", 1, "sgd"),
            )
    for gib in (16, 8):
        yield (
            f"memory/{name}/16@{gib}GiB",
            lambda g=gib: solve(p, Cluster.flat(16, 1e9, memory_bytes=g << 30)),
        )


def _sync_cases(name: str) -> Iterator[Case]:
    p = profile(name)
    for gpus in (4, 8, 16):
        c = Cluster.flat(gpus, 1e9)
        yield f"sync/{name}/{gpus}", lambda c=c: solve(p, c, "1f1b", 8)
        yield f"sync/{name}/{gpus}/straight", lambda c=c: solve(p, c, "1f1b", 8, straight=True)
        for make in (data_parallel, parameter_balanced, uniform, time_balanced):
            yield f"sync/{name}/{gpus}/{make.__name__}", lambda c=c, f=make: f(p, c, "1f1b", 8, "sgd")


def _schedule_cases(name: str) -> Iterator[Case]:
    p = profile(name)
    for schedule in SCHEDULES:
        for gpus in (4, 8, 16):
            c = Cluster.flat(gpus, 1e9)
            yield f"schedule/{name}/{schedule}/{gpus}", partial(_solve, p, c, schedule, 2 * gpus)


def _solve(p: Profile, cluster: Cluster, schedule: str, m: int, optimizer: str = "sgd", **kw: Any) -> Plan:
    """``solve`` with interleaved's 2 virtual stages."""
    v = 2 if schedule == "interleaved" else 1
    return solve(p, cluster, schedule, m, optimizer, virtual_stages=v, **kw)


@cache
def _tight(name: str, schedule: str, fraction: float) -> Cluster:
    """4 GPUs with ``fraction`` of the memory the schedule's fastest adam plan takes without a limit."""
    plan = _solve(profile(name), Cluster.flat(4, 1e9), schedule, 8, "adam")
    per_gpu: dict[int, int] = {}
    for s in plan.stages:
        for r in s.ranks:
            per_gpu[r] = per_gpu.get(r, 0) + s.memory_bytes
    return Cluster.flat(4, 1e9, memory_bytes=int(max(per_gpu.values()) * fraction))


def _recomputing(name: str, schedule: str, fraction: float, mode: str) -> Plan:
    return _solve(profile(name), _tight(name, schedule, fraction), schedule, 8, "adam", recompute=mode)


def _evaluated(p: Profile, schedule: str) -> Plan:
    """Fixed cuts evenly over the layers: 8 one-device stages (interleaved, zbv), else 3 on 2, 1, 1."""
    layers = [n.id for n in p.layers]
    stages = 8 if schedule in ("interleaved", "zbv") else 3
    cuts = [layers[len(layers) * (i + 1) // stages - 1] for i in range(stages - 1)]
    replicas = [1] * stages if stages == 8 else [2, 1, 1]
    v = 2 if schedule == "interleaved" else 1
    return evaluate(p, Cluster.flat(4, 1e9), cuts, replicas, schedule, 8, virtual_stages=v)


def _simulated(p: Profile, schedule: str) -> Simulation:
    return simulate(_solve(p, Cluster.flat(4, 1e9), schedule, 8), p)


def _straight_adam(name: str) -> Plan:
    return _solve(profile(name), _tight(name, "gpipe", 0.95), "gpipe", 8, "adam", straight=True)


def _extra_cases(name: str) -> Iterator[Case]:
    """The other ways in, on a small profile."""
    p = profile(name)
    for schedule in SCHEDULES:
        for frac in (0.95, 0.8):
            for mode in ("none", "all", "auto"):
                yield (
                    f"extra/{name}/{schedule}/adam@{frac}/recompute-{mode}",
                    partial(_recomputing, name, schedule, frac, mode),
                )
        yield f"extra/{name}/{schedule}/4,4", partial(_solve, p, CLUSTERS["4,4"], schedule, 8)
        yield f"extra/{name}/{schedule}/evaluate", partial(_evaluated, p, schedule)
        yield f"simulate/{name}/{schedule}", partial(_simulated, p, schedule)
    yield f"extra/{name}/auto", lambda: solve_auto(p, Cluster.flat(4, 1e9), SolveOptions(microbatches=8)).plan
    yield f"extra/{name}/straight-adam", partial(_straight_adam, name)
    if name in ("alexnet", "vgg16", "squeezenet1_0"):  # (the ILP's profiles: few layers)
        for schedule in ("pipedream", "1f1b"):
            yield f"extra/{name}/{schedule}/ilp", partial(_solve, p, CLUSTERS["4"], schedule, 4, solver="ilp")


def cases(everything: bool = True) -> list[Case]:
    """Every golden case (``everything``), or the :data:`QUICK` ones."""
    names = profiles() if everything else [n for n in profiles() if n in QUICK]
    out: list[Case] = []
    for name in names:
        out += [*_optimizer_cases(name), *_sync_cases(name), *_schedule_cases(name)]
        if name in EXTRA and (everything or QUICK[name]):
            out += list(_extra_cases(name))
    return out


def canonical(plan: Plan | Simulation) -> dict[str, Any]:
    """A plan's plan.json with the solve time zeroed, or a simulation's fields."""
    if isinstance(plan, Simulation):
        return asdict(plan)
    return plan_to_json(replace(plan, solver=replace(plan.solver, solve_time_s=0.0)))


def differences(old: Any, new: Any, where: str = "") -> Iterator[str]:
    """Paths where two JSON values differ, numbers with their relative difference."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            yield from differences(old.get(key), new.get(key), f"{where}.{key}")
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            yield from differences(a, b, f"{where}[{i}]")
    elif isinstance(old, float) and isinstance(new, float) and old != new:
        yield f"{where}: {old!r} -> {new!r} (relative {abs(new - old) / max(abs(old), 1e-300):.1e})"
    elif old != new:
        yield f"{where}: {old!r} -> {new!r}"


def digest(plan: Plan | Simulation) -> dict[str, Any]:
    """What the golden file keeps of a plan: the SHA-256 of its plan.json (solve time zeroed) and a
    summary that reads as the difference when the digest changes; of a simulation, the SHA-256 of
    its fields, events included."""
    text = json.dumps(canonical(plan), sort_keys=True)
    if isinstance(plan, Simulation):
        return {
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "time_per_minibatch_s": repr(plan.time_per_minibatch_s),
            "in_flight": list(plan.in_flight),
        }
    return {
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "time_per_minibatch_s": repr(plan.predicted.time_per_minibatch_s),
        "replicas": [s.replicas for s in plan.stages],
        "layers": [len(s.nodes) for s in plan.stages],
        "microbatches": plan.microbatches,
    }


def outcome(make: Callable[[], Plan | Simulation], dump: Path | None = None) -> dict[str, Any]:
    """A case's golden value: its plan's digest, or the error it raises (its JSON into ``dump``)."""
    try:
        made = make()
    except PipeplanError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if dump is not None:
        dump.parent.mkdir(parents=True, exist_ok=True)
        dump.write_text(json.dumps(canonical(made), sort_keys=True))
    return digest(made)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="regenerate tests/golden/plans.json")
    parser.add_argument("--dump", type=Path, help="write every plan's JSON under this folder")
    parser.add_argument("--against", type=Path, help="with --dump: a folder of older dumps to diff against")
    args = parser.parse_args()
    golden = {} if args.write else json.loads(GOLDEN.read_text())
    found: dict[str, Any] = {}
    differ = 0
    began = time.perf_counter()
    for name, make in cases():
        found[name] = outcome(make, args.dump / f"{name}.json" if args.dump else None)
        if not args.write and golden.get(name) != found[name]:
            differ += 1
            print(f"DIFFERS {name}: {golden.get(name)} -> {found[name]}", flush=True)
            if args.dump and args.against and (args.against / f"{name}.json").exists():
                old = json.loads((args.against / f"{name}.json").read_text())
                new = json.loads((args.dump / f"{name}.json").read_text())
                for line in differences(old, new):
                    print(f"    {line}", flush=True)
    if args.write:
        GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    missing = sorted(set(golden) - set(found))
    print(f"{len(found)} cases, {differ} differ, {len(missing)} missing, {time.perf_counter() - began:.0f} s")
    sys.exit(1 if differ or missing else 0)


if __name__ == "__main__":
    main()
