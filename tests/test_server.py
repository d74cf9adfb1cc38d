"""The OpenAI-compatible server, driven by the official `openai` client.

A tiny llama and a drafter trained on it (the `trained_llama` fixture) serve on a
loopback port; greedy replies are compared with the library decoding each prompt
alone, concurrent clients with their lone replies, and bad requests with OpenAI's
error shape.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from mlx_redrafter.apps.batcher import Batcher  # noqa: E402
from mlx_redrafter.apps.server import BackgroundServer, Server, create_app  # noqa: E402
from test_chat import chat_tokenizer  # noqa: E402

from mlx_redrafter import generate  # noqa: E402
from mlx_redrafter.metrics import RequestMetrics  # noqa: E402
from mlx_redrafter.policy import SpeedGuard, TreePolicy  # noqa: E402
from mlx_redrafter.session import Update  # noqa: E402

MODEL_ID = "tiny-llama"


class Served:
    """A running server and what it serves."""

    def __init__(self, model: Any, drafter: Any, prompts: list[list[int]], policy: str):
        self.model, self.drafter, self.prompts = model, drafter, prompts
        self.tokenizer = chat_tokenizer()
        self.batcher = Batcher(model, drafter, self.tokenizer, TreePolicy.parse(policy), seed=0)
        self.app = create_app(Server(self.batcher, MODEL_ID, ("default",)))
        self.background = BackgroundServer(self.app)
        self.url = self.background.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def alone(self, prompt: list[int] | str, max_tokens: int) -> str:
        """The library's greedy reply to one prompt decoded by itself."""
        return generate(self.model, self.drafter, self.tokenizer, prompt, max_tokens=max_tokens)

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/v1/redrafter/status") as response:
            return dict(json.load(response))

    def post(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            self.url + path, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)


@pytest.fixture(scope="module")
def served(trained_llama: Any) -> Any:
    model, drafter, prompts = trained_llama
    served = Served(model, drafter, prompts, "3:4x4,6:2x3")
    with served.background:
        yield served
    served.batcher.close()


def words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def test_models_lists_the_served_model(served: Served) -> None:
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]


def test_chat_completion_matches_the_library(served: Served) -> None:
    content = words(served.prompts[0])
    reply = served.client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": content}],
        max_tokens=24,
        temperature=0,
    )
    prompt = served.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    assert reply.choices[0].message.content == served.alone(prompt, 24)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    figures = reply.model_extra["redrafter"]
    assert figures["speculative"] and figures["steps"] >= 1
    assert figures["tokens_per_step"] >= 1


def test_streamed_chat_equals_the_whole_reply(served: Served) -> None:
    messages: Any = [
        {"role": "system", "content": "w7 w8"},
        {"role": "user", "content": words(served.prompts[1])},
    ]
    whole = served.client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=30, temperature=0
    )
    stream = served.client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage, figures = [], [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
        if chunk.model_extra and "redrafter" in chunk.model_extra:
            figures.append(chunk.model_extra["redrafter"])
    assert "".join(pieces) == whole.choices[0].message.content
    assert reasons[-1] == whole.choices[0].finish_reason
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert len(pieces) > 2  # streamed step by step, not in one piece
    assert figures[-1]["tokens_per_step"] == whole.model_extra["redrafter"]["tokens_per_step"]


def test_logprobs_are_the_target_s_in_openai_s_formats(served: Served) -> None:
    """Chat (whole and streamed) and completions report each token's log-probability
    and top alternatives, as the library computes them under speculation."""
    from mlx_redrafter.generate import stream_generate

    content = words(served.prompts[2])
    messages: Any = [{"role": "user", "content": content}]
    prompt = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = [
        figure
        for response in stream_generate(
            served.model, served.drafter, served.tokenizer, prompt, max_tokens=12, logprobs=3
        )
        for figure in response.logprobs or []
    ]
    reply = served.client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    content_figures = reply.choices[0].logprobs.content
    assert [round(f.logprob, 4) for f in content_figures] == [round(f.logprob, 4) for f in expected]
    for ours, theirs in zip(content_figures, expected):
        assert [t.logprob for t in ours.top_logprobs] == sorted(
            (t.logprob for t in ours.top_logprobs), reverse=True
        )
        assert len(ours.top_logprobs) == len(theirs.top) == 3
        assert ours.top_logprobs[0].logprob >= ours.logprob - 1e-6
    # The tokens' texts join up to the reply (its leading space aside).
    text = reply.choices[0].message.content
    assert "".join(f.token for f in content_figures).lstrip() == text.lstrip()
    stream = served.client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=12, temperature=0, logprobs=True,
        stream=True,
    )  # fmt: skip
    streamed = [
        figure.logprob
        for chunk in stream
        for choice in chunk.choices
        if choice.logprobs is not None
        for figure in choice.logprobs.content or []
    ]
    assert [round(x, 4) for x in streamed] == [round(f.logprob, 4) for f in expected]
    completion = served.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=0, logprobs=2
    )
    legacy = completion.choices[0].logprobs
    assert [round(x, 4) for x in legacy.token_logprobs] == [round(f.logprob, 4) for f in expected]
    assert all(len(top) == 2 for top in legacy.top_logprobs)
    assert legacy.text_offset[0] == 0
    text = completion.choices[0].text
    assert "".join(legacy.tokens) == text
    for token, offset in zip(legacy.tokens, legacy.text_offset):
        assert text[offset : offset + len(token)] == token
    # Streamed: the same tokens and offsets, chunk after chunk.
    chunks = served.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, stream=True
    )
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == legacy.tokens
    assert [o for p in parts for o in p.text_offset] == legacy.text_offset


