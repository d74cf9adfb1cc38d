"""The server's `/metrics` endpoint: Prometheus' text exposition format 0.0.4.

`ServerMetrics` is fed made-up updates (counts, positions, histograms, escaping, the
throughput window), then a server with the tiny llama and its trained drafter answers
a non-streamed chat and a streamed completion, and its `/metrics` body goes through a
strict parser of the format written here (and `prometheus_client`'s parser when that
happens to be installed) and must agree with what the replies reported.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest
from mlx_redrafter.apps.prometheus import CONTENT_TYPE, ServerMetrics

from mlx_redrafter.config import TreeConfig
from mlx_redrafter.metrics import RequestMetrics
from mlx_redrafter.session import Update

MODEL_ID = "tiny-llama"
P = "redrafter:"

# -- a strict parser of the text format -------------------------------------------------

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
VALUE = r"[+-]?(?:Inf|NaN|[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)"
HELP_LINE = re.compile(rf"# HELP ({NAME}) ((?:[^\\\n]|\\[\\n])*)")
TYPE_LINE = re.compile(rf"# TYPE ({NAME}) (counter|gauge|histogram|summary|untyped)")
SAMPLE_LINE = re.compile(rf"({NAME})(?:\{{(.*)\}})? ({VALUE})(?: -?[0-9]+)?")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


@dataclass
class Family:
    name: str
    help: str | None = None
    kind: str | None = None
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), text)


def parse_labels(text: str | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    position = 0
    while text and position < len(text):
        match = LABEL.match(text, position)
        assert match, f"bad labels at {text[position:]!r}"
        assert match.group(1) not in labels, f"label {match.group(1)} twice"
        labels[match.group(1)] = unescape(match.group(2))
        position = match.end()
        if position < len(text):
            assert text[position] == ",", f"labels: expected ',' at {text[position:]!r}"
            position += 1
    return labels


def parse(body: str) -> dict[str, Family]:
    """Families by name; raises AssertionError on anything the format forbids."""
    assert body.endswith("\n"), "the body must end with a newline"
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in body[:-1].split("\n"):
        if match := HELP_LINE.fullmatch(line):
            name = match.group(1)
            current = families.setdefault(name, Family(name))
            assert current.help is None and not current.samples, f"late or second HELP {name}"
            current.help = unescape(match.group(2))
        elif match := TYPE_LINE.fullmatch(line):
            name = match.group(1)
            current = families.setdefault(name, Family(name))
            assert current.kind is None and not current.samples, f"late or second TYPE {name}"
            current.kind = match.group(2)
        else:
            assert not line.startswith("#") and line, f"unexpected line {line!r}"
            match = SAMPLE_LINE.fullmatch(line)
            assert match, f"bad sample line {line!r}"
            assert current is not None and current.kind is not None, f"undeclared: {line!r}"
            name, value = match.group(1), float(match.group(3))
            suffixes = SUFFIXES[current.kind]
            assert any(name == current.name + s for s in suffixes), f"{name} not in {current.name}"
            current.samples.append((name, parse_labels(match.group(2)), value))
    for family in families.values():
        check_family(family)
    return families


def check_family(family: Family) -> None:
    assert family.help and family.kind, f"{family.name}: HELP and TYPE are required"
    seen = set()
    for name, labels, value in family.samples:
        key = (name, tuple(sorted(labels.items())))
        assert key not in seen, f"duplicate sample {key}"
        seen.add(key)
        assert "model_name" in labels, f"{name} has no model_name"
        if family.kind == "counter":
            assert family.name.endswith("_total") and value >= 0
    if family.kind == "histogram":
        check_histogram(family)


def check_histogram(family: Family) -> None:
    """Buckets in ascending `le`, cumulative, ending with +Inf equal to `_count`."""
    groups: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    totals: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    for name, labels, value in family.samples:
        rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        if name.endswith("_bucket"):
            groups.setdefault(rest, []).append((float(labels["le"]), value))
        else:
            assert "le" not in labels
            totals.setdefault(rest, {})[name[len(family.name) :]] = value
    assert groups, f"{family.name}: no buckets"
    for rest, buckets in groups.items():
        bounds = [bound for bound, _ in buckets]
        counts = [count for _, count in buckets]
        assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
        assert bounds[-1] == math.inf, f"{family.name}: the last bucket must be +Inf"
        assert counts == sorted(counts), f"{family.name}: buckets are not cumulative"
        assert set(totals[rest]) == {"_sum", "_count"}
        assert counts[-1] == totals[rest]["_count"]


def values(families: dict[str, Family], name: str, label: str | None = None) -> Any:
    """The value of a family's one sample, or {label value: value}."""
    samples = families[name].samples
    if label is None:
        assert len(samples) == 1, name
        return samples[0][2]
    return {labels[label]: value for _, labels, value in samples}


