"""A rank dies with its launcher, whatever ends the launcher (SIGKILL included).

Without this, a ``pipeplan run`` killed with SIGKILL leaves its ranks re-parented to PID 1: they train
on to the last step, keep writing checkpoints into the folder a restarted ``--resume`` job reads, and
finally block forever on a pipe nobody reads. ``prctl(PR_SET_PDEATHSIG)`` would only cover the rank's
parent, which is the fork server (or the torchrun agent), not necessarily the launcher; a pidfd of the
launcher (Linux 5.3+) becomes readable the moment it exits, whoever its children are. Elsewhere a
thread polls the launcher's pid once a second.

A stopped rank (SIGSTOP, a debugger) cannot act on the SIGTERM the agent sends when another rank
fails; the agent then waits 30 s before SIGKILL. :func:`wake_siblings` resumes it first.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from pathlib import Path

__all__ = ["die_with", "wake_siblings"]


def die_with(pid: int) -> None:
    """SIGKILL this process as soon as process ``pid`` has exited (checked from a daemon thread)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except (AttributeError, OSError):  # no pidfd here: poll
        threading.Thread(target=_poll, args=(pid,), daemon=True, name="pipeplan-lifeline").start()
        return
    threading.Thread(target=_wait, args=(fd,), daemon=True, name="pipeplan-lifeline").start()


def _wait(fd: int) -> None:
    select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _poll(pid: int) -> None:
    while _alive(pid):
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wake_siblings() -> None:
    """SIGCONT the other children of this rank's parent (the job's other local ranks), so a stopped one
    ends on the agent's SIGTERM at once instead of after the agent's 30 s grace. Harmless to a rank
    that runs; Linux only (reads /proc), a no-op elsewhere."""
    parent = os.getppid()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and int(entry.name) != os.getpid():
                os.kill(int(entry.name), signal.SIGCONT)
        except (OSError, IndexError, ValueError):
            continue