def test_completions_with_token_ids_and_stop_strings(served: Served) -> None:
    prompt = served.prompts[2]
    expected = served.alone(prompt, 30)
    reply = served.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=30, temperature=0
    )
    assert reply.choices[0].text == expected
    assert reply.model_extra["redrafter"]["tokens_per_step"] > 1.2  # drafts are accepted
    # A stop string cuts the text before it, streamed or not.
    stop = expected.split()[3]
    cut = expected[: expected.index(stop)]
    stopped = served.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=30, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == cut
    assert stopped.choices[0].finish_reason == "stop"
    streamed = served.client.completions.create(
        model=MODEL_ID, prompt=words(prompt), max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut
    # A stop string of several tokens (it may span steps): no part of it is sent.
    long_stop = " ".join(expected.split()[5:8])
    cut = expected[: expected.index(long_stop)]
    for stream in (False, True):
        reply = served.client.completions.create(
            model=MODEL_ID,
            prompt=prompt,
            max_tokens=30,
            temperature=0,
            stop=["w99", long_stop],
            stream=stream,
        )
        chunks = reply if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == cut


def test_stop_text_holds_back_what_may_start_a_stop_string() -> None:
    from mlx_redrafter.session import StopText

    text = StopText(chat_tokenizer(), ["w5 w6", "w9"])
    assert text.add([1, 2], final=False) == "w1 w2"
    assert text.add([5], final=False) == " "  # "w5" may start "w5 w6": held back
    assert text.add([7], final=False) == "w5 w7"  # it did not
    assert text.add([5, 6, 8], final=False) == " " and text.stopped
    tail = StopText(chat_tokenizer(), ["w5 w6"])
    assert tail.add([3, 5], final=False) == "w3 "
    assert tail.add([], final=True) == "w5"  # the end releases what was held


def test_seeded_sampling_is_reproducible_and_zero_tokens_is_empty(served: Served) -> None:
    def sample(seed: int) -> str:
        reply = served.client.completions.create(
            model=MODEL_ID,
            prompt=served.prompts[3],
            max_tokens=20,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
        )
        return reply.choices[0].text

    assert sample(7) == sample(7)
    empty = served.client.completions.create(model=MODEL_ID, prompt="w1 w2", max_tokens=0)
    assert empty.choices[0].text == "" and empty.choices[0].finish_reason == "length"


def test_concurrent_clients_get_their_lone_replies(served: Served) -> None:
    prompts = served.prompts[4:10]
    lengths = [400, 30, 90, 60, 120, 45]  # the first keeps the batch busy while others join
    expected = [served.alone(p, n) for p, n in zip(prompts, lengths)]
    replies: dict[int, str] = {}
    before = served.status()

    def client(index: int) -> None:
        time.sleep(0.02 * index + 0.05 * (index > 0))  # arrive while the first decodes
        if index % 2:
            stream = served.client.completions.create(
                model=MODEL_ID,
                prompt=prompts[index],
                max_tokens=lengths[index],
                temperature=0,
                stream=True,
            )
            replies[index] = "".join(c.choices[0].text for c in stream if c.choices)
        else:
            reply = served.client.completions.create(
                model=MODEL_ID, prompt=prompts[index], max_tokens=lengths[index], temperature=0
            )
            replies[index] = reply.choices[0].text

    def sampled_client() -> None:  # a sampled row in the same batch changes no greedy row
        served.client.completions.create(
            model=MODEL_ID, prompt=prompts[0], max_tokens=30, temperature=1.5, seed=3
        )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    threads.append(threading.Thread(target=sampled_client))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [replies.get(i) for i in range(len(prompts))] == expected
    after = served.status()
    assert after["largest_batch"] >= 4  # they really decoded together
    assert after["joined"] > before["joined"]  # and some joined a running batch
    assert after["admitted"] - before["admitted"] == len(prompts) + 1
    # The batch used several beam shapes as it grew and shrank.
    assert len(after["steps_by_tree"]) >= 2


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", b'{"messages": "hello"}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": -1}', 400,
         "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"temperature": -0.5}', 400, "temperature"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"temperature": "hot"}', 400, "temperature"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"max_tokens": "10"}', 400, "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"stream": "yes"}', 400, "stream"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"model": "gpt-9"}', 404, "model"),
        ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "w1", "top_p": 0}', 400, "top_p"),
        ("/v1/completions", b'{"prompt": "w1", "stop": [1]}', 400, "stop"),
        ("/v1/completions", b'{"prompt": "w1", "seed": 1.5}', 400, "seed"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"tools": [{"type": "function", "function": {"name": "f"}}]}', 400, "tools"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"tool_choice": "auto"}', 400, "tool_choice"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"logprobs": true, "top_logprobs": 21}', 400, "top_logprobs"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"top_logprobs": 2}', 400, "top_logprobs"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"logprobs": 3}', 400, "logprobs"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w1"}], '
         b'"response_format": {"type": "json_object"}}', 400, "response_format"),
        ("/v1/completions", b'{"prompt": "w1", "logprobs": -1}', 400, "logprobs"),
        ("/v1/completions", b'{"prompt": "w1", "echo": true}', 400, "echo"),
        ("/v1/completions", b'{"prompt": "w1", "logit_bias": {"5": 10}}', 400, "logit_bias"),
        ("/v1/nothing", b"{}", 404, None),
    ],
)  # fmt: skip
def test_bad_requests_answer_openai_errors(
    served: Served, path: str, body: bytes, status: int, param: str | None
) -> None:
    code, answer = served.post(path, body)
    assert code == status
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param


