"""`mlx-redrafter train`: train a drafter on distilled data, the target frozen.

This module reads the options and prints; every step of the pipeline (the draft
vocabulary, training, export, the n-gram table, the tau report, evaluation) is a
function of `mlx_redrafter.training`.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..config import DEFAULT_TREE, PLAIN_DECODING, TreeConfig, tree_label
from ..distill import DistilledSequence, load_distilled
from ..drafter import Drafter
from ..loading import NoShippedDrafterWarning, load, load_drafter
from ..training import (
    EXPORT_DTYPES,
    TrainConfig,
    TrainingSequence,
    TrainReport,
    draft_vocabulary,
    export_drafter,
    held_out_prompts,
    measure_trees,
    new_drafter,
    refuse_to_overwrite,
    run_summary,
    save_ngrams,
    tau_prompts,
    train,
    training_sequences,
    validate,
    windows_with_hidden,
    write_json,
)
from .common import parse_trees


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
        choices=list(EXPORT_DTYPES),
        default="float32",
        help="dtype of the exported weights (smaller files; cast back to float32 at load)",
    )
    parser.add_argument(
        "--ngram-order",
        type=int,
        default=2,
        help="store the n-gram table of the training replies (n <= this) with the drafter, "
        "for lookup branches (as `mlx-redrafter ngrams`; 0: none)",
    )
    _add_architecture(parser.add_argument_group("drafter architecture (new drafters)"))
    _add_optimisation(parser.add_argument_group("optimisation"))
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    _add_report(parser.add_argument_group("final report"))
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


def _add_architecture(arch: Any) -> None:
    arch.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="predict only the N most frequent completion tokens (0: the whole vocabulary)",
    )
    arch.add_argument("--exit-dim", type=int, default=None, help="head width (default 2 x hidden)")
    arch.add_argument("--num-layers", type=int, default=2, help="residual blocks")
    arch.add_argument("--no-rnn", action="store_true", help="running-sum recurrence")


def _add_optimisation(opt: Any) -> None:
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


def _add_report(report: Any) -> None:
    report.add_argument(
        "--tau-prompts",
        type=int,
        default=8,
        help="prompts decoded for tau (0: skip; with --tau-file: 0 means all, N takes N "
        "evenly spaced prompts)",
    )
    report.add_argument("--tau-max-tokens", type=int, default=128)
    report.add_argument(
        "--tau-trees",
        default=DEFAULT_TREE,
        help="trees as in `bench --tree` (WxL, WxL+GxLl, ...), comma-separated "
        f"(1x1: plain; default {DEFAULT_TREE}, the default of generation)",
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


def _load(model: str | None, drafter: str | None = None) -> tuple[Any, Drafter | None, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoShippedDrafterWarning)
        return load(model, drafter)


def _drafter(
    args: argparse.Namespace,
    config: TrainConfig,
    model: Any,
    tokenizer: Any,
    sequences: list[TrainingSequence],
    ids: list[str],
    rank: int,
) -> Drafter:
    """--init-drafter, or a new drafter (on a draft vocabulary chosen from the data)."""
    if args.init_drafter:
        drafter = load_drafter(args.init_drafter)
        drafter.check_fits(model)
        drafter.acceptance = None  # measured for the old weights: measure the new ones again
        drafter.sampled_acceptance = None
        return drafter
    vocab_ids = None
    if args.draft_vocab:
        eos = getattr(tokenizer, "eos_token_id", None)
        vocab = draft_vocabulary(
            sequences,
            ids,
            args.draft_vocab,
            config.validation_fraction,
            config.seed,
            [eos] if eos else [],
        )
        vocab_ids = vocab.ids
        if rank == 0:
            print(
                f"draft vocabulary: {len(vocab.ids)} tokens cover "
                f"{vocab.training_coverage:.2%} of the training completions, "
                f"{vocab.held_out_coverage:.2%} of the held-out ones",
                file=sys.stderr,
            )
    return new_drafter(
        model,
        config.seed,
        num_layers=args.num_layers,
        rnn=not args.no_rnn,
        exit_dim=args.exit_dim,
        draft_vocab_ids=vocab_ids,
    )


def _tau_report(
    args: argparse.Namespace,
    trees: tuple[TreeConfig | str, ...],
    model: Any,
    drafter: Drafter,
    tokenizer: Any,
    prompts: list[list[int]],
    label: str,
) -> list[dict[str, Any]]:
    taus = []
    batch_size = args.tau_batch_size
    for tree, tau in measure_trees(
        model,
        drafter,
        tokenizer,
        prompts,
        trees,
        max_tokens=args.tau_max_tokens,
        batch_size=batch_size,
    ):
        taus.append({"tree": tree_label(tree), **asdict(tau)})
        mode = "plain decoding" if tree == PLAIN_DECODING else tree_label(tree)
        print(
            f"tau {mode}: {tau.tau:.3f} tokens/step over {tau.prompts} prompts of {label} "
            f"({tau.tokens} tokens, {tau.steps} target steps; {tau.tokens_per_second:.1f} "
            f"tokens/s per request at batch {batch_size})",
            file=sys.stderr,
        )
    return taus


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    trees = parse_trees(args.tau_trees, "--tau-trees")  # check early
    if args.ngram_order < 0:
        raise ValueError("--ngram-order must be >= 0 (0: no n-gram table)")
    group = mx.distributed.init()
    if args.evaluate_only:
        return _evaluate_only(args, config, trees)
    if not args.data:
        raise ValueError("--data is required: a folder written by `mlx-redrafter distill`")
    records = load_distilled(args.data)
    sequences, ids = training_sequences(records)
    model, _, tokenizer = _load(args.model)
    cache_tag = str(args.model or "default")
    if args.precompute_hidden:
        if not args.hidden_cache:
            raise ValueError("--precompute-hidden needs --hidden-cache")
        windows_with_hidden(
            model,
            sequences,
            range(len(sequences)),
            progress=not args.quiet,
            cache_dir=args.hidden_cache,
            cache_tag=cache_tag,
        )
        return 0
    if not args.output:
        raise ValueError("--output is required (the run folder)")
    output = Path(args.output)
    drafter = _drafter(args, config, model, tokenizer, sequences, ids, group.rank())
    refuse_to_overwrite(output / "checkpoints", args.resume)
    started = time.perf_counter()
    result = train(
        model,
        drafter,
        sequences,
        ids,
        config,
        checkpoint_dir=output / "checkpoints",
        resume=args.resume,
        group=group if group.size() > 1 else None,
        progress=not args.quiet,
        max_steps=args.max_steps,
        hidden_cache=args.hidden_cache,
        hidden_cache_tag=cache_tag,
    )
    if group.rank() != 0:
        return 0
    wall = time.perf_counter() - started
    summary = run_summary(result, drafter, config, len(sequences), wall)
    _print_run(result, wall)
    _save(args, config, drafter, records, summary)
    if args.tau_prompts and result.steps >= result.total_steps:
        held_out = held_out_prompts(sequences, ids, config.validation_fraction, config.seed)
        prompts, label = _tau_prompts(args, tokenizer, held_out)
        saved = Drafter.load(output / "drafter")  # what was written, n-gram table included
        summary["tau"] = _tau_report(args, trees, model, saved, tokenizer, prompts, label)
    write_json(output / "report.json", summary)
    return 0


def _print_run(result: TrainReport, wall: float) -> None:
    print(
        f"trained {result.steps}/{result.total_steps} steps in {result.seconds:.0f} s "
        f"({result.tokens_per_second:.0f} positions/s; target hidden states "
        f"{result.hidden_seconds:.0f} s; wall {wall:.0f} s)",
        file=sys.stderr,
    )
    if result.validation:
        last = result.validation[-1]
        print(f"validation (step {last['step']}): {_validation_text(last)}", file=sys.stderr)


def _save(
    args: argparse.Namespace,
    config: TrainConfig,
    drafter: Drafter,
    records: list[DistilledSequence],
    summary: dict[str, Any],
) -> None:
    """The drafter into the run folder, --export, and the n-gram table beside both."""
    folders = [Path(args.output) / "drafter"]
    drafter.save(folders[0], overwrite=True)
    if args.export:
        export_drafter(drafter, args.export, args.export_dtype)
        folders.append(Path(args.export))
        print(f"exported the drafter to {args.export} ({args.export_dtype})", file=sys.stderr)
    if args.ngram_order:
        # The lookup branches' n-gram table of the same training replies (`mlx-redrafter ngrams`).
        table = save_ngrams(
            records, config.validation_fraction, config.seed, args.ngram_order, folders
        )
        summary["ngrams"] = {"order": table.order, "entries": table.size}
        print(f"n-gram table: {table.size} entries (n <= {table.order})", file=sys.stderr)


def _tau_prompts(
    args: argparse.Namespace, tokenizer: Any, held_out: list[list[int]]
) -> tuple[list[list[int]], str]:
    return tau_prompts(
        tokenizer, held_out, path=args.tau_file, count=args.tau_prompts, strict=args.strict
    )


def _validation_text(metrics: dict[str, Any]) -> str:
    accuracy = " ".join(f"{i + 1}:{a:.3f}" for i, a in enumerate(metrics["accuracy"]))
    return f"loss {metrics['loss']:.3f}, top-1 accuracy per draft step {accuracy}"


def _evaluate_only(
    args: argparse.Namespace, config: TrainConfig, trees: tuple[TreeConfig | str, ...]
) -> int:
    if not args.tau_file and not args.data:
        raise ValueError(
            "--evaluate-only needs --tau-file (a JSONL of prompts to decode) and/or --data "
            "(distilled folders: accuracy on their validation split)"
        )
    model, drafter, tokenizer = _load(args.model, args.init_drafter)
    if drafter is None:
        raise ValueError("--evaluate-only needs a drafter: pass --init-drafter <folder>")
    result: dict[str, Any] = {}
    if args.data:
        sequences, ids = training_sequences(load_distilled(args.data))
        metrics = validate(
            model,
            drafter,
            sequences,
            ids,
            config,
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
        result["tau"] = _tau_report(args, trees, model, drafter, tokenizer, prompts, label)
    if args.output:
        write_json(Path(args.output) / "evaluation.json", result)
    return 0