def histogram(families: dict[str, Family], name: str) -> dict[str, float]:
    return {n[len(name) + 1 :]: v for n, _, v in families[name].samples if n != name + "_bucket"}


def check_with_prometheus_client(body: str) -> None:
    """The official parser too, when it is installed (it is not a dependency)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    names = {family.name for family in text_string_to_metric_families(body)}
    assert f"{P}time_to_first_token_seconds" in names


# -- ServerMetrics alone ------------------------------------------------------------------


def step(
    request: int, tokens: int, accepted: int, size: int, batch: int, reason: str | None = None
) -> Update:
    metrics = RequestMetrics(5, prompt_seconds=0.1)
    metrics.record(tokens, tokens, accepted, 0.5)
    tree = TreeConfig(2, 3) if size > 1 else TreeConfig(1, 1)
    return Update(request, "x", list(range(tokens)), accepted, reason, metrics, tree, size, batch)


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def test_counts_of_made_up_updates() -> None:
    clock = Clock()
    metrics = ServerMetrics('tiny "llama"\\\n', queue=lambda: (2, 3), clock=clock)
    first, second = metrics.track(), metrics.track()
    clock.now += 0.3
    metrics.on_update(step(0, 3, 2, 7, 2), first)
    metrics.on_update(step(1, 1, 0, 7, 2), second)
    clock.now += 0.2
    metrics.on_update(step(0, 4, 3, 7, 2, "length"), first)
    metrics.on_update(step(1, 1, 0, 1, 2), second)
    metrics.on_update(Update.unstarted(1, 5, "error", "boom"), second)
    metrics.on_update(Update.unstarted(1, 5, "cancelled"), second)  # after the end: ignored
    body = metrics.render()
    families = parse(body)
    check_with_prometheus_client(body)
    assert values(families, P + "num_requests_total", "finish_reason") == {
        "stop": 0,
        "length": 1,
        "cancelled": 0,
        "error": 1,
    }
    assert families[P + "num_requests_total"].samples[0][1]["model_name"] == 'tiny "llama"\\\n'
    assert values(families, P + "prompt_tokens_total") == 10
    assert values(families, P + "generation_tokens_total") == 9
    assert values(families, P + "spec_decode_num_drafts_total") == 3
    assert values(families, P + "spec_decode_num_draft_tokens_total") == 18
    assert values(families, P + "spec_decode_num_accepted_tokens_total") == 5
    per_position = values(families, P + "spec_decode_num_accepted_tokens_per_pos_total", "position")
    assert per_position == {"0": 2, "1": 2, "2": 1}
    assert values(families, P + "decode_steps_total") == 2
    assert values(families, P + "num_requests_running") == 2
    assert values(families, P + "num_requests_waiting") == 3
    assert values(families, P + "spec_decode_mean_acceptance_length") == (5 + 4) / 4
    ttft = histogram(families, P + "time_to_first_token_seconds")
    assert ttft["count"] == 2 and ttft["sum"] == pytest.approx(0.6)
    latency = histogram(families, P + "e2e_request_latency_seconds")
    assert latency["count"] == 2 and latency["sum"] == pytest.approx(1.0)
    tps = histogram(families, P + "request_generation_tokens_per_second")
    assert tps["count"] == 1 and tps["sum"] == pytest.approx(8.0)  # 4 tokens in 0.5 s


def test_bucket_bounds_are_inclusive_and_the_window_slides() -> None:
    clock = Clock(0.0)  # 0 + 0.005 is exactly the bound
    metrics = ServerMetrics("m", clock=clock)
    for seconds in (0.005, 0.0051, 100.0):
        track = metrics.track()
        clock.now += seconds
        metrics.on_update(step(0, 6, 0, 1, 1), track)
    body = metrics.render()
    assert f'{P}time_to_first_token_seconds_bucket{{model_name="m",le="0.005"}} 1\n' in body
    assert f'{P}time_to_first_token_seconds_bucket{{model_name="m",le="0.01"}} 2\n' in body
    assert f'{P}time_to_first_token_seconds_bucket{{model_name="m",le="+Inf"}} 3\n' in body
    assert f"{P}num_requests_running" not in body  # no queue to read
    families = parse(body)
    assert values(families, P + "spec_decode_num_drafts_total") == 0
    assert families[P + "spec_decode_num_accepted_tokens_per_pos_total"].samples == []
    assert values(families, P + "spec_decode_mean_acceptance_length") == 1
    # the last 60 s hold the third request's 6 tokens, the first two left the window
    assert values(families, P + "generation_tokens_per_second") == pytest.approx(6 / 60)
    clock.now += 61
    assert values(parse(metrics.render()), P + "generation_tokens_per_second") == 0


# -- a server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(trained_llama: Any) -> Any:
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from mlx_redrafter.apps.batcher import Batcher
    from mlx_redrafter.apps.server import BackgroundServer, Server, create_app
    from test_chat import chat_tokenizer

    from mlx_redrafter.policy import TreePolicy

    model, drafter, prompts = trained_llama
    batcher = Batcher(model, drafter, chat_tokenizer(), TreePolicy.parse("4x4"), seed=0)
    background = BackgroundServer(create_app(Server(batcher, MODEL_ID)))
    with background:
        yield background.url, prompts
    batcher.close()


def fetch(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def make_requests(url: str, prompts: list[list[int]]) -> list[Any]:
    """A non-streamed chat and a streamed completion; their final usage and figures."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    content = " ".join(f"w{t}" for t in prompts[0])
    messages: Any = [{"role": "user", "content": content}]
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=24, temperature=0
    )
    replies = [(chat.usage, chat.model_extra["redrafter"], chat.choices[0].finish_reason)]
    stream = client.completions.create(
        model=MODEL_ID,
        prompt=prompts[3],
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage, figures, reason = None, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            reason, figures = chunk.choices[0].finish_reason, chunk.model_extra["redrafter"]
    return replies + [(usage, figures, reason)]


def test_metrics_agree_with_the_replies(served: Any) -> None:
    url, prompts = served
    status, kind, body = fetch(url + "/metrics")
    assert status == 200 and kind == CONTENT_TYPE
    assert values(parse(body), P + "num_requests_total", "finish_reason")["stop"] == 0
    replies = make_requests(url, prompts)
    status, kind, body = fetch(url + "/metrics")
    assert status == 200 and kind == CONTENT_TYPE
    families = parse(body)
    check_with_prometheus_client(body)
    reasons = values(families, P + "num_requests_total", "finish_reason")
    assert sum(reasons.values()) == len(replies) == 2
    for reason in {r for _, _, r in replies}:
        assert reasons[reason] == sum(r == reason for _, _, r in replies)
    prompt_tokens = sum(usage.prompt_tokens for usage, _, _ in replies)
    completion_tokens = sum(usage.completion_tokens for usage, _, _ in replies)
    assert values(families, P + "prompt_tokens_total") == prompt_tokens
    assert values(families, P + "generation_tokens_total") == completion_tokens > 0
    steps = sum(figures["steps"] for _, figures, _ in replies)
    accepted = sum(figures["accepted_tokens"] for _, figures, _ in replies)
    assert values(families, P + "decode_steps_total") == steps  # one row per step
    assert values(families, P + "spec_decode_num_accepted_tokens_total") == accepted > 0
    drafts = values(families, P + "spec_decode_num_drafts_total")
    assert 1 <= drafts <= steps
    assert values(families, P + "spec_decode_num_draft_tokens_total") >= drafts
    per_position = values(families, P + "spec_decode_num_accepted_tokens_per_pos_total", "position")
    counts = [per_position[str(p)] for p in range(len(per_position))]
    assert counts == sorted(counts, reverse=True) and counts[0] <= drafts
    assert sum(counts) == accepted  # a step accepting k tokens counts at positions 0..k-1
    length = values(families, P + "spec_decode_mean_acceptance_length")
    assert length == pytest.approx((accepted + steps) / steps) and length >= 1
    assert values(families, P + "num_requests_running") == 0
    assert values(families, P + "num_requests_waiting") == 0
    assert values(families, P + "generation_tokens_per_second") > 0
    emitted = sum(usage.completion_tokens > 0 for usage, _, _ in replies)
    assert histogram(families, P + "time_to_first_token_seconds")["count"] == emitted
    assert histogram(families, P + "e2e_request_latency_seconds")["count"] == 2
    assert histogram(families, P + "request_generation_tokens_per_second")["count"] == 2


def test_unknown_routes_list_the_metrics(served: Any) -> None:
    url, _ = served
    status, _, body = fetch(url + "/nothing")
    assert status == 404 and "/metrics" in json.loads(body)["error"]["message"]
