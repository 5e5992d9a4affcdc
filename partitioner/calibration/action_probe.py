"""The runtime's own time per action, measured by ``pipeplan probe``: a run of almost empty actions.

Every compute action a rank plays (a forward, a backward, a split backward's B or W) costs the
runtime some time besides its layers: the Python between two actions, posting the action's messages,
setting up autograd (``Cluster.action_s``, priced per action by the whole cost model). ``calibrate
--trace`` measures it from a traced run of a real plan; a probed cluster should price it before any
run. So ``probe`` runs the runtime's own loop on actions that compute almost nothing: ``tiny-mlp``
(three linear layers of width 16) cut into one stage per rank, 1F1B with four microbatches a rank,
traced, and takes the same figure calibrate takes from a trace
(:func:`partitioner.calibration.link_latency.action_gaps`: the mean idle time from each action's end to its
rank's next span), on two ranks of this machine, as the run's own ``pipeplan`` commands make and run
it (``profile``, ``partition --straight``, ``run --trace``). On a machine whose ranks are busy with
other jobs the figure measures them too, like every other figure of ``probe``.

One figure per cluster file, from one stage per rank: a rank hosting two stages (interleaved, zbv)
idles longer after an action (docs/fidelity.md), which this does not measure.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.calibration.link_latency import FEWEST, action_gaps
from partitioner.errors import PipeplanError
from runtime.files.atomic import write_text_atomic

__all__ = ["HOSTING", "ActionProbe", "probe_actions", "record_actions"]

#: the minibatches the probing run plays (its first fifth of traced time is skipped)
STEPS = 20
#: tiny-mlp's last layer of every stage but the last: one stage a rank, so every action posts and
#: waits for its messages as a pipeline's do (left to the optimizer, tiny-mlp is one stage, and the
#: figure missed the messages' share: 0.05 ms against 0.25 ms with the cuts, docs/fidelity.md)
CUTS = ("act1", "act2")
#: tiny-mlp cut into four stages, two a rank on two ranks, for the schedules that lay several stages
#: on a rank (:data:`HOSTING`): such a rank idles longer after an action than a rank of one stage
HOSTED_CUTS = ("fc1", "act1", "fc2")
#: the schedules whose time per action ``probe`` times apart, on two ranks of two stages each
HOSTING = ("interleaved", "zbv")


@dataclass(frozen=True)
class ActionProbe:
    """What the probing run measured: the mean gap after an action (seconds), the gaps' count and
    their median, the command lines it ran, and the ranks that traced actions (one stage each)."""

    action_s: float
    actions: int
    median_s: float
    commands: tuple[str, ...]
    ranks: int = 0


def probe_actions(
    ranks: int = 2, device: str = "cpu", timeout: float = 300.0, schedule: str = "1f1b"
) -> ActionProbe:
    """Run the probing pipeline on ``ranks`` ranks (at most the 3 stages tiny-mlp cuts into) of
    ``device`` under ``schedule`` (1f1b: one stage a rank; one of :data:`HOSTING`: two ranks of two
    stages each) and return its time per action; PipeplanError where a step fails or the trace holds
    fewer than :data:`~partitioner.calibration.link_latency.FEWEST` actions."""
    ranks = 2 if schedule in HOSTING else max(2, min(ranks, 3))
    cuts = HOSTED_CUTS if schedule in HOSTING else CUTS[: ranks - 1]
    with tempfile.TemporaryDirectory(prefix="pipeplan-probe-") as tmp:
        where = Path(tmp)
        steps = [
            ["profile", "tiny-mlp", "--batch-size", str(8 * ranks), "--no-fixed-cost", "--repeats", "1",
             "--device", device, "-o", str(where / "profile.json")],
            ["partition", "--profile", str(where / "profile.json"), "--gpus", str(ranks),
             "--cuts", ",".join(cuts), "--replicas", ",".join(["1"] * (len(cuts) + 1)),
             "--schedule", schedule, "--microbatches", str(4 * ranks), "-o", str(where / "pkg")],
        ]  # fmt: skip
        for args in steps:
            _pipeplan(args, timeout)
        package = next(where.glob("pkg/*/gpus=*"), None)
        if package is None:
            raise PipeplanError("probe: the probing plan wrote no package")
        trace = where / "trace.json"
        run = ["run", str(package), "--steps", str(STEPS), "--trace", str(trace)]
        _pipeplan(run, timeout)
        events = json.loads(trace.read_text())["traceEvents"]
    gaps = action_gaps(events)
    traced = len({int(e["pid"]) for e in events if e.get("ph") == "X" and e.get("cat") == "compute"})
    if traced != ranks:
        raise PipeplanError(f"probe: the probing run computed on {traced} of its {ranks} ranks")
    if len(gaps) < FEWEST:
        raise PipeplanError(f"probe: the probing run's trace timed {len(gaps)} actions, fewer than {FEWEST}")
    commands = tuple(" ".join(["pipeplan", *a]) for a in [*steps, run])
    return ActionProbe(statistics.fmean(gaps), len(gaps), statistics.median(gaps), commands, traced)


def _pipeplan(args: list[str], timeout: float) -> None:
    """Run one ``pipeplan`` command in a child process (the run's own launcher starts its ranks)."""
    command = [sys.executable, "-c", "import cli; cli.main()", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        raise PipeplanError(
            f"probe: `pipeplan {args[0]}` of the probing run took over {timeout:.0f} s"
        ) from None
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise PipeplanError(f"probe: `pipeplan {args[0]}` of the probing run failed: {last[0]}")


def record_actions(
    path: Path, found: ActionProbe, hosting: Mapping[str, ActionProbe] | None = None
) -> dict[str, Any]:
    """Write ``found`` into the cluster file at ``path``: its ``action_overhead`` (what every plan made
    with it prices per action), ``hosting``'s figures as ``action_overhead_by_schedule`` (what plans
    of those schedules price instead) and, under ``probe.actions`` (and ``probe.actions_by_schedule``),
    how each was measured. Returns the file."""
    doc = json.loads(path.read_text())
    doc["action_overhead"] = found.action_s
    doc.setdefault("probe", {})["actions"] = _how(found)
    if hosting:
        doc["action_overhead_by_schedule"] = {name: probe.action_s for name, probe in hosting.items()}
        doc["probe"]["actions_by_schedule"] = {name: _how(probe) for name, probe in hosting.items()}
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")
    return dict(doc)


def _how(found: ActionProbe) -> dict[str, Any]:
    """How a figure was measured, as the cluster file records it."""
    return {
        "action_s": found.action_s,
        "median_s": found.median_s,
        "actions_timed": found.actions,
        "ranks": found.ranks,
        "commands": list(found.commands),
    }
