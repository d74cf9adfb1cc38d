"""A short soak of the server (the long one's figures are in docs/apps.md): concurrent
clients with disconnects and bad requests on the tiny llama and its drafter."""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from mlx_redrafter.apps.batcher import Batcher  # noqa: E402
from mlx_redrafter.apps.server import BackgroundServer, Server, create_app  # noqa: E402
from mlx_redrafter.apps.soak import KINDS, SoakConfig, long_prompts, run_soak  # noqa: E402
from test_chat import chat_tokenizer  # noqa: E402

from mlx_redrafter.prompt_cache import PrefixStore  # noqa: E402


def test_a_short_soak_leaves_no_errors_no_stuck_rows_and_equal_replies(trained_llama: Any):
    model, drafter, _ = trained_llama
    batcher = Batcher(
        model,
        drafter,
        chat_tokenizer(),
        "auto",
        seed=0,
        prefixes=PrefixStore(32 << 20),
        prefill_chunk=16,
    )
    batcher.warm_up()
    rng = random.Random(0)
    short = [" ".join(f"w{rng.randrange(62)}" for _ in range(rng.randint(2, 8))) for _ in range(12)]
    texts = short + long_prompts(short, 3, parts=6)
    config = SoakConfig(clients=4, seconds=30, requests=200, max_tokens=(4, 24), check=16)
    with BackgroundServer(create_app(Server(batcher, "tiny"))) as server:
        report = run_soak(server.port, texts, config, lambda: batcher.prefixes.nbytes)
    batcher.close()
    summary = report.summary()
    assert report.server_errors == 0 and report.failures == [], summary
    assert report.stuck == 0, summary
    assert all(report.counts[kind] > 0 for kind in KINDS), summary
    assert report.compared >= 8 and report.mismatches == [], summary
    assert report.flat and report.passed, summary
    assert batcher.stats.cancelled > 0  # the dropped requests were cancelled
    print(summary)


def test_freed_memory_is_handed_back_at_most_once_per_period():
    from mlx_redrafter.apps.batcher import FreedMemory

    calls: list[int] = []
    memory = FreedMemory(every=3600.0)
    memory._trim = calls.append  # stands in for glibc's malloc_trim
    memory.release()
    memory.release()
    assert calls == [0]
