"""The Python API: stream_generate, generate and batch_generate, on `DecodingSession`."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import mlx.core as mx
import mlx.nn as nn

from .config import CacheConfig, SamplingConfig, TreeConfig
from .drafter import Drafter
from .logprobs import TokenLogprob
from .metrics import RequestMetrics
from .policy import TreeChoice
from .prompt_cache import PromptCache
from .prompts import text_tokens
from .session import DecodingSession, Request, Update, request_keys, stop_config

if TYPE_CHECKING:
    from typing_extensions import Unpack

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class GenerationResponse:
    """One decoding step of one request, with running figures.

    text: the new text of this step (may be empty while a character is incomplete,
        or while the text may be the start of a stop string).
    tokens: the token ids emitted in this step: `num_accepted` drafted tokens the
        target accepted, then its own bonus token (fewer when the request stopped).
    prompt_tokens: tokens in the prompt; cached_tokens: of those, the ones a prompt
        cache held (not prefilled); prompt_seconds: the prefill's wall-clock.
    generation_tokens: tokens generated so far.
    steps: target verification forwards so far.
    tokens_per_step: tau, tokens the target produced per verification forward so far,
        counting the bonus token (and a final EOS token, which is not in the text).
    prompt_tps: prefilled tokens per second.
    generation_tps: decoding tokens per second so far (excluding prefill).
    peak_memory: peak memory in GB so far.
    finish_reason: None while running; "stop" (EOS or a stop string) or "length".
    tree_size: distinct prefixes the target verified in this step (1 when plain).
    tree: the notation of this step's tree (e.g. "1x2+1x7"; "1x1" when plain).
    acceptance_by_depth: the fraction of steps so far that accepted at least k
        drafted tokens, for k = 1, 2, ...
    logprobs: with `logprobs=K`, one `TokenLogprob` per token in `tokens`: its
        log-probability under the target and the K most likely tokens there.
    """

    text: str
    tokens: list[int]
    num_accepted: int
    prompt_tokens: int
    generation_tokens: int
    steps: int
    tokens_per_step: float
    prompt_tps: float
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    tree_size: int = 1
    acceptance_by_depth: tuple[float, ...] = ()
    tree: str = "1x1"
    cached_tokens: int = 0
    prompt_seconds: float = 0.0
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, update: Update) -> GenerationResponse:
        """The response of one session update."""
        metrics: RequestMetrics = update.metrics
        return cls(
            text=update.text,
            tokens=update.tokens,
            num_accepted=update.num_accepted,
            prompt_tokens=metrics.prompt_tokens,
            generation_tokens=metrics.generated,
            steps=metrics.steps,
            tokens_per_step=metrics.tokens_per_step,
            prompt_tps=metrics.prompt_tps,
            generation_tps=metrics.generation_tps,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=update.finish_reason,
            tree_size=update.tree_size,
            acceptance_by_depth=tuple(metrics.acceptance_by_depth),
            tree=update.tree.label,
            cached_tokens=metrics.cached_tokens,
            prompt_seconds=metrics.prompt_seconds,
            logprobs=update.logprobs,
        )


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: a string (`prompts.text_tokens`: with the BOS token unless
    it already starts with it), an mx.array or a sequence of ids."""
    if isinstance(prompt, str):
        tokens = text_tokens(tokenizer, prompt)
    elif isinstance(prompt, mx.array):
        tokens = [int(t) for t in prompt.reshape(-1).tolist()]
    else:
        tokens = [int(t) for t in prompt]
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token or a non-empty string")
    return tokens


