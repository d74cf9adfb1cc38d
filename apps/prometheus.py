"""The server's figures for Prometheus: `GET /metrics` in the text exposition format
0.0.4, written here without the `prometheus_client` package.

`ServerMetrics` is fed every `Update` the decode worker delivers (`on_update`, on the
worker thread, under a lock) and renders the figures on request (`render`). Names
follow vLLM's request and speculative-decoding metrics with a `redrafter:` prefix,
and every sample carries a `model_name` label:

counters
    num_requests_total{finish_reason}: requests that ended (stop, length, cancelled,
        error); requests refused before reaching the worker (a bad body) are not counted.
    prompt_tokens_total: prompt tokens of the requests that were prefilled.
    generation_tokens_total: tokens emitted to clients (the replies' completion_tokens).
    spec_decode_num_drafts_total: verification steps that speculated, one per request
        per step (a plain step verifies no draft).
    spec_decode_num_draft_tokens_total: tokens verified beyond the root (tree size - 1
        per request per step).
    spec_decode_num_accepted_tokens_total: drafted tokens the target accepted.
    spec_decode_num_accepted_tokens_per_pos_total{position}: steps that accepted at
        least position + 1 drafted tokens (position 0-based).
    decode_steps_total: batched target steps of the worker (one forward over the batch).
gauges
    num_requests_running, num_requests_waiting: rows in the batch, requests queued.
    spec_decode_mean_acceptance_length: tokens per step, (accepted + steps) / steps over
        every request step so far (1 without speculation, 0 before the first step).
    generation_tokens_per_second: tokens emitted in the last 60 s (whole seconds) over
        60 s, or over the time since the server started when that is shorter.
histograms
    time_to_first_token_seconds: from queueing the request for the worker (its body read
        and tokenized) to its first token.
    e2e_request_latency_seconds: from queueing the request to its last update.
    request_generation_tokens_per_second: a finished request's tokens over its
        decoding time (prefill excluded).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlx_redrafter.session import Update

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "redrafter:"
FINISH_REASONS = ("stop", "length", "cancelled", "error")
THROUGHPUT_WINDOW = 60.0
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)

Labels = Sequence[tuple[str, str]]

HELP = {
    "num_requests_total": "Requests that ended, by finish reason.",
    "prompt_tokens_total": "Prompt tokens of the requests that were prefilled.",
    "generation_tokens_total": "Tokens emitted to clients (the replies' completion tokens).",
    "spec_decode_num_drafts_total": "Verification steps that speculated, one per request per step.",
    "spec_decode_num_draft_tokens_total": "Tokens verified beyond the root: the tree size "
    "minus 1, per request per step.",
    "spec_decode_num_accepted_tokens_total": "Drafted tokens the target accepted.",
    "spec_decode_num_accepted_tokens_per_pos_total": "Steps that accepted at least "
    "position + 1 drafted tokens (position 0-based).",
    "decode_steps_total": "Batched target steps of the decode worker.",
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests queued for the batch.",
    "spec_decode_mean_acceptance_length": "Tokens per request step, (accepted + steps) / "
    "steps over every step so far (0 before the first).",
    "generation_tokens_per_second": "Tokens emitted per second over the last "
    f"{THROUGHPUT_WINDOW:g} s (whole seconds; since the start when shorter).",
    "time_to_first_token_seconds": "Seconds from queueing a request to its first token.",
    "e2e_request_latency_seconds": "Seconds from queueing a request to its last update.",
    "request_generation_tokens_per_second": "A finished request's tokens over its "
    "decoding seconds (prefill excluded).",
}


# -- the text format ------------------------------------------------------------------


def escape_label(value: str) -> str:
    """A label value as the format quotes it: backslash, double quote, newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """HELP text: backslash and newline escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: integers without a fraction, +Inf / -Inf / NaN spelled out."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def sample(name: str, labels: Labels, value: float) -> str:
    """One sample line: `name{label="value",...} value`."""
    inner = ",".join(f'{key}="{escape_label(text)}"' for key, text in labels)
    return f"{name}{{{inner}}} {format_value(value)}"


def family(name: str, kind: str, help_text: str, samples: Sequence[str]) -> list[str]:
    """A metric family: its HELP and TYPE lines, then its samples."""
    return [f"# HELP {name} {escape_help(help_text)}", f"# TYPE {name} {kind}", *samples]


@dataclass
class Histogram:
    """Observations in fixed buckets (upper bounds, ascending; +Inf is implied)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def samples(self, name: str, labels: Labels) -> list[str]:
        """Cumulative `_bucket` samples ending with le="+Inf", then `_sum` and `_count`."""
        lines, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            running += count
            lines.append(sample(f"{name}_bucket", [*labels, ("le", format_value(bound))], running))
        lines.append(sample(f"{name}_sum", labels, self.total))
        lines.append(sample(f"{name}_count", labels, self.count))
        return lines


# -- the figures ----------------------------------------------------------------------


@dataclass
class RequestTrack:
    """What the metrics keep of one request between its updates (`ServerMetrics.track`)."""

    arrived: float
    first_token: bool = False
    prompt_counted: bool = False
    finished: bool = False


