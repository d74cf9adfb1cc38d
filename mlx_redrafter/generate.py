"""The Python API: stream_generate, generate and batch_generate.

Everything that produces text (this API, the CLI, the chat app, the server and
the benchmark) consumes `stream_generate` or `stream_batch`, which consume the
token-level loop in `decode.py`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import mlx.core as mx
import mlx.nn as nn

from .config import BeamConfig, CacheConfig, SamplingConfig, StopConfig
from .decode import speculative_decode
from .drafter import Drafter
from .target import context_length, prepare_target

if TYPE_CHECKING:
    from typing_extensions import Unpack

# The default tree: one drafter beam of 2 tokens (the root and one drafted token)
# and one lookup beam of 7 (N = 8), `1x2+1x7`. The fastest shape measured on this
# machine with the shipped SmolLM2 drafter and its n-gram table: 1.80x mlx-lm at
# tau 2.51 on the headline run (README, "Performance"; session 11), against 1.74x
# for 2x2+1x7 (tau 2.61) and 1.71x for 1x3+1x7 (tau 2.60) in the same run.
DEFAULT_BEAM = BeamConfig(beam_width=1, beam_length=2, lookup_beams=1, lookup_length=7)

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class GenerationResponse:
    """One decoding step of one request, with running figures.

    text: the new text of this step (may be empty while a character is incomplete).
    tokens: the token ids emitted in this step: `num_accepted` drafted tokens the
        target accepted, then its own bonus token (fewer when the request stopped).
    prompt_tokens: tokens in the prompt.
    generation_tokens: tokens generated so far.
    steps: target verification forwards so far.
    tokens_per_step: tau, tokens the target produced per verification forward so far,
        counting the bonus token (and a final EOS token, which is not in the text).
    prompt_tps: prefill tokens per second.
    generation_tps: decoding tokens per second so far (excluding prefill).
    peak_memory: peak memory in GB so far.
    finish_reason: None while running; "stop" (EOS or a stop string) or "length".
    tree_size: distinct prefixes the target verified in this step (1 when plain).
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


def _encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special_tokens = bos is None or not prompt.startswith(bos)
        tokens = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    elif isinstance(prompt, mx.array):
        tokens = [int(t) for t in prompt.reshape(-1).tolist()]
    else:
        tokens = [int(t) for t in prompt]
    if not tokens:
        raise ValueError("the prompt is empty: give at least one token or a non-empty string")
    return tokens


def _check_inputs(
    model: nn.Module, drafter: Drafter | None, prompts: list[list[int]], vocab_size: int
) -> None:
    limit = context_length(model)
    for index, tokens in enumerate(prompts):
        if limit is not None and len(tokens) >= limit:
            raise ValueError(
                f"prompt {index} has {len(tokens)} tokens but the model's context is {limit} "
                "positions: shorten the prompt"
            )
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {index} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )
    if drafter is not None:
        drafter.check_fits(model)


def beam_config(
    beam_width: int, beam_length: int, lookup_beams: int, lookup_length: int | None
) -> BeamConfig:
    """The BeamConfig of the API's and the CLI's separate beam options. lookup_length
    counts only with lookup beams (its default comes with the default's lookup beam)."""
    return BeamConfig(
        beam_width=beam_width,
        beam_length=beam_length,
        lookup_beams=lookup_beams,
        lookup_length=lookup_length if lookup_beams else None,
    )


def _settings(
    tokenizer: Any,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    beam_width: int,
    beam_length: int,
    lookup_beams: int,
    lookup_length: int | None,
    stop: Sequence[str] | str | None,
    drafter: Drafter | None,
    beam: BeamConfig | None,
) -> tuple[BeamConfig, SamplingConfig, StopConfig]:
    beam = beam or beam_config(beam_width, beam_length, lookup_beams, lookup_length)
    if drafter is not None and beam.beam_width > drafter.config.output_size:
        raise ValueError(
            f"beam_width {beam.beam_width} exceeds the drafter's vocabulary of "
            f"{drafter.config.output_size} tokens: use a smaller beam_width"
        )
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    eos = frozenset(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or ()))
    return beam, sampling, StopConfig(max_tokens, eos, stop_strings)


def _peak_memory_gb() -> float:
    return mx.get_peak_memory() / 1e9


