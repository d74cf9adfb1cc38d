"""Sizing `make-drafter` to a time budget from a short measurement of this machine.

The probe runs the recipe's own code on a small scale and keeps what it makes: the
first distillation batch (seconds per record and reply length), the target's hidden
states of those records and two training steps (hidden-state seconds per record and
training positions per second), and a short plain decode (tokens per second, which
prices the evaluation). The recipe then takes as many records as fit in what is left:

    records = remaining / (distill + hidden + epochs x train seconds per record)

and, when the prompt set runs out first, trains more epochs (at most MAX_EPOCHS).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

from ..config import PLAIN_DECODING
from ..distill import load_distilled
from ..drafter import target_dimensions
from ..files import write_json
from ..prompts import encode_prompt
from .data import training_sequences
from .evaluate import measure_tau
from .loop import train
from .recipe import Prompts, Recipe, Run, Target, fresh_drafter, run_distill

MAX_EPOCHS = 6.0
# The share of the remaining budget planned for work (the rest absorbs estimate error).
SAFETY = 0.85
# Calibrating the auto tree for a new drafter costs about this many plain tokens' time.
CALIBRATION_TOKENS = 1500
# Decodes per held-out prompt in the evaluation: the acceptance table's wide tree
# (about two plain decodes), its shorter beam lengths (about one and a half each) and
# its lookup branches alone (about one), then mlx-lm, plain, and the auto tree
# without and with the drafter.
EVAL_DECODES = 13


def parse_duration(text: str) -> float:
    """'30m', '4h', '1h30m', '90s' or plain seconds -> seconds."""
    cleaned = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", cleaned):
        return float(cleaned)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", cleaned)
    if not parts or "".join(n + u for n, u in parts) != cleaned:
        raise ValueError(f"--time-budget: {text!r} is not a duration like 30m, 4h or 1h30m")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0}
    return sum(float(number) * scale[unit] for number, unit in parts)


def budget_defaults(recipe: Recipe, seconds: float) -> Recipe:
    """Evaluation sizes that fit the budget (fixed before the prompts are split)."""
    if seconds < 1800:
        return replace(recipe, eval_prompts=8, eval_max_tokens=64)
    return recipe


def plan(run: Run, recipe: Recipe, target: Target, prompts: Prompts, seconds: float) -> Recipe:
    """The recipe sized to finish within `seconds` of now (the probe included)."""
    started = time.perf_counter()
    rates = probe_rates(run, recipe, target, prompts)
    evaluation = (
        recipe.eval_prompts * recipe.eval_max_tokens * EVAL_DECODES + CALIBRATION_TOKENS
    ) / max(rates["plain_tokens_per_s"], 1e-9)
    rates["evaluation_s"] = evaluation
    remaining = (seconds - (time.perf_counter() - started) - evaluation) * SAFETY
    train_seconds = rates["train_s_per_record_epoch"]
    per_record = rates["distill_s_per_record"] + rates["hidden_s_per_record"]
    probe = min(recipe.distill_batch, len(prompts.train))
    count = remaining / (per_record + recipe.train.epochs * train_seconds)
    count = int(min(max(count, probe), len(prompts.train)))
    epochs = recipe.train.epochs
    if count == len(prompts.train):
        spare = remaining - count * per_record
        epochs = min(MAX_EPOCHS, max(epochs, spare / (count * train_seconds)))
    return replace(
        recipe,
        records=count,
        train=replace(recipe.train, epochs=round(epochs, 2)),
        budget_seconds=seconds,
        rates={k: round(v, 4) for k, v in rates.items()},
    )


def probe_rates(run: Run, recipe: Recipe, target: Target, prompts: Prompts) -> dict[str, float]:
    """Seconds per record of distillation, hidden states and a training epoch, and plain
    tokens per second. The first two are kept in work/probe.json as soon as measured: a
    probe interrupted and run again must not time its own cached work (it looks free)."""
    path = run.work / "probe.json"
    rates: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}
    if "distill_s_per_record" not in rates:
        probe = min(recipe.distill_batch, len(prompts.train))
        clock = time.perf_counter()
        run_distill(run, replace(recipe, records=probe), target, prompts)
        rates["distill_s_per_record"] = (time.perf_counter() - clock) / probe
        write_json(path, rates)
    if "hidden_s_per_record" not in rates:  # (a second time, the hidden states are cached)
        rates.update(training_rates(run, recipe, target))
        write_json(path, rates)
    prompt = encode_prompt(target.tokenizer, prompts.held_out[0].messages)
    for tokens in (8, 32):  # the first decode pays one-off costs; time the second
        plain = measure_tau(
            target.model, None, target.tokenizer, [prompt], tree=PLAIN_DECODING, max_tokens=tokens
        )
    rates["plain_tokens_per_s"] = plain.tokens_per_second
    return rates


def training_rates(run: Run, recipe: Recipe, target: Target) -> dict[str, float]:
    """Hidden-state seconds per record and training seconds per record and epoch,
    from the probe's records and two optimizer steps of a throwaway drafter."""
    records = load_distilled([run.work / "distilled"])
    sequences, ids = training_sequences(records)
    reply = sum(len(s.tokens) - s.prompt_length for s in sequences) / len(sequences)
    # The head's cost depends on the draft vocabulary: price the recipe's usual size.
    vocab = min(recipe.draft_vocab or 8192, target_dimensions(target.model)[1])
    drafter = fresh_drafter(replace(recipe, draft_vocab=vocab), target, sequences, ids)
    config = replace(recipe.train, validation_fraction=0.0, checkpoint_every=0)
    report = train(
        target.model,
        drafter,
        sequences,
        ids,
        config,
        progress=False,
        log=lambda _: None,
        max_steps=2,
        hidden_cache=run.work / "hidden",
        hidden_cache_tag=target.name,
    )
    return {
        "hidden_s_per_record": report.hidden_seconds / len(sequences),
        "train_s_per_record_epoch": reply / max(report.tokens_per_second, 1e-9),
    }