def test_the_off_values_of_unsupported_fields_are_accepted(served: Served) -> None:
    body = {
        "messages": [{"role": "user", "content": "w1 w2"}],
        "max_tokens": 3,
        "tools": [],
        "tool_choice": "none",
        "logprobs": False,
        "response_format": {"type": "text"},
    }
    code, answer = served.post("/v1/chat/completions", json.dumps(body).encode())
    assert code == 200, answer


def test_a_body_that_is_not_json_by_its_content_type_gets_415(served: Served) -> None:
    body = json.dumps({"prompt": "w1", "max_tokens": 2}).encode()
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        request = urllib.request.Request(
            served.url + "/v1/completions", data=body, headers={"Content-Type": kind}
        )
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request)
        assert raised.value.code == 415
        error = json.load(raised.value)["error"]
        assert kind in error["message"] and "application/json" in error["message"]
    charset = {"Content-Type": "application/json; charset=utf-8"}
    request = urllib.request.Request(served.url + "/v1/completions", data=body, headers=charset)
    with urllib.request.urlopen(request) as response:
        assert response.status == 200


def test_completions_keep_the_leading_space_of_their_first_token() -> None:
    """mlx-lm's detokenizers drop a reply's leading space; a completion keeps it, so
    prompt + completion reads as the model wrote it (SmolLM2's byte-level BPE)."""
    from mlx_lm.utils import load_tokenizer
    from mlx_redrafter.apps.server import LeadingSpace
    from real_models import smollm2_path

    from mlx_redrafter.session import StopText

    tokenizer = load_tokenizer(smollm2_path())
    tokens = tokenizer.encode(" Paris. It is", add_special_tokens=False)
    text = StopText(tokenizer, ())
    first = text.add(tokens[:1], final=False)
    assert first == "Paris"  # what the detokenizer gives
    fix = LeadingSpace(tokenizer)
    steps = [Update(0, first, tokens[:1], 0, None, RequestMetrics(3))]
    steps.append(
        Update(0, text.add(tokens[1:], final=True), tokens[1:], 0, "stop", RequestMetrics(3))
    )
    assert "".join(fix(update).text for update in steps) == " Paris. It is"
    no_space = tokenizer.encode("Paris", add_special_tokens=False)
    plain = LeadingSpace(tokenizer)(Update(0, "Paris", no_space, 0, None, RequestMetrics(3)))
    assert plain.text == "Paris"