class _RowText:
    """Streaming detokenization and stop strings for one request."""

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...]):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop_strings = stop_strings
        self.text = ""  # everything emitted so far
        self.stopped = False

    def add(self, tokens: list[int], final: bool) -> str:
        for token in tokens:
            self.detokenizer.add_token(token)
        if final:
            self.detokenizer.finalize()
        segment = self.detokenizer.last_segment
        if self.stop_strings:
            combined = self.text + segment
            window_start = max(0, len(self.text) - max(map(len, self.stop_strings)))
            hits = [i for s in self.stop_strings if (i := combined.find(s, window_start)) >= 0]
            if hits:
                self.stopped = True
                segment = combined[: min(hits)][len(self.text) :]
        self.text += segment
        return segment


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
    beam_width: int = DEFAULT_BEAM.beam_width,
    beam_length: int = DEFAULT_BEAM.beam_length,
    lookup_beams: int = DEFAULT_BEAM.lookup_beams,
    lookup_length: int | None = DEFAULT_BEAM.lookup_length,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    beam: BeamConfig | None = None,
    cache: CacheConfig | None = None,
) -> Iterator[tuple[int, GenerationResponse]]:
    """Decode several prompts together; yields (prompt index, response) per row and step.

    `beam` (a BeamConfig) overrides beam_width/beam_length/lookup_beams/lookup_length
    when given.
    """
    encoded = [_encode(tokenizer, prompt) for prompt in prompts]
    beam, sampling, stop_config = _settings(
        tokenizer,
        max_tokens,
        temperature,
        top_p,
        top_k,
        beam_width,
        beam_length,
        lookup_beams,
        lookup_length,
        stop,
        drafter,
        beam,
    )
    prepare_target(model)
    vocab_size = model.model.embed_tokens.weight.shape[0]
    _check_inputs(model, drafter, encoded, vocab_size)
    key = mx.random.key(seed if seed is not None else secrets.randbits(32))
    rows = [_RowText(tokenizer, stop_config.stop_strings) for _ in encoded]
    generated = [0] * len(encoded)
    produced = [0] * len(encoded)  # generated, plus a final EOS: the numerator of tau
    steps = [0] * len(encoded)
    decode_seconds = [0.0] * len(encoded)
    stopped_rows: set[int] = set()
    if max_tokens == 0:
        for index, tokens in enumerate(encoded):
            yield (
                index,
                GenerationResponse(
                    "", [], 0, len(tokens), 0, 0, 0.0, 0.0, 0.0, _peak_memory_gb(), "length"
                ),
            )
        return
    events = speculative_decode(
        model, drafter, encoded, beam, sampling, stop_config, cache, key, stopped_rows
    )
    for event in events:
        for position, row in enumerate(event.row_ids):
            new_tokens = event.tokens[position]
            finish_reason = event.finished.get(row)
            text = rows[row].add(new_tokens, final=finish_reason is not None)
            if rows[row].stopped:
                finish_reason = "stop"
                stopped_rows.add(row)
            generated[row] += len(new_tokens)
            produced[row] += event.num_emitted[position]
            steps[row] += 1
            decode_seconds[row] += event.step_seconds
            prompt_tokens = len(encoded[row])
            yield (
                row,
                GenerationResponse(
                    text=text,
                    tokens=new_tokens,
                    num_accepted=event.num_accepted[position],
                    prompt_tokens=prompt_tokens,
                    generation_tokens=generated[row],
                    steps=steps[row],
                    tokens_per_step=produced[row] / steps[row],
                    prompt_tps=prompt_tokens / max(event.prefill_seconds, 1e-9),
                    generation_tps=generated[row] / max(decode_seconds[row], 1e-9),
                    peak_memory=_peak_memory_gb(),
                    finish_reason=finish_reason,
                    tree_size=event.tree_sizes[position],
                ),
            )


class GenerationOptions(TypedDict, total=False):
    """Keyword options shared by every generation function (defaults in `stream_batch`)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    beam_width: int
    beam_length: int
    lookup_beams: int
    lookup_length: int | None
    seed: int | None
    stop: Sequence[str] | str | None
    beam: BeamConfig | None
    cache: CacheConfig | None


def stream_generate(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompt: Prompt,
    **options: Unpack[GenerationOptions],
) -> Iterator[GenerationResponse]:
    """Generate for one prompt, yielding a GenerationResponse per decoding step.

    Options as in `stream_batch` (max_tokens=256, temperature=0.0, top_p=1.0, top_k=0,
    beam_width, beam_length, seed, stop, beam, cache). `drafter=None` decodes plainly
    (one token per target forward) through the same loop. The last response has a
    finish_reason and carries the totals.
    """
    for _, response in stream_batch(model, drafter, tokenizer, [prompt], **options):
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
