"""Where a traced run's time goes on each rank: compute spans by kind, blocked communication, and the
idle gaps between spans (the runtime's own work between actions, which no span covers).

Reads the Chrome trace ``pipeplan run PKG --trace tr.json`` writes and skips each rank's first fifth
of the traced time (start-up and the first, allocating steps). With ``--stages N`` (a plan of N
stages, one per rank), the gaps after spans that send a message (a forward before the last stage, a
backward after the first) are set against the gaps after the other compute spans: their difference
is what posting a send costs the sender. Every trace also gets the mean idle time after an action
(what ``pipeplan calibrate --trace`` takes as the cluster's time per action), and that time split by
what follows it. Pure Python, nothing written.

Run:  .venv/bin/python benchmarks/trace_gaps.py tr.json [--stages 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from partitioner.calibration.link_latency import action_gaps


def _spans(path: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's complete spans after the first fifth of its traced time, in time order."""
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in json.loads(path.read_text())["traceEvents"]:
        if e.get("ph") == "X":
            by_rank[int(e["pid"])].append(e)
    out = {}
    for rank, spans in sorted(by_rank.items()):
        spans.sort(key=lambda e: float(e["ts"]))
        first, last = float(spans[0]["ts"]), max(float(e["ts"]) + float(e["dur"]) for e in spans)
        out[rank] = [e for e in spans if float(e["ts"]) >= first + 0.2 * (last - first)]
    return out


def _kind(span: dict[str, Any]) -> str:
    name = str(span["name"])
    return f"compute {name[0]}" if span.get("cat") == "compute" else f"comm {name.split(' ')[0]}"


def _before(after: dict[str, Any]) -> str:
    """What an action's idle gap leads into: a blocked receive, the rank's next action, or other."""
    if str(after["name"]).startswith("recv "):
        return "a blocked receive"
    return "the next action" if after.get("cat") == "compute" else "other spans"


def report(path: Path, stages: int | None) -> list[str]:
    lines = []
    sending: list[float] = []
    other: list[float] = []
    leads: dict[str, list[float]] = defaultdict(list)
    for rank, spans in _spans(path).items():
        totals: Counter[str] = Counter()
        gap_ms = 0.0
        for span, after in itertools.pairwise(spans):
            totals[_kind(span)] += float(span["dur"]) / 1e3
            gap = max(0.0, float(after["ts"]) - float(span["ts"]) - float(span["dur"])) / 1e3
            gap_ms += gap
            name, stage = str(span["name"]), int(span["tid"])
            if span.get("cat") == "compute" and name[:1] in ("F", "B", "W"):
                leads[_before(after)].append(gap)
            if stages and span.get("cat") == "compute":
                sends = (name[0] == "F" and stage < stages - 1) or (name[0] == "B" and stage > 0)
                (sending if sends else other).append(gap)
        names = {str(s["name"]) for s in spans if s.get("cat") == "compute" and str(s["name"])[0] == "S"}
        steps = max(1, len(names))  # (a rank hosting two stages steps each: one S span per stage)
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items()))
        lines.append(
            f"rank {rank}: {kinds} ms; gaps {gap_ms:.1f} ms ({gap_ms / steps:.2f} ms a step, {steps} steps)"
        )
    gaps = action_gaps(json.loads(path.read_text())["traceEvents"])  # what calibrate --trace takes
    if gaps:
        parts = ", ".join(
            f"before {k} {statistics.fmean(v):.3f} ms ({len(v)})" for k, v in sorted(leads.items())
        )
        lines.append(
            f"idle after an action: mean {statistics.fmean(gaps) * 1e3:.3f} ms over {len(gaps)}; {parts}"
        )
    if stages:
        lines.append(
            f"gap after a send: median {statistics.median(sending):.3f} ms ({len(sending)}); after other "
            f"compute spans: {statistics.median(other):.3f} ms ({len(other)})"
            if sending and other
            else "too few spans to compare the gaps"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--stages", type=int, default=None, help="The plan's stages, one per rank.")
    args = parser.parse_args(argv)
    print("\n".join(report(args.trace, args.stages)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
