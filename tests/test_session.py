"""The decoding session itself: mixed batches, joining, cancelling, abandoned runs,
request ids, and its generation stream."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import mlx_lm_greedy

from mlx_redrafter import DecodingSession, Request, SamplingConfig, StopConfig, TreeConfig


def test_greedy_rows_without_a_key_share_a_batch_with_sampled_rows(trained_llama):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter, tree="1x2+1x7")
    greedy = Request(prompts[0], stop=StopConfig(20))
    sampled = Request(prompts[1], SamplingConfig(temperature=1.0), StopConfig(20), mx.random.key(3))
    updates = list(session.run([greedy, sampled]))
    tokens = [t for u in updates if u.request == 0 for t in u.tokens]
    assert tokens == mlx_lm_greedy(model, prompts[0], 20)
    alone = list(DecodingSession(model, drafter, tree="1x2+1x7").run([sampled]))
    assert [t for u in updates if u.request == 1 for t in u.tokens] == [
        t for u in alone for t in u.tokens
    ]


def test_a_cancelled_request_leaves_before_the_next_step(trained_llama):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter, tree=TreeConfig(3, 3))
    session.add([Request(p, stop=StopConfig(30)) for p in prompts[:3]])
    first = session.step()
    session.cancel(1)
    second = session.step()
    last = next(u for u in second if u.request == 1)
    assert last.finish_reason == "cancelled" and last.tokens == [] and last.text == ""
    assert last.metrics.steps == 1  # it took no part in the second step
    assert session.state is not None and session.state.row_ids == [0, 2]
    outputs = {u.request: list(u.tokens) for u in first}
    for update in second:
        outputs[update.request] += update.tokens
    while session.active:
        for update in session.step():
            outputs[update.request] += update.tokens
    for row in (0, 2):
        assert outputs[row] == mlx_lm_greedy(model, prompts[row], 30)


def test_ids_in_flight_are_refused_and_an_abandoned_run_leaves_nothing(trained_llama):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter)
    session.add([Request(prompts[0], stop=StopConfig(10))], ids=[5])
    with pytest.raises(ValueError, match="new and distinct"):
        session.add([Request(prompts[1])], ids=[5])
    with pytest.raises(ValueError, match="new and distinct"):
        session.add([Request(prompts[1]), Request(prompts[2])], ids=[6, 6])
    session.close()
    run = session.run([Request(p, stop=StopConfig(40)) for p in prompts[:2]], ids=[0, 1])
    next(run)
    run.close()  # the consumer stops early
    assert session.active == 0 and session.state is None
    again = list(session.run([Request(prompts[2], stop=StopConfig(12))], ids=[0]))
    assert [t for u in again for t in u.tokens] == mlx_lm_greedy(model, prompts[2], 12)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_sessions_share_one_generation_stream_per_thread(trained_llama):
    """An MLX stream holds a worker thread: sessions made again and again (one per
    API call) must not leave a new one each time."""
    model, drafter, prompts = trained_llama
    request = Request(prompts[0], stop=StopConfig(4))
    list(DecodingSession(model, drafter).run([request]))
    before = len(os.listdir("/proc/self/task"))
    for _ in range(5):
        list(DecodingSession(model, drafter).run([request]))
    assert len(os.listdir("/proc/self/task")) == before
