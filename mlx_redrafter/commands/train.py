"""`mlx-redrafter train`: train a drafter on distilled data, the target frozen."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..config import PLAIN_DECODING
from ..distill import load_distilled
from ..drafter import Drafter
from ..generate import DEFAULT_BEAM
from ..loading import NoShippedDrafterWarning, load, load_drafter
from ..ngrams import build_ngram_table, save_ngram_table
from ..prompts import encode_prompt, read_prompts
from ..train import (
    TrainConfig,
    TrainingSequence,
    choose_draft_vocab,
    compute_hidden,
    make_window,
    measure_tau,
    split_validation,
    train,
    validate,
    vocab_coverage,
)
from .common import parse_beams
from .ngrams import training_replies


def register(commands: Any) -> None:
    """Add the `train` subcommand to the `mlx-redrafter` parser."""
    parser = commands.add_parser(
        "train",
        help="train a drafter on data from `mlx-redrafter distill`",
        description="Train a drafter (the target frozen) on distilled shards, with "
        "checkpoints, --resume, a validation split and a final tau report. Run under "
        "`mlx.launch` for data-parallel training.",
        epilog="example: mlx-redrafter train --data data/distilled --output runs/drafter",
    )
    parser.add_argument("--data", action="append", help="distilled folder(s)")
    parser.add_argument("--output", help="run folder: checkpoints/, drafter/, report.json")
    parser.add_argument("--model", help="MLX model folder or Hub id (default: embedded SmolLM2)")
    parser.add_argument("--init-drafter", help="start from this drafter instead of a new one")
    parser.add_argument("--export", help="also write the final drafter to this folder")
    parser.add_argument(
        "--export-dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="dtype of the exported weights (smaller files; cast back to float32 at load)",
    )
    parser.add_argument(
        "--ngram-order",
        type=int,
        default=2,
        help="store the n-gram table of the training replies (n <= this) with the drafter, "
        "for lookup beams (as `mlx-redrafter ngrams`; 0: none)",
    )
    arch = parser.add_argument_group("drafter architecture (new drafters)")
    arch.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="predict only the N most frequent completion tokens (0: the whole vocabulary)",
    )
    arch.add_argument("--exit-dim", type=int, default=None, help="head width (default 2 x hidden)")
    arch.add_argument("--num-layers", type=int, default=2, help="residual blocks")
    arch.add_argument("--no-rnn", action="store_true", help="running-sum recurrence")
    opt = parser.add_argument_group("optimisation")
    defaults = TrainConfig()
    opt.add_argument(
        "--num-steps",
        type=int,
        default=defaults.num_steps,
        help="draft steps per position, L-1 (train with the longest beam you will use)",
    )
    opt.add_argument("--batch-size", type=int, default=defaults.batch_size)
    opt.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size)
    opt.add_argument("--epochs", type=float, default=defaults.epochs)
    opt.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    opt.add_argument("--warmup", type=float, default=defaults.warmup, help="fraction of steps")
    opt.add_argument("--final-lr-fraction", type=float, default=defaults.final_lr_fraction)
    opt.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    opt.add_argument("--grad-clip", type=float, default=defaults.grad_clip)
    opt.add_argument(
        "--kl-weight",
        type=float,
        default=defaults.kl_weight,
        help="0: cross-entropy on the target's tokens; 1: KL to the target's distribution",
    )
    opt.add_argument(
        "--soft-top-k",
        type=int,
        default=defaults.soft_top_k,
        help="with --kl-weight: keep the target's distribution over its k most likely draft "
        "tokens per position (0: all; the full distribution costs ~50%% more per step)",
    )
    opt.add_argument("--validation-fraction", type=float, default=defaults.validation_fraction)
    opt.add_argument("--eval-every", type=int, default=defaults.eval_every)
    opt.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    opt.add_argument("--seed", type=int, default=defaults.seed)
    opt.add_argument("--max-steps", type=int, default=None, help="stop early (resumable)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    report = parser.add_argument_group("final report")
    report.add_argument(
        "--tau-prompts",
        type=int,
        default=8,
        help="prompts decoded for tau (0: skip; with --tau-file: 0 means all, N takes N "
        "evenly spaced prompts)",
    )
    report.add_argument("--tau-max-tokens", type=int, default=128)
    report.add_argument(
        "--tau-beams",
        default=DEFAULT_BEAM.label,
        help="beam shapes as in `bench --beams` (WxL, WxL+GxLl, ...), comma-separated "
        f"(1x1: plain; default {DEFAULT_BEAM.label}, the default of generation)",
    )
    report.add_argument(
        "--tau-file", help="decode these JSONL prompts (chat template) instead of held-out ones"
    )
    report.add_argument(
        "--tau-batch-size",
        type=int,
        default=1,
        help="1: stream_generate per prompt; more: decode prompts together (same tau)",
    )
    report.add_argument(
        "--evaluate-only",
        action="store_true",
        help="no training: measure --init-drafter's accuracy on the validation split of "
        "--data and/or its tau on --tau-file",
    )
    report.add_argument("--strict", action="store_true", help="fail on a bad --tau-file line")
    parser.add_argument(
        "--hidden-cache",
        help="folder that keeps the target's hidden states between runs (float16)",
    )
    parser.add_argument(
        "--precompute-hidden",
        action="store_true",
        help="only fill --hidden-cache for all the data, then exit",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        num_steps=args.num_steps,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        epochs=args.epochs,
        learning_rate=args.learning_rate,
        warmup=args.warmup,
        final_lr_fraction=args.final_lr_fraction,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        kl_weight=args.kl_weight,
        soft_top_k=args.soft_top_k,
        validation_fraction=args.validation_fraction,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
    )


def _tau_prompts(args: argparse.Namespace, tokenizer: Any, held_out: list[list[int]]) -> tuple:
    if args.tau_file:
        records = read_prompts(args.tau_file, strict=args.strict)
        prompts = [encode_prompt(tokenizer, r.messages, True) for r in records]
        if args.tau_prompts and args.tau_prompts < len(prompts):
            # Evenly spaced, so a subset spans every category of a sorted file.
            count = args.tau_prompts
            prompts = [prompts[i * len(prompts) // count] for i in range(count)]
        return prompts, args.tau_file
    return [p for p in held_out if p][: args.tau_prompts], "held-out prompts"


def _tau_report(
    args: argparse.Namespace,
    model: Any,
    drafter: Drafter,
    tokenizer: Any,
    prompts: list[list[int]],
    label: str,
) -> list[dict[str, Any]]:
    taus = []
    for beam in parse_beams(args.tau_beams, "--tau-beams"):
        plain = beam == PLAIN_DECODING
        tau = measure_tau(
            model,
            None if plain else drafter,
            tokenizer,
            prompts,
            beam=beam,
            max_tokens=args.tau_max_tokens,
            batch_size=args.tau_batch_size,
        )
        taus.append({"beams": beam.label, **asdict(tau)})
        mode = "plain decoding" if plain else beam.label
        print(
            f"tau {mode}: {tau.tau:.3f} tokens/step over {tau.prompts} prompts of {label} "
            f"({tau.tokens} tokens, {tau.steps} target steps; {tau.tokens_per_second:.1f} "
            f"tokens/s per request at batch {args.tau_batch_size})",
            file=sys.stderr,
        )
    return taus


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    parse_beams(args.tau_beams, "--tau-beams")  # check early
    if args.ngram_order < 0:
        raise ValueError("--ngram-order must be >= 0 (0: no n-gram table)")
    group = mx.distributed.init()
    rank = group.rank()
    distributed = group if group.size() > 1 else None
    if args.evaluate_only:
        return _evaluate_only(args)
    if not args.data:
        raise ValueError("--data is required: a folder written by `mlx-redrafter distill`")
    records = load_distilled(args.data)
    sequences = [TrainingSequence(r.tokens, r.prompt_length) for r in records]
    ids = [r.id for r in records]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoShippedDrafterWarning)
        model, _, tokenizer = load(args.model, None)
    cache_tag = str(args.model or "default")
    if args.precompute_hidden:
        if not args.hidden_cache:
            raise ValueError("--precompute-hidden needs --hidden-cache")
        compute_hidden(
            model,
            sequences,
            [make_window(s) for s in sequences],
            progress=not args.quiet,
            cache_dir=args.hidden_cache,
            cache_tag=cache_tag,
        )
        return 0
    if not args.output:
        raise ValueError("--output is required (the run folder)")
    output = Path(args.output)
    checkpoints = output / "checkpoints"
    if args.init_drafter:
        drafter = load_drafter(args.init_drafter)
        drafter.check_fits(model)
    else:
        vocab_ids = None
        if args.draft_vocab:
            held = split_validation(ids, config.validation_fraction, config.seed)
            training = [s for s, h in zip(sequences, held) if not h]
            eos = getattr(tokenizer, "eos_token_id", None)
            vocab_ids = choose_draft_vocab(training, args.draft_vocab, [eos] if eos else [])
            if rank == 0:
                heldout = [s for s, h in zip(sequences, held) if h]
                print(
                    f"draft vocabulary: {len(vocab_ids)} tokens cover "
                    f"{vocab_coverage(training, vocab_ids):.2%} of the training completions, "
                    f"{vocab_coverage(heldout, vocab_ids):.2%} of the held-out ones",
                    file=sys.stderr,
                )
        mx.random.seed(config.seed)
        drafter = Drafter.create(
            model,
            num_draft_layers=args.num_layers,
            rnn=not args.no_rnn,
            exit_dim=args.exit_dim,
            draft_vocab_ids=vocab_ids,
        )
    if not args.resume and (checkpoints / "LATEST").exists():
        raise FileExistsError(
            f"{checkpoints} already holds a checkpoint: pass --resume to continue it, "
            "or choose another --output"
        )
    started = time.perf_counter()
    result = train(
        model,
        drafter,
        sequences,
        ids,
        config,
        checkpoint_dir=checkpoints,
        resume=args.resume,
        group=distributed,
        progress=not args.quiet,
        max_steps=args.max_steps,
        hidden_cache=args.hidden_cache,
        hidden_cache_tag=cache_tag,
    )
    if rank != 0:
        return 0
    wall = time.perf_counter() - started
    summary: dict[str, Any] = {
        "steps": result.steps,
        "total_steps": result.total_steps,
        "drafter": drafter.config.to_dict(),
        "train": {
            "config": asdict(config),
            "sequences": len(sequences),
            "hidden_seconds": round(result.hidden_seconds, 1),
            "train_seconds": round(result.seconds, 1),
            "wall_seconds": round(wall, 1),
            "positions_per_second": round(result.tokens_per_second, 1),
        },
        "validation": result.validation,  # every evaluation, step 0 first
    }
    print(
        f"trained {result.steps}/{result.total_steps} steps in {result.seconds:.0f} s "
        f"({result.tokens_per_second:.0f} positions/s; target hidden states "
        f"{result.hidden_seconds:.0f} s; wall {wall:.0f} s)",
        file=sys.stderr,
    )
    if result.validation:
        last = result.validation[-1]
        print(f"validation (step {last['step']}): {_validation_text(last)}", file=sys.stderr)
    drafter.save(output / "drafter", overwrite=True)
    if args.export:
        _export(drafter, args.export, args.export_dtype)
        print(f"exported the drafter to {args.export} ({args.export_dtype})", file=sys.stderr)
    if args.ngram_order:
        # The lookup beams' n-gram table of the same training replies (`mlx-redrafter ngrams`).
        replies = training_replies(records, config.validation_fraction, config.seed)
        table = build_ngram_table(replies, order=args.ngram_order)
        for folder in [output / "drafter"] + ([Path(args.export)] if args.export else []):
            save_ngram_table(table, folder)
        summary["ngrams"] = {"order": table.order, "entries": table.size}
        print(f"n-gram table: {table.size} entries (n <= {table.order})", file=sys.stderr)
    if args.tau_prompts and result.steps >= result.total_steps:
        held = split_validation(ids, config.validation_fraction, config.seed)
        held_out = [s.tokens[: s.prompt_length] for s, h in zip(sequences, held) if h]
        prompts, label = _tau_prompts(args, tokenizer, held_out)
        saved = Drafter.load(output / "drafter")  # what was written, n-gram table included
        summary["tau"] = _tau_report(args, model, saved, tokenizer, prompts, label)
    (output / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _validation_text(metrics: dict[str, Any]) -> str:
    accuracy = " ".join(f"{i + 1}:{a:.3f}" for i, a in enumerate(metrics["accuracy"]))
    return f"loss {metrics['loss']:.3f}, top-1 accuracy per draft step {accuracy}"


def _evaluate_only(args: argparse.Namespace) -> int:
    if not args.tau_file and not args.data:
        raise ValueError(
            "--evaluate-only needs --tau-file (a JSONL of prompts to decode) and/or --data "
            "(distilled folders: accuracy on their validation split)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoShippedDrafterWarning)
        model, drafter, tokenizer = load(args.model, args.init_drafter)
    if drafter is None:
        raise ValueError("--evaluate-only needs a drafter: pass --init-drafter <folder>")
    result: dict[str, Any] = {}
    if args.data:
        records = load_distilled(args.data)
        metrics = validate(
            model,
            drafter,
            [TrainingSequence(r.tokens, r.prompt_length) for r in records],
            [r.id for r in records],
            _config(args),
            progress=not args.quiet,
            hidden_cache=args.hidden_cache,
            hidden_cache_tag=str(args.model or "default"),
        )
        result["validation"] = metrics
        print(
            f"validation ({metrics['positions']} positions): {_validation_text(metrics)}",
            file=sys.stderr,
        )
    if args.tau_file:
        prompts, label = _tau_prompts(args, tokenizer, [])
        result["tau"] = _tau_report(args, model, drafter, tokenizer, prompts, label)
    if args.output:
        Path(args.output).mkdir(parents=True, exist_ok=True)
        (Path(args.output) / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _export(drafter: Drafter, path: str, dtype_name: str) -> None:
    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype_name]
    if dtype == mx.float32:
        drafter.save(path, overwrite=True)
        return
    drafter.set_dtype(dtype)
    try:
        drafter.save(path, overwrite=True)
    finally:
        drafter.set_dtype(mx.float32)
