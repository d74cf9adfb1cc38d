"""A small progress display on stderr (no third-party dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts the steps of a long operation and shows them on ``stream``.

    On a terminal a single line is redrawn in place; otherwise (a log file, CI)
    a line is written for roughly every 10 % so logs stay short.
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.label = label
        self.total = max(int(total), 1)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.count = 0
        self._start = time.monotonic()
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, detail: str = "", step: int = 1) -> None:
        self.count = min(self.count + step, self.total)
        if not self.enabled:
            return
        fraction = self.count / self.total
        if self._tty:
            width = 24
            filled = int(round(width * fraction))
            bar = "#" * filled + "." * (width - filled)
            line = f"\r{self.label} [{bar}] {self.count}/{self.total} {detail}"
            self.stream.write(line[:160].ljust(80))
            self.stream.flush()
            return
        decile = int(fraction * 10)
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(f"{self.label}: {self.count}/{self.total} {detail}\n")
            self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self._start
        if self._tty:
            self.stream.write("\n")
        self.stream.write(f"{self.label}: done, {self.count} in {elapsed:.1f}s\n")
        self.stream.flush()


def note(message: str, *, enabled: bool = True) -> None:
    """One status line on stderr."""
    if enabled:
        print(message, file=sys.stderr, flush=True)
