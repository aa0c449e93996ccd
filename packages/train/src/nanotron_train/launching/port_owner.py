"""Whether a given process is the one listening on a local TCP port (Linux: /proc).

`make run` reuses a dashboard that already answers on its port only when it is the one it
started itself (the pid in .cache/dashboard.pid): a dashboard of another clone or another user
on the same port would otherwise receive this clone's runs into its own database. The kernel
knows which socket listens on the port (/proc/net/tcp{,6}: its inode) and which process holds
that socket (/proc/PID/fd links `socket:[inode]`); a process of another user cannot be read,
which is the answer too: not ours.
"""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on `port` (IPv4 and IPv6); None where /proc cannot tell."""
    found: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(fields[9])
    return found if readable else None


def holds_port(pid: int, port: int) -> bool | None:
    """True when process `pid` listens on `port`, False when another one does (or none),
    None where this cannot be known (no /proc, e.g. macOS)."""
    inodes = listening_inodes(port)
    if inodes is None:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or another user's process
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[len("socket:[") : -1] in inodes:
            return True
    return False
