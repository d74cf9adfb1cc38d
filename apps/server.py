"""An OpenAI-compatible HTTP server over the continuous-batching decode worker.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (streaming as
server-sent events, or not), `GET /v1/models`, `GET /v1/redrafter/status`, `GET /metrics`
(Prometheus, `apps/prometheus.py`) and the chat page at `/`. Every request becomes a
`Job` of the one `Batcher`; the worker thread counts each step's update in the
metrics and hands it to the request's asyncio queue.

Beyond OpenAI's fields, each response carries `redrafter`: tau (tokens per target
step), drafted tokens accepted, target steps, decoding speed and the tree of the
last step. Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mlx_redrafter.config import SamplingConfig
from mlx_redrafter.logprobs import MAX_TOP, TokenLogprob
from mlx_redrafter.prompts import chat_tokens, text_tokens
from mlx_redrafter.session import Update

from .batcher import Batcher, Job, QueueFull
from .logprob_format import LogprobFormat, starts_word
from .prometheus import CONTENT_TYPE, ServerMetrics

STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_TOKENS = 512
DISCONNECT_POLL = 0.05  # seconds between checks that a non-streamed client is still there


class ClientGone(Exception):
    """The client closed its connection before the reply was ready."""


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = headers or {}
        self.message, self.status, self.param, self.code, self.kind = (
            message,
            status,
            param,
            code,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# -- reading requests --------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _wrong_type(name: str, expected: str, value: Any) -> APIError:
    return APIError(
        f"'{name}' must be {expected}, got {json.dumps(value)[:60]}",
        param=name,
        code="invalid_type",
    )


def _optional(body: dict[str, Any], name: str) -> Any:
    return body.get(name)


@dataclass(frozen=True)
class Settings:
    """The generation fields of a request, checked."""

    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # top alternatives per token to report; None: none


def read_settings(body: dict[str, Any], default_max_tokens: int) -> Settings:
    """Check the fields both endpoints share; raise APIError naming the bad one."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens):
        raise _wrong_type(name, "an integer", max_tokens)
    elif max_tokens < 0:
        raise APIError(f"'{name}' must be >= 0, got {max_tokens}", param=name, code="invalid_value")
    temperature = _optional(body, "temperature")
    if temperature is None:
        temperature = 1.0
    elif not _is_number(temperature):
        raise _wrong_type("temperature", "a number", temperature)
    elif temperature < 0:
        raise APIError(
            f"'temperature' must be >= 0 (0 is greedy), got {temperature}",
            param="temperature",
            code="invalid_value",
        )
    top_p = _optional(body, "top_p")
    if top_p is None:
        top_p = 1.0
    elif not _is_number(top_p):
        raise _wrong_type("top_p", "a number", top_p)
    elif not 0 < top_p <= 1:
        raise APIError(
            f"'top_p' must be in (0, 1], got {top_p}", param="top_p", code="invalid_value"
        )
    top_k = _optional(body, "top_k")
    if top_k is None:
        top_k = 0
    elif not _is_int(top_k) or top_k < 0:
        raise _wrong_type("top_k", "an integer >= 0", top_k)
    stop = _optional(body, "stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise _wrong_type("stop", "a string or a list of strings", stop)
    seed = _optional(body, "seed")
    if seed is not None and not _is_int(seed):
        raise _wrong_type("seed", "an integer", seed)
    stream = _optional(body, "stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise _wrong_type("stream", "a boolean", stream)
    options = _optional(body, "stream_options") or {}
    if not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _wrong_type("stream_options.include_usage", "a boolean", include_usage)
    n = _optional(body, "n")
    if n is not None and (not _is_int(n) or n != 1):
        raise APIError("only n = 1 is supported", param="n", code="invalid_value")
    sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=top_k)
    return Settings(max_tokens, sampling, stops, seed, stream, include_usage)


def read_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top alternatives to report per token (None: no log-probabilities).

    Chat: `logprobs` (a boolean) and `top_logprobs` (0..20, needs `logprobs`);
    completions: `logprobs` (an integer 0..20)."""
    name = "top_logprobs" if chat else "logprobs"
    wanted = _optional(body, "logprobs")
    top = _optional(body, name) if chat else wanted
    if chat and wanted is not None and not isinstance(wanted, bool):
        raise _wrong_type("logprobs", "a boolean", wanted)
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP):
        raise _wrong_type(name, f"an integer from 0 to {MAX_TOP}", top)
    if chat and top and not wanted:
        raise APIError(
            "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value"
        )
    if chat:
        return (top or 0) if wanted else None
    return top


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise APIError(
                    "only text content parts are supported",
                    param=f"messages[{index}].content",
                    code="invalid_value",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _wrong_type(f"messages[{index}].content.text", "a string", text)
            parts.append(text)
        return "".join(parts)
    raise _wrong_type(f"messages[{index}].content", "a string or a list of parts", content)


def read_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise APIError("'messages' is required", param="messages", code="missing_required")
    if not isinstance(messages, list) or not messages:
        raise _wrong_type("messages", "a non-empty list of messages", messages)
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _wrong_type(f"messages[{index}]", "an object", message)
        role = message.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(
                f"messages[{index}].role must be system, user, assistant, developer or tool, "
                f"got {json.dumps(role)}",
                param=f"messages[{index}].role",
                code="invalid_value",
            )
        role = "system" if role == "developer" else role
        checked.append({"role": role, "content": _message_text(message.get("content"), index)})
    return checked


def read_prompt(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("'prompt' is required", param="prompt", code="missing_required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("'prompt' is empty", param="prompt", code="invalid_value")
        return text_tokens(tokenizer, prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise _wrong_type("prompt", "a non-empty string or a list of token ids", prompt)


# Fields this server does not implement: a request that uses one gets a 400 naming it
# instead of a reply that silently ignores it. Each maps to the values that mean "off".
_UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": ("tool calling", (None, [])),
    "tool_choice": ("tool calling", (None, "none")),
    "functions": ("function calling", (None, [])),
    "function_call": ("function calling", (None, "none")),
    "logit_bias": ("logit bias", (None, {})),
    "echo": ("echoing the prompt", (None, False)),
    "suffix": ("suffixes", (None, "")),
    "best_of": ("best_of", (None, 1)),
}


def check_supported(body: dict[str, Any]) -> None:
    """Refuse fields the server would otherwise ignore (400, naming the field)."""
    for name, (what, off) in _UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == o and type(value) is type(o) for o in off):
            raise APIError(
                f"'{name}' is not supported by this server ({what}); remove it from the request",
                param=name,
                code="unsupported_parameter",
            )
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise APIError(
            "'response_format' is not supported by this server (structured output); "
            'only {"type": "text"} is',
            param="response_format",
            code="unsupported_parameter",
        )


class LeadingSpace:
    """Give /v1/completions text back the space its first token starts with.

    mlx-lm's streaming detokenizers drop the leading space of a reply (right for chat
    messages); a completion continues its prompt, so "The capital of France is" +
    " Paris." must keep it. Only the first non-empty text of a request changes.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.pending: bool | None = None  # unknown until the first token

    def __call__(self, update: Update) -> Update:
        if self.pending is None and update.tokens:
            self.pending = starts_word(self.tokenizer, update.tokens[0])
        if not (self.pending and update.text):
            return update
        self.pending = False
        return update if update.text.startswith(" ") else replace(update, text=" " + update.text)