def test_serve_refuses_a_bad_or_busy_port_before_loading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket

    from mlx_redrafter.cli import main

    with pytest.raises(SystemExit) as raised:
        main(["serve", "--port", "99999"])
    assert raised.value.code == 2 and "a TCP port is 0-65535, got 99999" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        code = main(["serve", "--port", str(port), "--model", "/no/such/model"])
    err = capsys.readouterr().err
    assert code == 2 and f"port {port} on 127.0.0.1 is already in use" in err, err
    assert "Traceback" not in err and "serving" not in err
    assert time.monotonic() - started < 5  # refused before any model is loaded


def test_errors_through_the_client_and_the_server_keeps_serving(served: Served) -> None:
    too_long = [5] * 600  # the tiny model's context is 512 positions
    with pytest.raises(openai.BadRequestError) as raised:
        served.client.completions.create(model=MODEL_ID, prompt=too_long, max_tokens=4)
    assert "context" in raised.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        served.client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "w1"}]
        )
    assert "no-such-model" in missing.value.message
    with pytest.raises(openai.BadRequestError):
        served.client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "w1"}], max_tokens=-3
        )
    reply = served.client.completions.create(
        model=MODEL_ID, prompt=served.prompts[0], max_tokens=8, temperature=0
    )
    assert reply.choices[0].text == served.alone(served.prompts[0], 8)


def test_a_client_that_disconnects_frees_its_row(served: Served) -> None:
    before = served.status()
    connection = http.client.HTTPConnection(served.background.host, served.background.port)
    body = {"prompt": served.prompts[1], "max_tokens": 400, "temperature": 0, "stream": True}
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    events = [response.readline() for _ in range(6)]  # a few events of the stream
    assert any(line.startswith(b"data: {") for line in events)
    assert served.status()["active"] == 1
    assert connection.sock is not None
    connection.sock.close()
    connection.close()
    deadline = time.monotonic() + 20
    while served.status()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = served.status()
    assert after["active"] == 0
    assert after["cancelled"] == before["cancelled"] + 1
    # The server goes on serving.
    reply = served.client.completions.create(
        model=MODEL_ID, prompt=served.prompts[2], max_tokens=6, temperature=0
    )
    assert reply.choices[0].text == served.alone(served.prompts[2], 6)