class ServerMetrics:
    """The server's counters, gauges and histograms; thread-safe.

    model_name: the `model_name` label; queue: () -> (rows running, requests waiting),
    read when rendering (None: those gauges are left out); clock: seconds, monotonic.
    """

    def __init__(
        self,
        model_name: str,
        queue: Callable[[], tuple[int, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        window: float = THROUGHPUT_WINDOW,
    ):
        self.model_name, self.queue, self.clock, self.window = model_name, queue, clock, window
        self.started = clock()
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = self.generation_tokens = 0
        self.drafts = self.draft_tokens = self.accepted = self.request_steps = 0
        self.accepted_per_position: list[int] = []
        self.steps_by_batch: dict[int, int] = {}  # step updates by batch size
        self.recent: deque[list[int]] = deque()  # [whole second, tokens emitted in it]
        self.ttft = Histogram(TTFT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.request_tps = Histogram(TPS_BUCKETS)

    def track(self) -> RequestTrack:
        """Start following a request queued for the worker now."""
        return RequestTrack(self.clock())

    def on_update(self, update: Update, track: RequestTrack) -> None:
        """Count one update of the request `track` follows; call it for every update.

        Anything after the request's final update is ignored, so a request ends once.
        """
        now = self.clock()
        with self._lock:
            if track.finished:
                return
            if not track.prompt_counted and update.metrics.prompt_seconds > 0:
                track.prompt_counted = True  # prefilled
                self.prompt_tokens += update.metrics.prompt_tokens
            if update.tokens:
                self._count_tokens(len(update.tokens), track, now)
            if update.batch_size > 0:  # a verification step (not a cancel or failure)
                self._count_step(update)
            if update.finish_reason is not None:
                self.on_finish(update, track, now)

    def _count_tokens(self, count: int, track: RequestTrack, now: float) -> None:
        self.generation_tokens += count
        second = int(now)
        if self.recent and self.recent[-1][0] == second:
            self.recent[-1][1] += count
        else:
            self.recent.append([second, count])
        self._forget(now)
        if not track.first_token:
            track.first_token = True
            self.ttft.observe(now - track.arrived)

    def _count_step(self, update: Update) -> None:
        batch = update.batch_size
        self.steps_by_batch[batch] = self.steps_by_batch.get(batch, 0) + 1
        self.request_steps += 1
        self.accepted += update.num_accepted
        if update.tree_size > 1:
            self.drafts += 1
            self.draft_tokens += update.tree_size - 1
        missing = update.num_accepted - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(missing, 0))
        for position in range(update.num_accepted):
            self.accepted_per_position[position] += 1

    def on_finish(self, update: Update, track: RequestTrack, now: float) -> None:
        """The request's final update (the caller holds the lock: `on_update`)."""
        track.finished = True
        reason = update.finish_reason or "stop"
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.latency.observe(now - track.arrived)
        metrics = update.metrics
        if metrics.steps and metrics.decode_seconds > 0:
            self.request_tps.observe(metrics.generation_tps)

    def _forget(self, now: float) -> None:
        """Drop the seconds that left the throughput window."""
        while self.recent and self.recent[0][0] <= now - self.window:
            self.recent.popleft()

    # -- rendering ------------------------------------------------------------------

    def render(self) -> str:
        """Every family in the text exposition format 0.0.4 (CONTENT_TYPE)."""
        queue = self.queue() if self.queue is not None else None
        now = self.clock()
        with self._lock:
            self._forget(now)
            lines = self._counters() + self._gauges(queue, now) + self._histograms()
        return "\n".join(lines) + "\n"

    @property
    def decode_steps(self) -> int:
        """Batched steps: every step gives one update to each of its `batch` rows."""
        return sum(count // batch for batch, count in self.steps_by_batch.items())

    @property
    def mean_acceptance_length(self) -> float:
        steps = self.request_steps
        return (self.accepted + steps) / steps if steps else 0.0

    def _family(self, name: str, kind: str, values: Sequence[tuple[Labels, float]]) -> list[str]:
        """A family of `PREFIX + name`: one sample per (extra labels, value)."""
        full, base = PREFIX + name, [("model_name", self.model_name)]
        return family(full, kind, HELP[name], [sample(full, [*base, *x], v) for x, v in values])

    def _counters(self) -> list[str]:
        reasons = [([("finish_reason", r)], count) for r, count in self.requests.items()]
        lines = self._family("num_requests_total", "counter", reasons)
        for name, value in (
            ("prompt_tokens_total", self.prompt_tokens),
            ("generation_tokens_total", self.generation_tokens),
            ("spec_decode_num_drafts_total", self.drafts),
            ("spec_decode_num_draft_tokens_total", self.draft_tokens),
            ("spec_decode_num_accepted_tokens_total", self.accepted),
        ):
            lines += self._family(name, "counter", [((), value)])
        positions = [([("position", str(p))], n) for p, n in enumerate(self.accepted_per_position)]
        lines += self._family("spec_decode_num_accepted_tokens_per_pos_total", "counter", positions)
        return lines + self._family("decode_steps_total", "counter", [((), self.decode_steps)])

    def _gauges(self, queue: tuple[int, int] | None, now: float) -> list[str]:
        lines = []
        if queue is not None:
            lines += self._family("num_requests_running", "gauge", [((), queue[0])])
            lines += self._family("num_requests_waiting", "gauge", [((), queue[1])])
        length = self.mean_acceptance_length
        lines += self._family("spec_decode_mean_acceptance_length", "gauge", [((), length)])
        span = min(self.window, now - self.started)
        recent = sum(count for _, count in self.recent)
        rate = recent / span if span > 0 else 0.0
        return lines + self._family("generation_tokens_per_second", "gauge", [((), rate)])

    def _histograms(self) -> list[str]:
        lines = []
        base = [("model_name", self.model_name)]
        for name, histogram in (
            ("time_to_first_token_seconds", self.ttft),
            ("e2e_request_latency_seconds", self.latency),
            ("request_generation_tokens_per_second", self.request_tps),
        ):
            full = PREFIX + name
            lines += family(full, "histogram", HELP[name], histogram.samples(full, base))
        return lines
