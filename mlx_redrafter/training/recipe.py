"""`make-drafter`: the whole drafter recipe for one model, resumable at any moment.

    distill -> train -> n-gram table -> evaluate -> card

Everything lives in the output folder DIR, which ends up a drafter folder:

    DIR/config.json, model.safetensors, ngrams.safetensors, acceptance.json,
        target.json (the model's fingerprint), eval_prompts.jsonl, README.md (the card)
    DIR/work/recipe.json    the recipe, fixed when the run starts (a resumed run reads it)
    DIR/work/state.json     the phases finished so far
    DIR/work/distilled/     the distillation shards (each written whole, then renamed)
    DIR/work/train/         training checkpoints (resumed bit for bit)
    DIR/work/hidden/        the target's hidden states (deleted when the run finishes)
    DIR/work/drafter/       the trained drafter before it is published into DIR

Every file is written to a temporary name and renamed, and a phase is marked finished
only after its outputs are in place, so a run killed at any moment and started again
redoes at most the unfinished part of one phase and ends with the same drafter.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.nn as nn

from ..distill import DistillConfig, balanced_order, distill, load_distilled
from ..drafter import ACCEPTANCE_FILE, Drafter, target_dimensions
from ..files import write_json
from ..prompts import PromptRecord
from .checkpoints import latest_checkpoint
from .config import TrainConfig
from .data import draft_vocabulary, training_sequences
from .loop import new_drafter, train

# The default mix of the built-in prompts (68 % of them are GSM8K): favour chat.
SOURCE_WEIGHTS = {
    "gpteacher-roleplay": 4.0,
    "gsm8k-train": 2.0,
    "self-instruct-seed": 1.0,
    "self-instruct-user-oriented": 1.5,
}
# Draft vocabulary sizes tried in turn; the first that covers `Recipe.coverage` wins.
VOCAB_LADDER = (1024, 2048, 4096, 8192, 16384, 32768)
PHASES = ("distill", "train", "evaluate", "card")
DEFAULT_TRAIN = TrainConfig(
    num_steps=3,
    batch_size=16,
    micro_batch_size=8,
    epochs=3.0,
    learning_rate=2e-3,
    checkpoint_every=25,
)


@dataclass(frozen=True)
class Recipe:
    """What `make-drafter` does; stored in DIR/work/recipe.json when a run starts.

    records: prompts the target answers (distillation); max_tokens: reply length cap.
    draft_vocab: the drafter's output vocabulary (0: the smallest of VOCAB_LADDER that
        covers `coverage` of the training replies' tokens; the full vocabulary if none).
    exit_dim: the drafter's input projection 2D -> E (0: 2D/3, a multiple of 64).
    eval_prompts, eval_max_tokens: the held-out prompts the evaluation decodes.
    rates: what the time-budget probe measured (seconds per record, ...), for the card.
    """

    records: int = 2000
    max_tokens: int = 256
    distill_batch: int = 16
    draft_vocab: int = 0
    coverage: float = 0.97
    exit_dim: int = 0
    num_layers: int = 2
    train: TrainConfig = DEFAULT_TRAIN
    eval_prompts: int = 16
    eval_max_tokens: int = 128
    seed: int = 0
    budget_seconds: float = 0.0
    rates: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        values = dict(data)
        values["train"] = TrainConfig(**values.get("train", {}))
        return cls(**values)


@dataclass(frozen=True)
class Target:
    """The model a drafter is made for: mlx-lm model, tokenizer, and how to name it
    (what the card prints and `make-drafter MODEL` accepts)."""

    model: nn.Module
    tokenizer: Any
    name: str


@dataclass(frozen=True)
class Prompts:
    """The prompt records: `train` in distillation order, `held_out` never distilled."""

    train: list[PromptRecord]
    held_out: list[PromptRecord]
    label: str


@dataclass(frozen=True)
class Run:
    """One make-drafter run: where it writes and how it reports."""

    output: Path
    progress: bool = True
    log: Callable[[str], None] = field(default=lambda message: print(message, file=sys.stderr))

    @property
    def work(self) -> Path:
        return self.output / "work"


# ---------------------------------------------------------------------------
# State of a run


def read_state(run: Run) -> list[str]:
    path = run.work / "state.json"
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("done", []))


def mark_done(run: Run, phase: str) -> None:
    done = read_state(run)
    if phase not in done:
        write_json(run.work / "state.json", {"done": [*done, phase]})


def split_prompts(
    records: Sequence[PromptRecord], eval_prompts: int, seed: int, label: str
) -> Prompts:
    """The balanced distillation order; the held-out prompts are `eval_prompts` records
    evenly spaced over its last quarter, never distilled."""
    order = balanced_order(list(records), SOURCE_WEIGHTS, seed=seed)
    tail = len(order) - max(len(order) // 4, eval_prompts)
    if tail < 1 or eval_prompts < 1:
        raise ValueError(
            f"{len(order)} prompts are too few: make-drafter needs more than "
            f"{eval_prompts} (the held-out evaluation) plus some to distil"
        )
    picks = {tail + i * (len(order) - tail) // eval_prompts for i in range(eval_prompts)}
    held = [order[i] for i in sorted(picks)]
    train_order = [r for i, r in enumerate(order) if i not in picks]
    return Prompts(train_order, held, label)


def stored_recipe(run: Run) -> Recipe | None:
    path = run.work / "recipe.json"
    if not path.is_file():
        return None
    try:
        return Recipe.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as error:
        raise ValueError(
            f"{path} is unreadable ({error}): delete {run.output} and start again"
        ) from None


def check_output(run: Run) -> None:
    """A new run needs an empty or new folder (or one holding only its own work/)."""
    if run.output.exists() and not run.output.is_dir():
        raise FileExistsError(f"{run.output} is a file: --output takes a folder")
    if run.output.exists() and any(p.name != "work" for p in run.output.iterdir()):
        raise FileExistsError(
            f"{run.output} exists and is not a make-drafter run: choose an empty or new folder"
        )


def settle_recipe(run: Run, recipe: Recipe, target: Target) -> Recipe:
    """The stored recipe of a resumed run (refusing another model), else `recipe`, stored."""
    stored = stored_recipe(run)
    marker = run.work / "model.json"
    if stored is not None:
        made_for = json.loads(marker.read_text()).get("model") if marker.is_file() else None
        if made_for is not None and made_for != target.name:
            raise ValueError(
                f"{run.output} holds a make-drafter run for {made_for}, not {target.name}: "
                "use another --output folder"
            )
        return stored
    check_output(run)
    write_json(marker, {"model": target.name})
    write_json(run.work / "recipe.json", recipe.to_dict())
    return recipe


# ---------------------------------------------------------------------------
# Phases


def distill_config(recipe: Recipe, target: Target) -> DistillConfig:
    return DistillConfig(max_tokens=recipe.max_tokens, seed=recipe.seed, model=target.name)


def run_distill(run: Run, recipe: Recipe, target: Target, prompts: Prompts) -> None:
    """Phase 1: the target answers `recipe.records` prompts (greedy, plain decoding)."""
    for _ in distill(
        target.model,
        target.tokenizer,
        prompts.train,
        run.work / "distilled",
        distill_config(recipe, target),
        batch_size=recipe.distill_batch,
        limit=recipe.records,
        progress=run.progress,
    ):
        pass


def choose_vocab_size(
    recipe: Recipe, sequences: Sequence[Any], ids: Sequence[str], full: int
) -> int:
    """`recipe.draft_vocab`, or the smallest ladder size covering `recipe.coverage`
    (0: the full vocabulary of `full` tokens)."""
    if recipe.draft_vocab:
        return recipe.draft_vocab if recipe.draft_vocab < full else 0
    config = recipe.train
    for size in (size for size in VOCAB_LADDER if size < full):
        choice = draft_vocabulary(sequences, ids, size, config.validation_fraction, config.seed)
        if choice.training_coverage >= recipe.coverage:
            return size
    return 0  # nothing covers enough: the full vocabulary


def fresh_drafter(
    recipe: Recipe, target: Target, sequences: Sequence[Any], ids: Sequence[str]
) -> Drafter:
    """The untrained drafter of the recipe (a fixed function of the data and seed)."""
    hidden_size, full_vocab = target_dimensions(target.model)
    exit_dim = recipe.exit_dim or max(64, round(2 * hidden_size / 3 / 64) * 64)
    vocab_size = choose_vocab_size(recipe, sequences, ids, full_vocab)
    vocab_ids = None
    if vocab_size:
        eos = getattr(target.tokenizer, "eos_token_id", None)
        config = recipe.train
        vocab_ids = draft_vocabulary(
            sequences,
            ids,
            vocab_size,
            config.validation_fraction,
            config.seed,
            [eos] if eos is not None else [],
        ).ids
    return new_drafter(
        target.model,
        recipe.train.seed,
        num_layers=recipe.num_layers,
        exit_dim=exit_dim,
        draft_vocab_ids=vocab_ids,
    )


def run_train(run: Run, recipe: Recipe, target: Target) -> dict[str, Any]:
    """Phase 2: train the drafter (resuming its checkpoints), then its n-gram table."""
    from .evaluate import run_summary
    from .export import save_ngrams

    records = load_distilled([run.work / "distilled"])
    sequences, ids = training_sequences(records)
    drafter = fresh_drafter(recipe, target, sequences, ids)
    config = fit_batch(recipe.train, sequences, ids)
    checkpoints = run.work / "train" / "checkpoints"
    started = time.perf_counter()
    report = train(
        target.model,
        drafter,
        sequences,
        ids,
        config,
        checkpoint_dir=checkpoints,
        resume=latest_checkpoint(checkpoints) is not None,
        progress=run.progress,
        log=run.log,
        hidden_cache=run.work / "hidden",
        hidden_cache_tag=target.name,
    )
    summary = run_summary(report, drafter, config, len(sequences), time.perf_counter() - started)
    staging = run.work / "drafter"
    drafter.save(staging, overwrite=True)
    table = save_ngrams(records, config.validation_fraction, config.seed, 2, [staging])
    summary["ngrams"] = {"order": table.order, "entries": table.size}
    summary["data"] = data_summary(records, sequences, ids, drafter, recipe)
    write_json(run.work / "train" / "report.json", summary)
    return summary


def fit_batch(config: TrainConfig, sequences: Sequence[Any], ids: Sequence[str]) -> TrainConfig:
    """`config`, with batches no larger than the training split (a small run's data)."""
    from dataclasses import replace

    from .data import split_rows

    rows = len(split_rows(sequences, ids, config.validation_fraction, config.seed)[0])
    if rows < 1:
        raise ValueError(f"{len(sequences)} distilled records leave nothing to train on")
    if rows >= config.batch_size:
        return config
    micro = min(config.micro_batch_size, rows)
    return replace(config, batch_size=rows // micro * micro, micro_batch_size=micro)


def data_summary(
    records: Sequence[Any],
    sequences: Sequence[Any],
    ids: Sequence[str],
    drafter: Drafter,
    recipe: Recipe,
) -> dict[str, Any]:
    """How much the drafter learnt from, and how much of it its vocabulary covers."""
    from .data import vocab_coverage

    replies = sum(len(r.tokens) - r.prompt_length for r in records)
    summary: dict[str, Any] = {"records": len(records), "reply_tokens": replies}
    if drafter.config.draft_vocab_size is not None:
        vocab_ids = cast(list[int], drafter.draft_vocab_ids.tolist())
        summary["draft_vocab_coverage"] = round(vocab_coverage(sequences, vocab_ids), 4)
    return summary


def run_evaluate(run: Run, recipe: Recipe, target: Target, prompts: Prompts) -> dict[str, Any]:
    """Phase 3: on the held-out prompts, the acceptance table (per depth, stored with
    the drafter for the auto tree), then tau and speed-up against mlx-lm's plain
    decoding with the auto tree (`bench`'s own measurement)."""
    from ..bench import BenchConfig, run_benchmark
    from ..prompts import encode_prompt
    from .evaluate import measure_acceptance

    staging = run.work / "drafter"
    drafter = Drafter.load(staging)
    tokens = [encode_prompt(target.tokenizer, r.messages) for r in prompts.held_out]
    run.log(f"make-drafter: acceptance table over {len(tokens)} held-out prompts")
    table = measure_acceptance(
        target.model,
        drafter,
        tokens,
        max_tokens=recipe.eval_max_tokens,
        source=f"{len(tokens)} held-out prompts x {recipe.eval_max_tokens} tokens",
    )
    write_json(staging / ACCEPTANCE_FILE, table.to_dict())
    drafter.acceptance = table
    run.log("make-drafter: speed against mlx-lm on the held-out prompts (auto tree)")
    config = BenchConfig(
        max_tokens=recipe.eval_max_tokens,
        trees=("auto",),
        unpacked=False,
        profile_prompts=0,
        without_drafter=True,  # the same auto tree with lookup branches alone
    )
    result = run_benchmark(
        target.model,
        drafter,
        target.tokenizer,
        tokens,
        config,
        progress=run.log if run.progress else None,
    )
    keep = ("environment", "calibration", "config", "summary")
    evaluation = {"acceptance": table.to_dict(), "bench": {k: result[k] for k in keep}}
    write_json(run.work / "evaluation.json", evaluation)
    return evaluation


# ---------------------------------------------------------------------------
# Publishing and the whole recipe

DRAFTER_FILES = ("config.json", "model.safetensors", "ngrams.safetensors", "acceptance.json")


def publish(run: Run, target: Target, prompts: Prompts, card: str) -> None:
    """Phase 4: copy the drafter into DIR file by file (each renamed into place), with the
    model's fingerprint, the held-out prompts and, last, the card."""
    from ..fingerprint import target_fingerprint, write_fingerprint

    for name in DRAFTER_FILES:
        source = run.work / "drafter" / name
        if source.is_file():
            temporary = run.output / f".{name}.partial"
            shutil.copyfile(source, temporary)
            os.replace(temporary, run.output / name)
    write_fingerprint(run.output, target_fingerprint(target.model, target.tokenizer))
    lines = [
        json.dumps({"id": r.id, "source": r.source, "messages": r.messages})
        for r in prompts.held_out
    ]
    write_text(run.output / "eval_prompts.jsonl", "\n".join(lines) + "\n")
    write_text(run.output / "README.md", card)


def write_text(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.partial")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def make_drafter(
    target: Target,
    records: Sequence[PromptRecord],
    run: Run,
    recipe: Recipe,
    label: str,
    budget_seconds: float | None = None,
) -> Path:
    """Run (or resume) the recipe; returns DIR, a drafter folder with its card.

    records: the prompt set (the built-in one, or the user's); label names it on the card.
    recipe: used when the run starts; a resumed run keeps the recipe it started with.
    budget_seconds: size the recipe's records and epochs to finish in this time
        (`budget.plan`, measured on this machine when the run starts).
    """
    from .budget import budget_defaults, plan
    from .card import drafter_card

    if budget_seconds is not None and stored_recipe(run) is None:
        check_output(run)
        recipe = budget_defaults(recipe, budget_seconds)
        prompts = split_prompts(records, recipe.eval_prompts, recipe.seed, label)
        run.log(f"make-drafter: measuring this machine to fit {budget_seconds / 60:.0f} min")
        recipe = plan(run, recipe, target, prompts, budget_seconds)
        run.log(f"make-drafter: {recipe.records} records, {recipe.train.epochs:g} epochs")
    recipe = settle_recipe(run, recipe, target)
    prompts = split_prompts(records, recipe.eval_prompts, recipe.seed, label)
    done = read_state(run)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("distill", lambda: run_distill(run, recipe, target, prompts)),
        ("train", lambda: run_train(run, recipe, target)),
        ("evaluate", lambda: run_evaluate(run, recipe, target, prompts)),
        ("card", lambda: publish(run, target, prompts, drafter_card(run, recipe, target, prompts))),
    ]
    for number, (phase, action) in enumerate(steps, 1):
        if phase in done:
            run.log(f"make-drafter: phase {number}/{len(steps)} {phase}: done before")
            continue
        run.log(f"make-drafter: phase {number}/{len(steps)} {phase}")
        action()
        mark_done(run, phase)
    shutil.rmtree(run.work / "hidden", ignore_errors=True)  # large, and recomputable
    return run.output
