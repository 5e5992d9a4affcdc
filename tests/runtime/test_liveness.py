"""runtime.faults.liveness and runtime.faults.startup_checkin: a stopped rank is found by its silence, a
start-up wait names the ranks behind it, and the rendezvous store listens on the master address only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime.errors import PeerLost
from runtime.faults.liveness import Watchdog
from runtime.faults.startup_checkin import CheckIn
from runtime.job.launch import _rendezvous_store
from runtime.settings.run_options import RunOptions

_BEAT = """
import time
from runtime.faults.liveness import start_heartbeat
assert start_heartbeat(1, 5.0)
print("beating", flush=True)
time.sleep(60)
"""


def _listening(port: int) -> set[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
def test_the_rendezvous_store_listens_on_loopback_only() -> None:
    with _rendezvous_store(RunOptions("pkg", timeout=5)) as (port, store):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))  # type: ignore[attr-defined]
        client.set("k", "v")
        assert store.get("k") == b"v"
        assert _listening(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 nor ::


def test_a_stopped_rank_is_killed_and_named_after_its_silence() -> None:
    with _rendezvous_store(RunOptions("pkg", timeout=5)) as (port, store):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env["TORCHELASTIC_RUN_ID"] = "test"
        rank = subprocess.Popen([sys.executable, "-c", _BEAT], env=env, stdout=subprocess.PIPE, text=True)
        assert rank.stdout is not None and rank.stdout.readline().strip() == "beating"
        with Watchdog(store, "test", [0, 1], timeout_s=2.0) as watchdog:  # rank 0 never beats: not judged
            time.sleep(1.5)
            assert rank.poll() is None and not watchdog.stalled  # beating: left alone
            os.kill(rank.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            code = rank.wait(timeout=10)
        assert code == -signal.SIGKILL and time.monotonic() - stopped < 5
        assert list(watchdog.stalled) == [1] and watchdog.stalled[1] > 2.0


class _Store:
    """The two store calls CheckIn makes, in memory."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]


def test_a_failed_start_up_wait_names_the_ranks_behind() -> None:
    store = _Store()
    ranks = [CheckIn(r, 4, store) for r in range(4)]
    for r, steps in enumerate((3, 1, 3)):  # rank 3 never checked in; rank 1 stopped after step 1
        ranks[r].done(steps)
    wanted = r"waiting for rank\(s\) \[1, 3\], failed, another rank"
    with pytest.raises(PeerLost, match=wanted) as info, ranks[0].waiting("agreeing on the start step"):
        raise RuntimeError("Timed out waiting 10000ms for send operation to complete")
    assert "Timed out waiting" in str(info.value)
    with ranks[2].waiting("nothing fails"):
        pass
    assert CheckIn(0, 2, None).behind() == []  # no store: nobody is named