# -- the app ------------------------------------------------------------------------


class Server:
    """Routes requests to the batcher; one instance per app."""

    def __init__(
        self,
        batcher: Batcher,
        model_id: str,
        aliases: tuple[str, ...] = (),
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ):
        self.batcher = batcher
        self.model_id = model_id
        self.aliases = {model_id, *aliases}
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.metrics = ServerMetrics(model_id, queue=lambda: (batcher.active, batcher.pending))

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise _wrong_type("model", "a string", model)
        if model not in self.aliases:
            raise APIError(
                f"the model '{model}' does not exist: this server serves '{self.model_id}' "
                "(see GET /v1/models)",
                status=404,
                param="model",
                code="model_not_found",
            )

    async def read_body(self, request: Request) -> dict[str, Any]:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind and kind != "application/json" and not kind.endswith("+json"):
            raise APIError(
                f"the request body must be JSON, but its Content-Type is '{kind}': send "
                "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')",
                status=415,
                code="unsupported_media_type",
            )
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(
                f"the request body is not valid JSON: {error}", code="invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", code="invalid_json")
        self.check_model(body)
        check_supported(body)
        return body

    def redrafter_figures(self, update: Update) -> dict[str, Any]:
        metrics = update.metrics
        return {
            "tokens_per_step": round(metrics.tokens_per_step, 4),
            "accepted_tokens": metrics.accepted,
            "acceptance_by_depth": [round(a, 4) for a in metrics.acceptance_by_depth],
            "steps": metrics.steps,
            "generation_tps": round(metrics.generation_tps, 2),
            "tree": update.tree.label,
            "batch_size": update.batch_size,
            "speculative": self.batcher.session.speculates,
        }

    @staticmethod
    def usage(update: Update) -> dict[str, Any]:
        metrics = update.metrics
        return {
            "prompt_tokens": metrics.prompt_tokens,
            "completion_tokens": metrics.generated,
            "total_tokens": metrics.prompt_tokens + metrics.generated,
            "prompt_tokens_details": {"cached_tokens": metrics.cached_tokens},
        }

    def start(
        self,
        prompt: list[int],
        settings: Settings,
        param: str,
        rewrite: Callable[[Update], Update] | None = None,
    ) -> tuple[Job, asyncio.Queue[Update]]:
        """Submit a request; its updates (through `rewrite`, in order) land in the queue."""
        problem = self.batcher.check_prompt(prompt)
        if problem is not None:
            code = "context_length_exceeded" if "context" in problem else "invalid_value"
            raise APIError(problem, param=param, code=code)
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()
        track = self.metrics.track()

        def deliver(update: Update) -> None:
            try:  # counted before the reply can see it; a failure here must not lose it
                self.metrics.on_update(update, track)
            except Exception:
                traceback.print_exc()
            if rewrite is not None:
                update = rewrite(update)
            loop.call_soon_threadsafe(updates.put_nowait, update)

        job = Job(
            prompt,
            deliver,
            sampling=settings.sampling,
            max_tokens=settings.max_tokens,
            stop=settings.stop,
            seed=settings.seed,
            logprobs=settings.logprobs,
        )
        try:
            self.batcher.submit(job)
        except QueueFull as full:
            wait = 1 + self.batcher.pending // max(self.batcher.max_batch, 1)
            raise APIError(
                f"the server is busy ({full}): retry in {wait} s",
                status=503,
                kind="server_error",
                code="server_busy",
                headers={"Retry-After": str(wait)},
            ) from None
        return job, updates

    async def collect(
        self, request: Request, job: Job, updates: asyncio.Queue[Update]
    ) -> tuple[str, Update, list[TokenLogprob]]:
        """Wait for the whole reply: its text, last update and the tokens' figures (when
        asked). The connection is checked every DISCONNECT_POLL seconds while updates
        flow, so a client that goes away frees its row within a step or two instead of
        at the end of its reply."""
        pieces: list[str] = []
        figures: list[TokenLogprob] = []
        checked = time.monotonic()
        try:
            while True:
                try:
                    update = await asyncio.wait_for(updates.get(), timeout=DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    update = None
                if update is None or time.monotonic() - checked >= DISCONNECT_POLL:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise ClientGone() from None
                if update is None:
                    continue
                pieces.append(update.text)
                figures += update.logprobs or []
                if update.finish_reason is not None:
                    if update.error is not None:
                        raise APIError(
                            f"generation failed: {update.error}",
                            status=500,
                            kind="server_error",
                            code="generation_failed",
                        )
                    return "".join(pieces), update, figures
        finally:
            job.cancel()  # no effect once the row finished

    async def stream(
        self,
        job: Job,
        updates: asyncio.Queue[Update],
        chunk: Callable[[str, str | None, dict[str, Any] | None, Update | None], dict[str, Any]],
        settings: Settings,
        first: dict[str, Any] | None = None,
    ) -> AsyncIterator[str]:
        try:
            if first is not None:
                yield _event(first)
            while True:
                update = await updates.get()
                if update.error is not None:
                    error = APIError(
                        f"generation failed: {update.error}",
                        status=500,
                        kind="server_error",
                        code="generation_failed",
                    )
                    yield _event(error.body())
                    break
                if update.finish_reason is None and not update.text and not update.logprobs:
                    continue
                reason = update.finish_reason
                payload = chunk(update.text, reason, None, update)
                payload["redrafter"] = self.redrafter_figures(update)
                yield _event(payload)
                if reason is not None:
                    if settings.include_usage:
                        final = chunk("", None, None, None)
                        final["choices"] = []
                        final["usage"] = self.usage(update)
                        yield _event(final)
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client went away, or we are done: free the row

    # -- endpoints ----------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        body = await self.read_body(request)
        messages = read_messages(body)
        settings = read_settings(body, self.default_max_tokens)
        settings = replace(settings, logprobs=read_logprobs(body, chat=True))
        prompt = chat_tokens(self.batcher.tokenizer, messages)
        job, updates = self.start(prompt, settings, "messages")
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        # Chat text starts without the space its first token may carry (as mlx-lm's).
        formats = LogprobFormat(self.batcher.tokenizer)
        if settings.stream:

            def chunk(
                text: str, reason: str | None, role: dict[str, Any] | None, update: Update | None
            ) -> dict[str, Any]:
                delta: dict[str, Any] = role or ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
                if update is not None and update.logprobs is not None:
                    choice["logprobs"] = formats.chat(update.logprobs)
                return {
                    "id": ident,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_id,
                    "choices": [choice],
                }

            first = chunk("", None, {"role": "assistant", "content": ""}, None)
            return _sse(self.stream(job, updates, chunk, settings, first))
        text, last, figures = await self.collect(request, job, updates)
        reported = None if settings.logprobs is None else formats.chat(figures)
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": self.model_id,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": last.finish_reason,
                        "logprobs": reported,
                    }
                ],
                "usage": self.usage(last),
                "redrafter": self.redrafter_figures(last),
            }
        )

    async def completions(self, request: Request) -> Response:
        body = await self.read_body(request)
        prompt = read_prompt(self.batcher.tokenizer, body)
        settings = read_settings(body, self.default_max_tokens)
        settings = replace(settings, logprobs=read_logprobs(body, chat=False))
        rewrite = LeadingSpace(self.batcher.tokenizer)
        job, updates = self.start(prompt, settings, "prompt", rewrite)
        ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        formats = LogprobFormat(self.batcher.tokenizer, keep_space=True)

        def chunk(
            text: str, reason: str | None, _: dict[str, Any] | None, update: Update | None
        ) -> dict[str, Any]:
            reported = None
            if update is not None and update.logprobs is not None:
                reported = formats.completion(update.logprobs)
            return {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": self.model_id,
                "choices": [
                    {"index": 0, "text": text, "logprobs": reported, "finish_reason": reason}
                ],
            }

        if settings.stream:
            return _sse(self.stream(job, updates, chunk, settings))
        text, last, figures = await self.collect(request, job, updates)
        payload = chunk(text, last.finish_reason, None, None)
        if settings.logprobs is not None:
            payload["choices"][0]["logprobs"] = formats.completion(figures)
        payload["usage"] = self.usage(last)
        payload["redrafter"] = self.redrafter_figures(last)
        return JSONResponse(payload)

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_id,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "mlx-redrafter",
                    }
                ],
            }
        )

    async def status(self, request: Request) -> Response:
        stats = self.batcher.stats
        steps = self.batcher.session.stats
        return JSONResponse(
            {
                "model": self.model_id,
                "speculative": self.batcher.session.speculates,
                "policy": self.batcher.session.describe(),
                "active": self.batcher.active,
                "pending": self.batcher.pending,
                "steps": steps.steps,
                "admitted": stats.admitted,
                "joined": stats.joined,
                "finished": stats.finished,
                "cancelled": stats.cancelled,
                "largest_batch": steps.largest_batch,
                "steps_by_tree": dict(steps.steps_by_tree),
                "context_length": self.batcher.context_limit,
            }
        )

    async def prometheus(self, request: Request) -> Response:
        """The metrics in Prometheus' text exposition format 0.0.4."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _guarded(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        try:
            response: Response = await handler(request)
            return response
        except APIError as error:
            return error.response()
        except ClientGone:  # nobody reads this; the row has been freed
            return Response(status_code=499)
        except ValueError as error:  # a setting the core refused
            return APIError(str(error)).response()

    return endpoint


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    status = error.status_code
    message = {
        404: f"no route {request.method} {request.url.path}: see /v1/chat/completions, "
        "/v1/completions, /v1/models, /v1/redrafter/status, /metrics",
        405: f"{request.method} is not allowed on {request.url.path}",
    }.get(status, str(error.detail))
    return APIError(message, status=status, code="not_found" if status == 404 else None).response()


def create_app(server: Server) -> Starlette:
    routes = [
        Route("/", _guarded(server.page), methods=["GET"]),
        Route("/v1/chat/completions", _guarded(server.chat_completions), methods=["POST"]),
        Route("/v1/completions", _guarded(server.completions), methods=["POST"]),
        Route("/v1/models", _guarded(server.models), methods=["GET"]),
        Route("/v1/redrafter/status", _guarded(server.status), methods=["GET"]),
        Route("/metrics", _guarded(server.prometheus), methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.server = server
    return app


class BackgroundServer:
    """Uvicorn serving `app` on a thread (tests, the load test): `port` 0 picks a free one."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0):
        import socket
        import threading

        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, int(self.socket.getsockname()[1])
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.socket.close()