def test_a_non_streamed_client_that_disconnects_frees_its_row_at_once(served: Served) -> None:
    """Updates keep flowing while it decodes: the disconnect must still be noticed."""
    before = served.status()
    connection = http.client.HTTPConnection(served.background.host, served.background.port)
    body = {"prompt": served.prompts[1], "max_tokens": 480, "temperature": 0}
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    deadline = time.monotonic() + 20
    while served.status()["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert connection.sock is not None
    connection.sock.close()
    connection.close()
    closed = time.monotonic()
    while served.status()["active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = served.status()
    assert after["active"] == 0 and time.monotonic() - closed < 1.0
    assert after["cancelled"] == before["cancelled"] + 1  # cancelled, not decoded to the end


def test_a_full_queue_answers_503_with_retry_after(trained_llama: Any) -> None:
    """One row decoding, one request waiting (max_queue=1): the next one gets a 503."""
    from mlx_redrafter.apps.batcher import Job, QueueFull

    model, drafter, prompts = trained_llama
    batcher = Batcher(model, drafter, chat_tokenizer(), "2x3", max_batch=1, max_queue=1)
    server = BackgroundServer(create_app(Server(batcher, MODEL_ID)))
    started = threading.Event()
    running = Job(list(prompts[0]), lambda _: started.set(), max_tokens=480)
    waiting = Job(list(prompts[1]), lambda _: None, max_tokens=4)
    try:
        with server:
            batcher.submit(running)
            assert started.wait(20)
            batcher.submit(waiting)
            with pytest.raises(QueueFull):
                batcher.submit(Job(list(prompts[2]), lambda _: None))
            request = urllib.request.Request(
                server.url + "/v1/completions",
                data=json.dumps({"prompt": "w1 w2", "max_tokens": 2}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as raised:
                urllib.request.urlopen(request)
            assert raised.value.code == 503
            assert raised.value.headers["Retry-After"] == "2"
            error = json.load(raised.value)["error"]
            assert (
                error["code"] == "server_busy"
                and "1 requests are already waiting" in error["message"]
            )
            running.cancel()
            deadline = time.monotonic() + 20
            while batcher.pending and time.monotonic() < deadline:
                time.sleep(0.01)
            with urllib.request.urlopen(request) as response:  # room again
                assert response.status == 200
    finally:
        running.cancel()
        batcher.close()


def test_speed_guard_decodes_plainly_where_the_tree_does_not_pay() -> None:
    from mlx_redrafter.config import PLAIN_DECODING, TreeConfig

    tree = TreeConfig(2, 3)
    guard = SpeedGuard(probe_every=3)
    assert guard.choose(tree, 4) == tree  # measure the tree first
    guard.record(tree, 4, seconds=0.30, tau=1.2)
    assert guard.choose(tree, 4) == PLAIN_DECODING  # then the plain step
    guard.record(PLAIN_DECODING, 4, seconds=0.15, tau=1.0)
    assert guard.gain(tree, 4) == pytest.approx(0.6)
    choices = [guard.choose(tree, 4) for _ in range(6)]
    assert choices == [PLAIN_DECODING, PLAIN_DECODING, tree] * 2  # probes now and then
    for _ in range(3):  # the drafter got good: tau averages up
        guard.record(tree, 4, seconds=0.30, tau=2.9)
    assert (guard.gain(tree, 4) or 0) > 1 and guard.choose(tree, 4) == tree
    assert guard.choose(tree, 8) == tree  # each batch size is measured on its own


def test_the_guard_decodes_plainly_when_the_tree_is_slow() -> None:
    """Wired into the worker: a tree measured ten times slower than a plain step (the
    step times are scaled here; on this tiny model verifying a tree is nearly free)
    gives way to plain decoding, and the text is the same."""
    from mlx_redrafter.apps.batcher import Job
    from tiny_models import tiny_model

    from mlx_redrafter.config import PLAIN_DECODING
    from mlx_redrafter.drafter import Drafter
    from mlx_redrafter.target import prepare_target

    class SlowTrees(SpeedGuard):
        def record(self, beam: Any, batch_size: int, seconds: float, tau: float) -> None:
            scaled = 1.0 if beam == PLAIN_DECODING else 10.0
            super().record(beam, batch_size, scaled, tau)

    model = prepare_target(tiny_model("llama", seed=3))
    drafter = Drafter.create(model)
    tokenizer = chat_tokenizer()
    batcher = Batcher(model, drafter, tokenizer, TreePolicy.parse("4x4"), seed=0, guard=SlowTrees())
    done = threading.Event()
    texts: list[str] = []

    def collect(update: Any) -> None:
        texts.append(update.text)
        if update.finish_reason is not None:
            done.set()

    batcher.submit(Job([1, 2, 3], collect, max_tokens=60))
    assert done.wait(60)
    batcher.close()
    steps = batcher.session.stats.steps_by_tree
    assert steps["1x1"] > 3 * steps["4x4"]
    assert "".join(texts) == generate(model, None, tokenizer, [1, 2, 3], max_tokens=60)


def test_one_token_prompts_join_a_running_batch(trained_llama: Any) -> None:
    """A prompt of one token commits nothing at prefill; it must still join (and be
    joined by) rows whose caches hold keys."""
    from mlx_redrafter.apps.batcher import Job

    model, drafter, prompts = trained_llama
    tokenizer = chat_tokenizer()
    batcher = Batcher(model, drafter, tokenizer, TreePolicy.parse("3x3"), seed=0)
    requests = [[9], prompts[0], [17], [4]]
    texts = ["" for _ in requests]
    done = threading.Semaphore(0)

    def collector(index: int) -> Any:
        def collect(update: Any) -> None:
            texts[index] += update.text
            if update.finish_reason is not None:
                assert update.error is None, update.error
                done.release()

        return collect

    for index, prompt in enumerate(requests):
        batcher.submit(Job(prompt, collector(index), max_tokens=30))
        time.sleep(0.01)
    for _ in requests:
        assert done.acquire(timeout=60)
    batcher.close()
    assert batcher.stats.joined > 0
    assert texts == [generate(model, drafter, tokenizer, p, max_tokens=30) for p in requests]


def test_the_serve_command(trained_llama: Any, tmp_path: Any) -> None:
    """`mlx-redrafter serve` on model and drafter folders: loopback, the page, a reply."""
    import subprocess
    import sys

    from test_chat import save_tiny

    model, drafter, prompts = trained_llama
    model_dir, drafter_dir = save_tiny(model, drafter, tmp_path)
    from ports import free_ports

    port = free_ports(1)
    argv = [sys.executable, "-m", "mlx_redrafter.cli", "serve", "--model", str(model_dir)]
    argv += ["--drafter", str(drafter_dir), "--port", str(port), "--tree", "2:3x3"]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models") as response:
                    models = json.load(response)
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert models["data"][0]["id"] == "model"  # the folder's name
        with urllib.request.urlopen(url + "/") as response:
            assert b"mlx-redrafter" in response.read()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model=str(model_dir), prompt=prompts[0], max_tokens=12, temperature=0
        )
        assert reply.choices[0].text == generate(
            model, drafter, chat_tokenizer(), prompts[0], max_tokens=12
        )
    finally:
        process.terminate()
        _, errors = process.communicate(timeout=20)
    assert f"on http://127.0.0.1:{port}/" in errors
    assert "B<=2: 3x3" in errors


def test_the_prefix_cache_reuses_a_conversation_and_reports_cached_tokens(
    trained_llama: Any,
) -> None:
    """A second turn extending the first (prompt + reply) prefills only its new part,
    says so in usage.prompt_tokens_details.cached_tokens, and replies exactly as the
    library does without any cache; a bounded store drops its least recent entry."""
    from mlx_redrafter.prompt_cache import PrefixStore

    model, drafter, prompts = trained_llama
    tokenizer = chat_tokenizer()
    store = PrefixStore(1 << 30)
    batcher = Batcher(model, drafter, tokenizer, TreePolicy.parse("2x3"), seed=0, prefixes=store)
    server = BackgroundServer(create_app(Server(batcher, MODEL_ID)))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": words(prompts[2])}]
    try:
        with server:
            first = client.chat.completions.create(
                model=MODEL_ID, messages=messages, max_tokens=12, temperature=0
            )
            assert first.usage is not None and first.usage.prompt_tokens_details is not None
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": words(prompts[3])},
            ]
            second = client.chat.completions.create(
                model=MODEL_ID, messages=messages, max_tokens=12, temperature=0
            )
    finally:
        batcher.close()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert second.choices[0].message.content == generate(
        model, drafter, tokenizer, prompt, max_tokens=12
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    first_prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The template renders the first turn's generation prompt (w3) as an assistant turn
    # in the second prompt: they share everything before it.
    shared = next(i for i, (a, b) in enumerate(zip(first_prompt, prompt)) if a != b)
    assert cached == shared == len(first_prompt) - 1
    assert store.lookups == 2 and store.hits == 1
    assert len(store.entries) == 2  # the second turn does not extend the first (w3)
    # Bounded: room for one entry only keeps the most recent.
    older = store.entries[0]
    extended = type(older)(older.cache, [*older.tokens, 5])
    store.add(extended)  # an entry that a newer one extends is dropped
    assert older not in store.entries and len(store.entries) == 2
    small = PrefixStore(sum(a.nbytes for a in older.cache.arrays()) + 1)
    small.add(older)
    newer = type(older)(older.cache, [t + 1 for t in older.tokens])  # shares nothing
    small.add(newer)
    assert small.entries == [newer]
    assert (
        small.lookup(older.tokens).cache is None and small.lookup(newer.tokens).cache is newer.cache
    )
