"""A stop string never reaches the caller, partially or whole, on any path.

Each stop string is cut from the middle of a greedy reply (some start or end inside a
token's text); every path must return the reply exactly up to its first occurrence:
the API, the streaming API (every streamed piece, not only their sum), the chat app
(plain and with coloured drafts), and the server (streaming and not).
"""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from conftest import mlx_lm_greedy
from mlx_redrafter.apps.chat import ChatSession
from test_chat import chat_tokenizer

from mlx_redrafter import generate, stream_generate
from mlx_redrafter.prompts import chat_tokens

ANSI = re.compile(r"\x1b\[[0-9;]*m")
MAX_TOKENS = 40


def words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def stops_from(reply: str) -> list[str]:
    """Stop strings taken from the middle of a reply: whole words, and pieces that
    begin or end inside a word."""
    middle = len(reply) // 2
    space = reply.index(" ", middle)
    return [
        reply[space : reply.index(" ", space + 1)],  # " w17": one whole word
        reply[space - 2 : space + 3],  # ends and starts inside words
        reply[space + 1 : space + 2],  # "w": a prefix of every word; cuts at the first
    ]


def expected_cut(reply: str, stop: str) -> str:
    return reply[: reply.index(stop)]


@pytest.fixture(scope="module")
def case(trained_llama: Any) -> Any:
    model, drafter, prompts = trained_llama
    prompt = prompts[0]
    reply = words(mlx_lm_greedy(model, prompt, MAX_TOKENS))
    return model, drafter, prompt, reply


def test_api_generate_cuts_before_the_stop_string(case: Any) -> None:
    model, drafter, prompt, reply = case
    for stop in stops_from(reply):
        text = generate(model, drafter, chat_tokenizer(), prompt, max_tokens=MAX_TOKENS, stop=stop)
        assert text == expected_cut(reply, stop), stop


def test_streaming_api_never_streams_part_of_a_stop_string(case: Any) -> None:
    model, drafter, prompt, reply = case
    for stop in stops_from(reply):
        streamed = ""
        responses = stream_generate(
            model, drafter, chat_tokenizer(), prompt, max_tokens=MAX_TOKENS, stop=[stop]
        )
        for response in responses:
            streamed += response.text
            assert expected_cut(reply, stop).startswith(streamed), (stop, streamed)
        assert streamed == expected_cut(reply, stop)
        assert response.finish_reason == "stop"


def test_chat_reply_cuts_before_the_stop_string(case: Any) -> None:
    model, drafter, _, _ = case
    tokenizer = chat_tokenizer()
    question = "w5 w9 w11"
    prompt = chat_tokens(tokenizer, [{"role": "user", "content": question}])
    reply = words(mlx_lm_greedy(model, prompt, MAX_TOKENS))
    for show_drafts in (False, True):
        for stop in stops_from(reply):
            out = io.StringIO()
            chat = ChatSession(
                model,
                drafter,
                tokenizer,
                max_tokens=MAX_TOKENS,
                stop=(stop,),
                show_drafts=show_drafts,
                out=out,
            )
            text = chat.reply(question)
            assert text == expected_cut(reply, stop), (stop, show_drafts)
            assert ANSI.sub("", out.getvalue()) == text + "\n"
            assert chat.messages[-1] == {"role": "assistant", "content": text}


def test_server_cuts_before_the_stop_string_streaming_or_not(case: Any) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from mlx_redrafter.apps.batcher import Batcher
    from mlx_redrafter.apps.server import BackgroundServer, Server, create_app

    model, drafter, prompt, reply = case
    batcher = Batcher(model, drafter, chat_tokenizer(), seed=0)  # the default tree
    background = BackgroundServer(create_app(Server(batcher, "tiny")))
    client = openai.OpenAI(base_url=background.url + "/v1", api_key="none", max_retries=0)
    try:
        with background:
            for stop in stops_from(reply):
                for stream in (False, True):
                    answer = client.completions.create(
                        model="tiny",
                        prompt=prompt,
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                        stop=[stop],
                        stream=stream,
                    )
                    chunks = list(answer) if stream else [answer]
                    pieces = [c.choices[0].text for c in chunks if c.choices]
                    assert "".join(pieces) == expected_cut(reply, stop), (stop, stream)
                    assert chunks[-1].choices[0].finish_reason == "stop"
    finally:
        batcher.close()
