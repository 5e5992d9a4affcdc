"""The rows of the reliability battery (``benchmarks/battery.py``): each a setup that writes what the
case needs into a fresh folder and returns the command to run, and what the command should end in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PIPEPLAN = str(Path(sys.executable).with_name("pipeplan"))
STAMP = "fault.txt"  # a sabotaged rank writes the time of its fault here, just before it


@dataclass(frozen=True)
class Command:
    """What a row runs: ``argv`` (in the row's folder), extra environment, ``during``: an action
    taken while it runs, returning a problem it saw (or None), and ``cleanup``, once it ended."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    during: Callable[[subprocess.Popen[bytes], Path], str | None] | None = None
    cleanup: Callable[[], None] | None = None


@dataclass(frozen=True)
class Row:
    """One case: ``expect`` is ``error`` (one ``error:`` line naming ``needle``, exit 2), ``work``
    (exit 0, ``needle`` in the output), ``stop`` (exit 1, one line naming ``needle``, within
    ``within_s`` of the fault) or ``killed`` (the command SIGKILLed, nothing left running); and
    within ``deadline_s``, its own process at most ``max_rss_mib`` resident where given."""

    name: str
    group: str
    expect: str
    needle: str
    setup: Callable[[Path], Command | None]
    deadline_s: float = 120.0
    within_s: float = float("inf")
    skip_note: str = ""
    max_rss_mib: float | None = None


OWNED_ELSEWHERE = (
    ("resume with another --steps (cosine horizon), --seed, --microbatches or optimizer", "resume work"),
    ("--resume --steps 2 on a step-4 checkpoint (trains nothing, overwrites metrics.json)", "resume work"),
    ("garbage, empty or list meta.json in the newest checkpoint (resume and export)", "checkpoint work"),
    ("a full disk during a checkpoint write reads `unexpected pos 64 vs 0`", "checkpoint work"),
    ("--steps 1000000 on tiny-mlp: 32 s and 2.9 GB before step 1", "schedule work"),
    ("checkpoints keep the last N", "checkpoint work"),
    ("a checkpoint holding a Python object torch.load(weights_only=True) refuses", "checkpoint work"),
)
"""Cases of issue 21 this battery does not run: other work owns them (see the issue)."""


def _package(work: Path, stages: int = 2) -> Path:
    from tests.runtime.packages import write_package

    return write_package(work / "pkg", "chain", replicas=(1,) * stages, microbatches=2, batch_size=4)


def _sabotaged(work: Path, statement: str, stage: int = 1) -> Path:
    """A 2-stage package whose ``stage`` runs ``statement`` from its 4th forward, stamping the time."""
    from tests.runtime.test_faults import _sabotage

    pkg = _package(work)
    stamp = f"open({str(work / STAMP)!r}, 'w').write(str(__import__('time').time())); {statement}"
    _sabotage(pkg, stage, stamp)
    return pkg


def _run(pkg: Path, *args: str) -> list[str]:
    return [PIPEPLAN, "run", str(pkg), "--steps", "6", *args]


def _fault(name: str, statement: str, needle: str, timeout: int = 5) -> Row:
    def setup(work: Path) -> Command:
        return Command(_run(_sabotaged(work, statement), "--timeout", str(timeout)))

    return Row(f"fault: {name}", "fault", "stop", needle, setup, within_s=timeout + 10)


def _stopped_in_start_up(work: Path) -> Command:
    pkg = _package(work)
    stage = pkg / "stage1.py"
    stage.write_text(
        "import os, signal, time\n"
        f"if os.environ.get('RANK') == '1':\n    open({str(work / STAMP)!r}, 'w').write(str(time.time()))\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n" + stage.read_text()
    )
    return Command(_run(pkg, "--timeout", "5"))


def _progress(pkg: Path, limit_s: float = 90.0) -> bool:
    """Wait until the run of ``pkg`` reported a step."""
    path = pkg / "run" / "progress.jsonl"
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return True
        time.sleep(0.2)
    return False


def _kill_launcher(proc: subprocess.Popen[bytes], work: Path) -> str | None:
    if not _progress(work / "pkg"):
        return "the run reported no step"
    os.kill(proc.pid, signal.SIGKILL)
    return None


def _background_run(pkg: Path) -> subprocess.Popen[bytes]:
    """A long run of ``pkg`` in its own session, once it has taken the folder's lock and a step."""
    first = subprocess.Popen(
        [PIPEPLAN, "run", str(pkg), "--steps", "100000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _progress(pkg)
    return first


def _stopper(first: subprocess.Popen[bytes]) -> Callable[[], None]:
    def stop() -> None:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()

    return stop


def _second_run(work: Path) -> Command:
    pkg = _package(work)
    first = _background_run(pkg)
    return Command(_run(pkg), cleanup=_stopper(first))


def _tiny_mlp(work: Path) -> Path:
    """tiny-mlp profiled and cut into 2 stages in ``work`` (profiles/, models/)."""
    subprocess.run(
        [PIPEPLAN, "profile", "tiny-mlp", "--repeats", "1", "--no-fixed-cost"],
        cwd=work,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [PIPEPLAN, "partition", "--gpus", "2", "--straight"], cwd=work, check=True, capture_output=True
    )
    return work / "models" / "tiny-mlp" / "gpus=2"


def _partition_over_a_run(work: Path) -> Command:
    first = _background_run(_tiny_mlp(work))
    return Command([PIPEPLAN, "partition", "--gpus", "2", "--straight"], cleanup=_stopper(first))


def _checkpointed(work: Path) -> Path:
    """A 2-stage package trained 2 steps with a checkpoint at each (``pkg/run/checkpoints``)."""
    pkg = _package(work)
    subprocess.run(
        [PIPEPLAN, "run", str(pkg), "--steps", "2", "--checkpoint-every", "1"],
        check=True,
        capture_output=True,
    )
    return pkg


def _unshare_ok() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_small_disk(work: Path, argv: list[str], size: str, read_only: bool = False, fill: int = 0) -> Command:
    """``argv`` with ``work/disk`` a tmpfs of ``size`` (read-only, or ``fill`` KiB already used), in a
    user and mount namespace: no root needed, nothing outside changes."""
    disk = work / "disk"
    disk.mkdir()
    steps = [f"mount -t tmpfs -o size={size} tmpfs {disk}"]
    steps += [f"mount -o remount,ro {disk}"] if read_only else []
    steps += [f"dd if=/dev/zero of={disk}/fill bs=1k count={fill} 2>/dev/null"] if fill else []
    script = " && ".join(steps) + " && exec " + " ".join(f"'{a}'" for a in argv)
    return Command(["unshare", "-rm", "sh", "-c", script])


def _disk_row(name: str, needle: str, make: Callable[[Path], Command]) -> Row:
    def setup(work: Path) -> Command | None:
        return make(work) if _unshare_ok() else None

    return Row(name, "disk", "error", needle, setup, skip_note="needs `unshare -rm` (user namespaces)")


def _fills_during_run(work: Path) -> Command:
    pkg = _package(work)
    disk = work / "disk"
    inner = [PIPEPLAN, "run", str(disk / "pkg"), "--steps", "100000", "--checkpoint-every", "1"]
    command = _in_small_disk(work, inner, "1400k")
    script = command.argv[-1].replace(" && exec ", f" && cp -r {pkg} {disk}/pkg && exec ", 1)
    return Command([*command.argv[:-1], script])


def _export_to(work: Path, size: str, read_only: bool, fill: int = 0) -> Command:
    pkg = _checkpointed(work)
    return _in_small_disk(
        work, [PIPEPLAN, "export", str(pkg), "-o", str(work / "disk" / "model.pt")], size, read_only, fill
    )


def _listeners(proc: subprocess.Popen[bytes], work: Path) -> str | None:
    """Every TCP listener of the run's processes is on the loopback interface."""
    if not _progress(work / "pkg"):
        return "the run reported no step"
    from benchmarks.battery_net import listeners_of_session

    found = listeners_of_session(proc.pid)
    outside = sorted(a for a in found if not a.startswith(("127.", "::1", "[::1]")))
    return f"listening on {', '.join(outside)}" if outside else None


def _chain_profile(work: Path, layers: int) -> list[str]:
    """A profile.json of ``layers`` layers in a chain, and the partition command that reads it."""
    zero = {"forward_ms": 0.0, "backward_ms": 0.0}
    nodes: list[dict[str, object]] = [{"id": "x", "op": "input", "inputs": [], **zero, "output_bytes": 4096}]
    for i in range(layers):
        nodes.append(
            {
                "id": f"l{i}",
                "name": f"layers.{i}",
                "op": "call_module",
                "inputs": [nodes[-1]["id"]],
                "forward_ms": 1.0 + (i % 7) / 10,
                "backward_ms": 2.0,
                "output_bytes": 4096,
                "param_bytes": 65536,
            }
        )
    nodes.append({"id": "out", "op": "output", "inputs": [nodes[-1]["id"]], **zero})
    doc = {"schema": "pipeplan.profile/1", "model": "chain", "tracer": "pipedream", "batch_size": 8}
    (work / "profile.json").write_text(json.dumps({**doc, "nodes": nodes}))
    return [
        PIPEPLAN,
        "partition",
        "--profile",
        str(work / "profile.json"),
        "--gpus",
        "4",
        "-o",
        str(work / "m"),
    ]


def _scale(layers: int, expect: str, needle: str) -> Row:
    """``partition --gpus 4`` of a chain of ``layers`` layers, within a minute and 1 GiB resident."""
    name = f"scale: partition a {layers:,}-layer profile"
    setup = lambda work: Command(_chain_profile(work, layers))  # noqa: E731
    return Row(name, "scale", expect, needle, setup, deadline_s=60, max_rss_mib=1024)


def _user_loss(work: Path) -> Command:
    source = Path(__file__).resolve().parent.parent / "tests" / "partitioner" / "loss_output_model.py"
    subprocess.run(
        [PIPEPLAN, "profile", f"{source}:hf_llama", "--batch-size", "4", "--repeats", "1", "--no-fixed-cost"],
        cwd=work,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [PIPEPLAN, "partition", "--gpus", "2", "--straight"], cwd=work, check=True, capture_output=True
    )
    pkg = work / "models" / "loss_output_model-hf_llama" / "gpus=2"
    script = f"{PIPEPLAN} verify {pkg} && exec {PIPEPLAN} run {pkg} --steps 2"
    return Command(["sh", "-c", script])


def _long_sequence(family: str) -> Callable[[Path], Command]:
    """``run --data text:FILE --seq-len 1000`` on a package of ``hf:FAMILY`` (128 positions)."""

    def setup(work: Path) -> Command:
        profile = [
            PIPEPLAN,
            "profile",
            f"hf:{family}",
            "--batch-size",
            "4",
            "--repeats",
            "1",
            "--no-fixed-cost",
        ]
        subprocess.run(profile, cwd=work, check=True, capture_output=True)
        partition = [PIPEPLAN, "partition", "--gpus", "2", "--straight"]
        subprocess.run(partition, cwd=work, check=True, capture_output=True)
        (work / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
        pkg = work / "models" / f"hf-{family}" / "gpus=2"
        data = ["--data", f"text:{work / 'text.txt'}", "--seq-len", "1000", "--steps", "1"]
        return Command([PIPEPLAN, "run", str(pkg), *data])

    return setup


def _bad_input_rows() -> list[Row]:
    from tests.test_cli_bad_input import ROWS

    def setup(make: Callable[[Path], list[str]]) -> Callable[[Path], Command]:
        return lambda work: Command([PIPEPLAN, *make(work)])

    return [Row(name, "input", "error", needle, setup(make)) for name, (make, needle) in ROWS.items()]


def rows() -> list[Row]:
    """Every row, bad input first."""
    return [
        *_bad_input_rows(),
        _fault("a rank raises mid-run", "raise ValueError('boom')", "rank 1 (stage 1) failed: ValueError"),
        _fault("a rank exits mid-run", "import os; os._exit(7)", "rank 1 (stage 1) failed: the process died"),
        _fault(
            "a rank hangs mid-run", "import time; time.sleep(3600)", "rank 1 (stage 1) stopped responding"
        ),
        _fault(
            "a rank is SIGSTOPped mid-run",
            "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)",
            "rank 1 (stage 1) stopped responding",
        ),
        Row(
            "fault: a rank is SIGSTOPped in start-up",
            "fault",
            "stop",
            "rank 1 (stage 1) stopped responding",
            _stopped_in_start_up,
            within_s=15,
        ),
        Row(
            "fault: the loss turns NaN",
            "fault",
            "stop",
            "the loss is",
            lambda w: Command(_run(_package(w), "--lr", "1e30")),
        ),
        Row(
            "fault: the launcher is SIGKILLed mid-run",
            "fault",
            "killed",
            "",
            lambda w: Command(
                [PIPEPLAN, "run", str(_package(w)), "--steps", "100000"], during=_kill_launcher
            ),
        ),
        Row(
            "concurrency: a second run of a running package",
            "concurrency",
            "error",
            "being trained by another",
            _second_run,
        ),
        Row(
            "concurrency: partition over a running package",
            "concurrency",
            "error",
            "being trained",
            _partition_over_a_run,
        ),
        _disk_row("disk: the disk fills during a run", "is full", _fills_during_run),
        _disk_row("disk: export -o on a read-only disk", "read-only", lambda w: _export_to(w, "1m", True)),
        _disk_row("disk: export -o on a full disk", "is full", lambda w: _export_to(w, "1100k", False, 1000)),
        Row(
            "security: a local run listens on loopback only",
            "security",
            "work",
            "time per minibatch",
            lambda w: Command([PIPEPLAN, "run", str(_package(w)), "--steps", "400"], during=_listeners),
        ),
        _scale(100_000, "error", "layers"),  # refused at once: within a minute and 1 GiB all the same
        _scale(20_000, "work", "wrote"),
        Row(
            "model: a model file's loss_fn reads output.logits (verify, run)",
            "model",
            "work",
            "match",
            _user_loss,
            deadline_s=300,
        ),
        Row(
            "model: --seq-len 1000 on gpt2's 128 learned positions",
            "model",
            "error",
            "positions",
            _long_sequence("gpt2"),
            deadline_s=300,
        ),
        Row(
            "model: --seq-len 1000 on llama (rotary positions: it trains)",
            "model",
            "work",
            "loss",
            _long_sequence("llama"),
            deadline_s=300,
        ),
    ]
