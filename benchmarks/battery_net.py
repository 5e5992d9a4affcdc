"""The TCP listeners of a process session, read from /proc (Linux): which addresses a run listens on."""

from __future__ import annotations

import ipaddress
from pathlib import Path

__all__ = ["listeners_of_session"]


def _session_pids(sid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_address: str) -> str:
    """``0100007F:1F90`` -> ``127.0.0.1:8080`` (the kernel writes addresses in host byte order)."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = str(ipaddress.IPv4Address(raw[::-1]))
    else:
        ip = str(ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))))
    return f"{ip}:{int(port, 16)}"


def listeners_of_session(sid: int) -> list[str]:
    """``address:port`` of every listening TCP socket a process of session ``sid`` holds."""
    inodes = set().union(*(_socket_inodes(pid) for pid in _session_pids(sid)))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(_address(fields[1]))
    return found
