"""A soak test of the server: concurrent clients for a bounded time, with
disconnects and bad requests mixed in, then checks that nothing is stuck, memory
stayed flat and every completed greedy reply equals the same request served alone.

Each client repeats, until the time or request limit, one of (by `SoakConfig.mix`):
a streamed request read to the end, a non-streamed one, a stream dropped after its
first chunk, a non-streamed request dropped while it decodes, and a bad request
(malformed JSON, a wrong content type, an unsupported field, a wrong type) that must
get a 4xx. Prompts alternate short ones and long ones (several prompts joined).
Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import random
import resource
import sys
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

KINDS = ("stream", "whole", "drop_stream", "drop_whole", "bad")

BAD_REQUESTS: tuple[tuple[bytes, str], ...] = (
    (b'{"messages": [', "application/json"),  # malformed JSON
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "text/plain"),  # content type
    (
        b'{"messages": [{"role": "user", "content": "hi"}], '
        b'"tools": [{"type": "function", "function": {"name": "f"}}]}',
        "application/json",
    ),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"}', "application/json"),
)


@dataclass(frozen=True)
class SoakConfig:
    """clients: concurrent clients; seconds and requests: bounds of the whole run (the
    request count over all clients); max_tokens: the range of each request's limit;
    mix: weights of KINDS; check: greedy replies compared with their solo reply (at
    most this many); seed: the clients' choices."""

    clients: int = 4
    seconds: float = 60.0
    requests: int = 200
    max_tokens: tuple[int, int] = (8, 48)
    mix: tuple[float, ...] = (4, 2, 1, 1, 1)
    check: int = 24
    seed: int = 0


@dataclass
class SoakReport:
    """What the run saw. `server_errors`: 5xx answers; `failures`: anything else
    unexpected (a bad request answered 2xx, a good one not 200, a broken stream)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    server_errors: int = 0
    failures: list[str] = field(default_factory=list)
    replies: dict[tuple[str, int], str] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    compared: int = 0
    stuck: int = 0
    rss_start_mb: float = 0.0  # after a quarter of the run's time or requests (warm-up)
    rss_end_mb: float = 0.0  # after the solo comparison
    rss_peak_mb: float = 0.0
    cache_start_mb: float = 0.0  # the prefix cache's share of rss_start_mb
    cache_end_mb: float = 0.0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def requests(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "by_kind": dict(self.counts),
            "server_errors": self.server_errors,
            "failures": self.failures[:20],
            "greedy_compared": self.compared,
            "greedy_mismatches": len(self.mismatches),
            "stuck_rows": self.stuck,
            "rss_start_mb": round(self.rss_start_mb, 1),
            "rss_end_mb": round(self.rss_end_mb, 1),
            "rss_peak_mb": round(self.rss_peak_mb, 1),
            "prefix_cache_start_mb": round(self.cache_start_mb, 1),
            "prefix_cache_end_mb": round(self.cache_end_mb, 1),
            "seconds": round(self.seconds, 1),
        }

    @property
    def passed(self) -> bool:
        clean = not (self.server_errors or self.failures or self.mismatches or self.stuck)
        return clean and self.flat

    @property
    def flat(self) -> bool:
        """Resident memory beside the prefix cache (bounded by its own limit) grew by at
        most 10 % + 64 MB from the end of the warm-up to the end."""
        start = self.rss_start_mb - self.cache_start_mb
        return self.rss_end_mb - self.cache_end_mb <= 1.10 * start + 64


def resident_mb() -> float:
    """This process's resident memory now, MB (Linux /proc; elsewhere the peak so far,
    which `ru_maxrss` gives in bytes on macOS and in KiB on other systems)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _body(text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def _post(port: int, body: bytes, content_type: str, timeout: float) -> tuple[int, bytes]:
    """POST to the chat endpoint; the status and the whole body."""
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)) as connection:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, response.read()


def request_once(port: int, text: str, max_tokens: int, stream: bool, timeout: float) -> str:
    """A greedy chat request read to the end: its reply text. RuntimeError on a
    non-200 answer (with the status in the message) or a stream that ends without
    a finish reason."""
    body = json.dumps(_body(text, max_tokens, stream)).encode()
    status, raw = _post(port, body, "application/json", timeout)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {raw[:200]!r}")
    if not stream:
        return str(json.loads(raw)["choices"][0]["message"]["content"])
    parts, finished = [], False
    for line in raw.splitlines():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"HTTP 500 in stream: {chunk['error']}")
            for choice in chunk.get("choices", []):
                parts.append(choice["delta"].get("content") or "")
                finished = finished or choice.get("finish_reason") is not None
    if not finished:
        raise RuntimeError("a stream ended without a finish reason")
    return "".join(parts)


def _drop(port: int, text: str, max_tokens: int, stream: bool) -> int:
    """Send a request and hang up: after the first chunk of a stream, or at once
    for a non-streamed one. Returns the status seen (0: none)."""
    body = json.dumps(_body(text, max_tokens, stream)).encode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    status = 0
    try:
        headers = {"Content-Type": "application/json"}
        connection.request("POST", "/v1/chat/completions", body, headers)
        if stream:
            response = connection.getresponse()
            status = response.status
            response.readline()
        else:
            time.sleep(0.2)
    finally:
        if connection.sock is not None:
            connection.sock.close()
        connection.close()
    return status


