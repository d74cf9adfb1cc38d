"""Free TCP ports for the tests that launch ranks or servers.

A port asked of the kernel with bind(0) comes from the ephemeral range, the
range every outgoing connection also draws from; handing its number to a
process that binds it later races with them. These ports come from below that
range, and every port of a block is checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive free ports below the ephemeral range."""
    low, high = 10000, min(_ephemeral_start(), 32768) - count
    if high - low < 1000:  # an unusual ephemeral range: any checked block will do
        high = 65000 - count
    for _ in range(200):
        start = random.randrange(low, high)
        if all(_is_free(start + i) for i in range(count)):
            return start
    raise RuntimeError(f"no {count} consecutive free ports between {low} and {high}")
