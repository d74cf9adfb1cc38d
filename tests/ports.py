"""Free TCP ports for the tests that launch ranks or servers.

A port asked of the kernel with bind(0) comes from the ephemeral range, the
range every outgoing connection also draws from; handing its number to a
process that binds it later races with them. These ports come from outside
that range, every port of a block is checked free, and no port is handed out
twice in one test process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(n) for n in _RANGE_FILE.read_text().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _is_free(port: int) -> bool:
    if port in _HANDED_OUT:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _outside_ephemeral(count: int) -> list[range]:
    """Where blocks of `count` ports may start: below and above the ephemeral range."""
    low, high = _ephemeral_range()
    spans = [range(10000, low - count + 1), range(high + 1, 65536 - count)]
    return [span for span in spans if len(span) >= 100] or [range(1024, 65536 - count)]


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive free ports outside the ephemeral range."""
    spans = _outside_ephemeral(count)
    for _ in range(200):
        start = random.choice(random.choice(spans))
        if all(_is_free(start + i) for i in range(count)):
            _HANDED_OUT.update(range(start, start + count))
            return start
    raise RuntimeError(f"no {count} consecutive free ports outside the ephemeral range")