def _one(
    port: int, kind: str, text: str, max_tokens: int, rng: random.Random, report: SoakReport
) -> None:
    if kind in ("stream", "whole"):
        reply = request_once(port, text, max_tokens, kind == "stream", timeout=600)
        with report.lock:
            earlier = report.replies.setdefault((text, max_tokens), reply)
            if earlier != reply:  # two loaded replies to one greedy request
                report.mismatches.append(f"{text[:40]!r} ({max_tokens} tokens), under load")
    elif kind in ("drop_stream", "drop_whole"):
        status = _drop(port, text, max_tokens, kind == "drop_stream")
        if status >= 500:
            raise RuntimeError(f"HTTP {status}")
    else:
        body, content_type = rng.choice(BAD_REQUESTS)
        status, _ = _post(port, body, content_type, timeout=60)
        if status >= 500:
            raise RuntimeError(f"HTTP {status}")
        if status < 400:
            raise ValueError(f"a bad request got {status}: {body[:60]!r}")


def soak(
    port: int, texts: list[str], config: SoakConfig, cached: Callable[[], int] = lambda: 0
) -> SoakReport:
    """Run the clients against the server on 127.0.0.1:port; the report's replies
    are not compared yet (`compare_alone`). cached: the prefix cache's bytes now."""
    report = SoakReport()
    started = time.monotonic()
    deadline = started + config.seconds
    finished = threading.Event()

    def sample_memory() -> None:
        # Warm once a quarter of the time or of the requests has passed.
        warm = started + config.seconds / 4
        while not finished.wait(0.2):
            now = resident_mb()
            report.rss_peak_mb = max(report.rss_peak_mb, now)
            quarter = report.requests >= config.requests / 4 or time.monotonic() >= warm
            if not report.rss_start_mb and quarter:
                report.rss_start_mb, report.cache_start_mb = now, cached() / 2**20

    issued = iter(range(config.requests))
    issued_lock = threading.Lock()

    def client(index: int) -> None:
        rng = random.Random(config.seed * 1000 + index)
        while time.monotonic() < deadline:
            with issued_lock:
                if next(issued, None) is None:
                    return
            kind = rng.choices(KINDS, weights=config.mix)[0]
            text = rng.choice(texts)
            max_tokens = rng.randint(*config.max_tokens)
            try:
                _one(port, kind, text, max_tokens, rng, report)
            except Exception as error:  # every failure counts, whatever its kind
                with report.lock:
                    report.server_errors += "HTTP 5" in str(error)
                    report.failures.append(f"{kind}: {type(error).__name__}: {error}")
            with report.lock:
                report.counts[kind] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(config.clients)]
    sampler = threading.Thread(target=sample_memory)
    for thread in [sampler, *threads]:
        thread.start()
    for thread in threads:
        thread.join()
    finished.set()
    sampler.join()
    report.seconds = time.monotonic() - started
    if not report.rss_start_mb:
        report.rss_start_mb, report.cache_start_mb = resident_mb(), cached() / 2**20
    return report


def compare_alone(port: int, report: SoakReport, limit: int, seed: int = 0) -> None:
    """Serve up to `limit` of the completed greedy requests again, one at a time, and
    record every reply that differs from the one the loaded server gave."""
    items = sorted(report.replies.items())
    random.Random(seed).shuffle(items)
    for (text, max_tokens), reply in items[:limit]:
        alone = request_once(port, text, max_tokens, stream=False, timeout=600)
        report.compared += 1
        if alone != reply:
            report.mismatches.append(f"{text[:40]!r} ({max_tokens} tokens)")


def wait_until_idle(port: int, seconds: float = 10.0) -> int:
    """Rows still active or pending after `seconds` (0: every row freed)."""
    deadline = time.monotonic() + seconds
    while True:
        with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=10)) as connection:
            connection.request("GET", "/v1/redrafter/status")
            status = json.load(connection.getresponse())
        busy = int(status["active"]) + int(status["pending"])
        if busy == 0 or time.monotonic() > deadline:
            return busy
        time.sleep(0.1)


def long_prompts(texts: list[str], count: int, parts: int, seed: int = 0) -> list[str]:
    """`count` long prompts, each `parts` short ones joined."""
    rng = random.Random(seed)
    return ["\n\n".join(rng.sample(texts, min(parts, len(texts)))) for _ in range(count)]


def run_soak(
    port: int, texts: list[str], config: SoakConfig, cached: Callable[[], int] = lambda: 0
) -> SoakReport:
    """The whole soak against a running server: a first request, the clients, the
    idle check, the solo comparison. cached: the prefix cache's bytes now (its
    memory is bounded by its own limit, so `SoakReport.flat` leaves it out)."""
    request_once(port, texts[0], 4, stream=False, timeout=600)
    report = soak(port, texts, config, cached)
    report.stuck = wait_until_idle(port)
    compare_alone(port, report, config.check, config.seed)
    report.rss_end_mb, report.cache_end_mb = resident_mb(), cached() / 2**20
    return report
