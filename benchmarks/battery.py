"""Reliability battery: every bad input, malformed file, fault, security and scale case, as a user meets it.

Each row runs a real ``pipeplan`` process in a fresh folder, in its own session, with a deadline, and
ends in one outcome:

- ``clean``: bad input refused as it should be: exit 2 and one ``error:`` line naming the problem;
- ``handled``: correct work (exit 0), or a fault stopped within its bound with one line naming the rank;
- what the totals count as failures: ``traceback``, ``silently accepted`` (exit 0 where an error was
  due), ``hang`` (past the deadline), ``orphan`` (a process of the command alive 10 s after it ended)
  and ``wrong`` (any other mismatch: two lines, another exit code, a message missing its point);
- ``skipped``: the row needs what this machine lacks (``unshare`` for a small or read-only disk).

The bad-input rows are the table of ``tests/test_cli_bad_input.py`` (which checks them in-process on
every test run); here each runs as its own command, with its orphans and deadline watched. The other
rows are faults during runs (a rank raising, exiting, hanging or stopped by SIGSTOP in start-up or
mid-run, the launcher SIGKILLed), concurrency (two runs of one package, a partition over a running
one), full and read-only disks, refused checkpoints, the listeners of a run, and scale (profiles of
20,000 and 100,000 layers, a billion devices). Cases of issue 21 owned by other work (resume that
disagrees with its checkpoint, a schedule generated as it goes) are listed as such, not run.

Run:  .venv/bin/python benchmarks/battery.py [--only TEXT]   (writes benchmarks/results/battery.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.battery_rows import OWNED_ELSEWHERE, Row, rows  # noqa: E402
from benchmarks.reporting import write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FAILURES = ("traceback", "silently accepted", "hang", "orphan", "wrong")


@dataclass
class Outcome:
    """What one row did."""

    name: str
    group: str
    outcome: str
    exit: int | None
    seconds: float
    line: str
    peak_rss_mib: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (from /proc; a zombie, dead and awaiting its reaper, is none)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _left(sid: int, grace_s: float = 10.0) -> list[int]:
    """Processes of the session still alive ``grace_s`` after the command ended (polled: a rank may
    take a moment to see its launcher gone)."""
    end = time.monotonic() + grace_s
    while True:
        left = [p for p in _session(sid) if p != os.getpid()]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.25)


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> tuple[int | None, float | None]:
    """(exit code or None past the deadline, peak RSS in MiB of the command's own process)."""
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss / 1024
        time.sleep(0.05)
    return None, None


def _kill_session(sid: int) -> None:
    for pid in _session(sid):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_row(row: Row, work: Path) -> Outcome:
    """Set the row up in ``work``, run it, classify it."""
    command = row.setup(work)
    if command is None:
        return Outcome(row.name, row.group, "skipped", None, 0.0, "", note=row.skip_note)
    out = work / "output.txt"
    started = time.monotonic()
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            command.argv, cwd=work, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "COLUMNS": "200", **command.env},
        )  # fmt: skip
        problem = command.during(proc, work) if command.during else None
        code, rss = _wait(proc, started + row.deadline_s)
    ended = time.monotonic()
    if command.cleanup:
        command.cleanup()
    if code is None:
        _kill_session(proc.pid)
        proc.wait()
    left = _left(proc.pid)
    notes = {p: _cmdline(p) for p in left}
    _kill_session(proc.pid)
    text = out.read_text(errors="replace")
    result = Outcome(row.name, row.group, "", code, round(ended - started, 2), _last_line(text), rss)
    if row.max_rss_mib is not None and rss is not None and rss > row.max_rss_mib:
        problem = problem or f"peak resident memory {rss:.0f} MiB, over {row.max_rss_mib:.0f}"
    result.outcome = _classify(row, code, text, left, problem, work, ended)
    result.note = problem or ("left running: " + "; ".join(notes.values()) if left else "")
    return result


def _cmdline(pid: int) -> str:
    try:
        return f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return str(pid)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


# run's header before launch (runtime/job/run_header.py): a label, or a wrapped line of its text
_HEADER = re.compile(r"^((package|ranks|schedule|steps|writes|checkpoints|trace) {2,}| {12,}\S)")


