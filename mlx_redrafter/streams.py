"""The generation stream: where the decoding loop's device work runs."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx

THREAD = threading.local()


def generation_stream() -> Any:
    """This thread's generation stream, made once per thread (an MLX stream belongs to
    the thread that made it, and each stream holds a worker of its own)."""
    stream = getattr(THREAD, "stream", None)
    if stream is None:
        stream = THREAD.stream = mx.new_stream(mx.default_device())
    return stream