def stream_batch(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    tree: TreeConfig | TreeChoice | str | None = None,
    cache: CacheConfig | None = None,
    prompt_caches: Sequence[PromptCache | None] | None = None,
    session: DecodingSession | None = None,
    logprobs: int | None = None,
) -> Iterator[tuple[int, GenerationResponse]]:
    """Decode several prompts together; yields (prompt index, response) per row and step.

    tree: "auto" (None: `DEFAULT_TREE`, the tree chosen per step for this model and
    machine), a `TreeConfig` or its notation, e.g. "1x2+1x7", or a `TreeChoice`
    (an `auto.AutoTree` kept across calls keeps what it learned);
    cache: the target's K/V storage (`CacheConfig(kv_bits=8)` quantizes it);
    prompt_caches: per prompt, a `PromptCache` (or None) whose shared prefix is not
    prefilled again and which takes the prompt and reply when the row ends;
    session: a `DecodingSession` of this model and drafter to decode in, kept across
    calls (its compiled steps and tree choice carry over); `tree` and `cache` are then
    the session's;
    logprobs: report each token's log-probability under the target (exact under
    speculation: the raw logits' log-softmax, before temperature) with this many
    most likely alternatives, 0..20 (`GenerationResponse.logprobs`).
    """
    encoded = [prompt_ids(tokenizer, prompt) for prompt in prompts]
    prefixes = list(prompt_caches) if prompt_caches is not None else [None] * len(encoded)
    if len(prefixes) != len(encoded):
        raise ValueError(f"{len(prefixes)} prompt caches for {len(encoded)} prompts")
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    rules = stop_config(tokenizer, max_tokens, stop)
    if session is None:
        session = DecodingSession(model, drafter, tokenizer, tree=tree, cache=cache)
    elif session.model is not model or session.drafter is not drafter:
        raise ValueError("the session decodes another model or drafter than the one given")
    keys = request_keys(seed, len(encoded))
    requests = [
        Request(tokens, sampling, rules, key, prefix, logprobs)
        for tokens, key, prefix in zip(encoded, keys, prefixes)
    ]
    for update in session.run(requests):
        yield update.request, GenerationResponse.of(update)


class GenerationOptions(TypedDict, total=False):
    """Keyword options shared by every generation function (defaults in `stream_batch`)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: Sequence[str] | str | None
    tree: TreeConfig | TreeChoice | str | None
    cache: CacheConfig | None
    session: DecodingSession | None
    logprobs: int | None


def stream_generate(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompt: Prompt,
    prompt_cache: PromptCache | None = None,
    **options: Unpack[GenerationOptions],
) -> Iterator[GenerationResponse]:
    """Generate for one prompt, yielding a GenerationResponse per decoding step.

    Options as in `stream_batch` (max_tokens=256, temperature=0.0, top_p=1.0, top_k=0,
    seed, stop, tree, cache, logprobs). prompt_cache: a `PromptCache` kept across calls (a
    conversation's turns): only what the prompt does not share with it is prefilled.
    `drafter=None` decodes with the tree's lookup branches alone
    (`TreeConfig.lookup_only`: "1x2+1x7" decodes as "0x1+1x7"), or plainly (one
    token per target forward) for a tree without them, through the same session. The
    last response has a finish_reason and carries the totals.
    """
    caches = [prompt_cache]
    for _, response in stream_batch(
        model, drafter, tokenizer, [prompt], prompt_caches=caches, **options
    ):
        yield response


def generate(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompt: Prompt,
    verbose: bool = False,
    **options: Unpack[GenerationOptions],
) -> str:
    """Generate a whole response for one prompt (a string or token ids).

    Options as in `stream_batch`; `verbose` prints the text as it streams and a summary.
    Only the text is returned: for `logprobs`, read them from `stream_generate`.
    """
    pieces = []
    last: GenerationResponse | None = None
    started = time.perf_counter()
    for response in stream_generate(model, drafter, tokenizer, prompt, **options):
        pieces.append(response.text)
        if verbose:
            print(response.text, end="", flush=True)
        last = response
    if verbose and last is not None:
        print()
        print(format_summary(last, time.perf_counter() - started))
    return "".join(pieces)


def batch_generate(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    **options: Unpack[GenerationOptions],
) -> list[str]:
    """Generate for several prompts decoded together; one string per prompt.

    Options as in `stream_batch`.
    """
    texts = [""] * len(prompts)
    for row, response in stream_batch(model, drafter, tokenizer, prompts, **options):
        texts[row] += response.text
    return texts


def format_summary(response: GenerationResponse, seconds: float | None = None) -> str:
    lines = [
        f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens/s",
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s,"
        f" {response.steps} target steps, {response.tokens_per_step:.2f} tokens/step",
        f"Peak memory: {response.peak_memory:.3f} GB; finish: {response.finish_reason}",
    ]
    if seconds is not None:
        lines.append(f"Wall-clock: {seconds:.2f} s")
    return "\n".join(lines)