def _classify(
    row: Row, code: int | None, text: str, left: list[int], problem: str | None, work: Path, ended: float
) -> str:
    lines = [
        line
        for line in text.splitlines()
        if line.strip()
        and not line.startswith(("step ", "training "))
        and not re.match(r"^ *\d+\.\d s  ", line)
        and not _HEADER.match(line)
    ]
    if code is None:
        return "hang"
    if "Traceback (most recent call last)" in text:
        return "traceback"
    if left:
        return "orphan"
    if row.expect == "error":
        if code == 0:
            return "silently accepted"
        errors = [line for line in lines if line.startswith("error: ")]
        ok = code == 2 and len(errors) == 1 and row.needle.lower() in errors[0].lower()
        return "clean" if ok and len(lines) == 1 and not problem else "wrong"
    if problem:
        return "wrong"
    if row.expect == "work":
        return "handled" if code == 0 and row.needle.lower() in text.lower() else "wrong"
    if row.expect == "killed":
        return "handled" if code == -signal.SIGKILL else "wrong"
    return "handled" if _bounded_stop(row, code, lines, work, ended) else "wrong"


def _bounded_stop(row: Row, code: int, lines: list[str], work: Path, ended: float) -> bool:
    """A fault: exit 1, one error line naming the rank, within the bound after the fault's time stamp."""
    errors = [line for line in lines if line.startswith("error: ")]
    stamp = work / "fault.txt"
    after = time.time() - (time.monotonic() - ended) - float(stamp.read_text()) if stamp.exists() else 0.0
    return code == 1 and len(errors) == 1 and row.needle in errors[0] and after <= row.within_s


def totals(results: list[Outcome]) -> dict[str, int]:
    """Rows per outcome (every outcome named, zeros included)."""
    names = ("clean", "handled", *FAILURES, "skipped")
    return {name: sum(r.outcome == name for r in results) for name in names}


def _markdown(results: list[Outcome], count: dict[str, int], meta: dict[str, Any]) -> str:
    head = (
        f"# Reliability battery\n\n`python benchmarks/battery.py` on {meta['host']} ({meta['cpus']} CPUs), "
        f"load {meta['load_before']} before and {meta['load_after']} after, {meta['wall_s']:.0f} s.\n\n"
        f"**{len(results)} rows: {count['clean']} clean, {count['handled']} handled; "
        + ", ".join(f"{count[name]} {name}" for name in FAILURES)
        + f"; {count['skipped']} skipped.**\n\n"
        "| row | group | outcome | exit | s | last line |\n|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r.name} | {r.group} | {r.outcome} | {r.exit} | {r.seconds} | "
        f"{(r.note or r.line).replace('|', '/')[:160]} |\n"
        for r in results
    )
    owned = "".join(f"- {case}: {owner}\n" for case, owner in OWNED_ELSEWHERE)
    return head + body + "\nCases of issue 21 owned by other work (not run here):\n\n" + owned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="Run the rows whose name contains this text.")
    args = parser.parse_args(argv)
    chosen = [row for row in rows() if args.only.lower() in row.name.lower()]
    meta: dict[str, Any] = {"host": os.uname().nodename, "cpus": os.cpu_count()}
    meta["load_before"] = [round(x, 2) for x in os.getloadavg()]
    started = time.monotonic()
    results = []
    for i, row in enumerate(chosen, 1):
        work = Path(tempfile.mkdtemp(prefix="battery-"))
        try:
            result = run_row(row, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        results.append(result)
        print(f"[{i}/{len(chosen)}] {result.outcome:18s} {result.seconds:7.1f}s  {row.name}", flush=True)
    meta["wall_s"] = time.monotonic() - started
    meta["load_after"] = [round(x, 2) for x in os.getloadavg()]
    count = totals(results)
    if not args.only:
        doc = {"totals": count, "rows": [r.__dict__ for r in results], **meta}
        write_results(RESULTS, "battery", doc, _markdown(results, count, meta))
    print(json.dumps(count))
    return 1 if any(count[name] for name in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
