"""Log-probabilities of emitted tokens: exact under speculation, as mlx-lm reports them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_redrafter.config import SamplingConfig, StopConfig, TreeConfig
from mlx_redrafter.session import DecodingSession, Request

TREES = [TreeConfig(1, 1), TreeConfig(4, 4), TreeConfig(2, 3, lookup_branches=1)]


def mlx_lm_logprobs(model, prompt, max_tokens):
    """mlx-lm's greedy tokens and the log-probability vector (V,) it yields with each."""
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(0.0))
    return [(int(token), np.array(logprobs)) for token, logprobs in steps]


def decode_with_logprobs(model, drafter, prompts, tree, top, max_tokens=24):
    session = DecodingSession(model, drafter, tree=tree)
    stop = StopConfig(max_tokens=max_tokens)
    requests = [Request(p, SamplingConfig(), stop, logprobs=top) for p in prompts]
    tokens = {i: [] for i in range(len(prompts))}
    figures = {i: [] for i in range(len(prompts))}
    for update in session.run(requests, ids=list(range(len(prompts)))):
        assert update.logprobs is not None and len(update.logprobs) == len(update.tokens)
        tokens[update.request] += update.tokens
        figures[update.request] += update.logprobs
    return tokens, figures


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.label)
def test_logprobs_under_speculation_are_mlx_lm_s(trained_llama, tree):
    """Every emitted token's log-probability and top-5 equal mlx-lm's at that position,
    whatever tree emitted it (a batch of rows of different lengths)."""
    model, drafter, prompts = trained_llama
    prompts = prompts[:3]
    tokens, figures = decode_with_logprobs(model, drafter, prompts, tree, top=5)
    for row, prompt in enumerate(prompts):
        reference = mlx_lm_logprobs(model, prompt, 24)
        assert tokens[row] == [token for token, _ in reference]
        for figure, (token, vector) in zip(figures[row], reference):
            assert figure.token == token
            assert figure.logprob == pytest.approx(float(vector[token]), abs=1e-4)
            best = np.argsort(-vector)[:5]
            assert [t for t, _ in figure.top] == best.tolist()
            np.testing.assert_allclose([v for _, v in figure.top], vector[best], atol=1e-4)


def test_rows_that_do_not_ask_get_none_and_top_zero_gives_no_alternatives(trained_llama):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter, tree=TreeConfig(2, 3))
    stop = StopConfig(max_tokens=8)
    requests = [
        Request(prompts[0], SamplingConfig(), stop),
        Request(prompts[1], SamplingConfig(), stop, logprobs=0),
        Request(prompts[2], SamplingConfig(), stop, logprobs=2),
    ]
    seen = {0: [], 1: [], 2: []}
    for update in session.run(requests, ids=[0, 1, 2]):
        seen[update.request].append(update.logprobs)
        if update.logprobs is not None:
            assert [f.token for f in update.logprobs] == update.tokens
    assert all(figures is None for figures in seen[0])
    assert all(f.top == () for figures in seen[1] for f in figures)
    assert all(len(f.top) == 2 for figures in seen[2] for f in figures)


def test_a_bad_logprobs_count_is_a_clear_error(trained_llama):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter)
    with pytest.raises(ValueError, match="give 0 to 20"):
        session.add([Request(prompts[0], logprobs=21)])


class PieceTokenizer:
    """SentencePiece-like decoding: a word's leading "\u2581" reads as a space, except
    at the start of the text."""

    pieces = {0: "\u2581is", 1: "\u2581Paris", 2: ".", 3: "\u2581Rome"}

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids).replace("\u2581", " ").lstrip(" ")

    def convert_ids_to_tokens(self, token):
        return self.pieces[token]


def test_token_texts_read_in_context_and_offsets_run_across_chunks():
    """A completion's first word keeps its space (its text continues the prompt's);
    later tokens read in context; the offsets of streamed chunks continue where the
    previous chunk stopped."""
    from apps.logprob_format import LogprobFormat
    from mlx_redrafter.logprobs import TokenLogprob

    formats = LogprobFormat(PieceTokenizer(), keep_space=True)
    first = formats.completion([TokenLogprob(1, -0.1, ((1, -0.1), (3, -2.5)))])
    second = formats.completion([TokenLogprob(2, -0.2), TokenLogprob(3, -0.3)])
    assert first["tokens"] == [" Paris"]
    assert first["top_logprobs"] == [{" Paris": -0.1, " Rome": -2.5}]
    assert second["tokens"] == [".", " Rome"] and second["text_offset"] == [6, 7]
    chat = LogprobFormat(PieceTokenizer()).chat([TokenLogprob(1, -0.1), TokenLogprob(3, -1.0)])
    assert [entry["token"] for entry in chat["content"]] == ["Paris", " Rome"]
    assert chat["content"][0]["bytes"] == list(b"Paris")


@pytest.mark.parametrize(
    ("body", "chat", "top"),
    [
        ({"logprobs": True}, True, 0),
        ({"logprobs": True, "top_logprobs": 4}, True, 4),
        ({"top_logprobs": 0}, True, None),
        ({"logprobs": False}, True, None),
        ({}, True, None),
        ({"logprobs": 3}, False, 3),
        ({"logprobs": 0}, False, 0),
        ({}, False, None),
    ],
)
def test_openai_logprobs_fields_are_read_as_openai_defines_them(body, chat, top):
    from apps.server import read_logprobs

    assert read_logprobs(body, chat=chat) == top
