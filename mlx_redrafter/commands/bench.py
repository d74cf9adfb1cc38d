"""`mlx-redrafter bench`: ReDrafter against mlx-lm plain decoding, with tables and plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..bench import (
    BenchConfig,
    environment,
    format_table,
    progress_printer,
    run_benchmark,
    slow_blas_warning,
    write_result,
)
from ..config import DEFAULT_TREE, SamplingConfig
from ..distributed import SHARD_MODES, is_main_process
from ..files import write_json
from ..prompts import encode_prompt, read_prompts, select_prompts
from .common import add_benchmark_inputs, load_from_args, parse_trees


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise ValueError(f"--batch-sizes takes numbers like 1,2,4,8; got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise ValueError("--batch-sizes must be >= 1")
    return sizes


def register(commands: Any) -> None:
    """Add the `bench` subcommand to the `mlx-redrafter` parser."""
    bench = commands.add_parser(
        "bench",
        help="measure ReDrafter against mlx-lm plain decoding",
        description="Runs mlx-lm plain decoding, this project's loop without a drafter, and "
        "ReDrafter at each tree (with and without tree packing), interleaved "
        "prompt by prompt in one process after a warm-up; prints a table and writes "
        "bench.json and PNG plots.",
        epilog="example: mlx-redrafter bench --limit 64 --max-tokens 256 --tree 4x4,2x5 "
        "--out runs/bench",
    )
    add_benchmark_inputs(bench, "no drafter: mlx-lm, plain, and lookup-only or auto trees")
    bench.add_argument("--max-tokens", type=int, default=256)
    bench.add_argument(
        "--tree",
        type=parse_trees,
        default=(DEFAULT_TREE,),
        help=f"trees WxL, WxL+G (G lookup branches) or WxL+GxLl (lookup branches of Ll "
        f"tokens), comma-separated (default "
        f"{DEFAULT_TREE}, the default of generation)",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="run every method R times on each prompt, in rounds, and count each "
        "method's fastest run (default 1; 2 or 3 on a shared or noisy machine)",
    )
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--top-k", type=int, default=0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every method decodes exactly --max-tokens tokens: sampled replies (and their "
        "lengths) differ from mlx-lm's, so this compares equal work",
    )
    bench.add_argument(
        "--batch-sizes",
        type=parse_sizes,
        default=(),
        help="batch sweep sizes, e.g. 1,2,4,8 (default: no sweep)",
    )
    bench.add_argument(
        "--no-unpacked", action="store_true", help="skip the runs without tree packing"
    )
    bench.add_argument(
        "--also-no-drafter",
        action="store_true",
        help="also run each tree without the drafter (lookup branches alone), in the same "
        "process: what the drafter adds",
    )
    bench.add_argument(
        "--profile-prompts",
        type=int,
        default=4,
        help="prompts of the separate pass that splits step time (default 4)",
    )
    bench.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    bench.add_argument("--no-plots", action="store_true")
    bench.add_argument(
        "--shard",
        choices=SHARD_MODES,
        help="under mlx.launch: split the model across the ranks; every method, mlx-lm's "
        "included, decodes the sharded model; rank 0 reports",
    )
    bench.add_argument(
        "--second-turns",
        type=int,
        default=None,
        metavar="N",
        help="instead: time to first token of N two-turn conversations' second turns "
        "with and without the prompt cache (plus one warm-up conversation)",
    )
    bench.set_defaults(run=run)


def run_second_turns(args: argparse.Namespace) -> int:
    """`bench --second-turns N`: the prompt cache's time to first token."""
    from ..bench_turns import second_turns
    from ..prompts import read_turns

    if args.second_turns < 1:
        raise ValueError("--second-turns must be >= 1")
    pairs = [(turns[0], turns[1]) for turns in read_turns(args.prompts) if len(turns) >= 2]
    model, drafter, tokenizer = load_from_args(args)
    result = second_turns(
        model,
        drafter,
        tokenizer,
        pairs[: args.second_turns + 1],
        args.max_tokens,
        progress_printer() if is_main_process() else None,
    )
    if not is_main_process():
        return 0
    print(file=sys.stderr)
    print(
        f"{result['conversations']} second turns, {result['max_tokens']} tokens each: "
        f"prompt {result['mean_prompt_tokens']:.0f} tokens, {result['mean_cached_tokens']:.0f} "
        f"from the cache; TTFT {result['mean_ttft_cached'] * 1e3:.0f} ms with the cache, "
        f"{result['mean_ttft_full'] * 1e3:.0f} ms without (ratio {result['ttft_ratio']:.2f}, "
        f"worst {result['worst_ratio']:.2f}); replies identical: {result['all_identical']}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "second_turns.json"
    write_json(path, {"environment": environment(), **result})
    print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.second_turns is not None:
        if args.repeats != 1:
            raise ValueError("--repeats applies to decoding runs, not to --second-turns")
        return run_second_turns(args)
    config = BenchConfig(
        max_tokens=args.max_tokens,
        trees=args.tree,
        sampling=SamplingConfig(args.temperature, args.top_p, args.top_k),
        unpacked=not args.no_unpacked,
        without_drafter=args.also_no_drafter,
        seed=args.seed,
        profile_prompts=args.profile_prompts,
        batch_sizes=args.batch_sizes,
        ignore_eos=args.ignore_eos,
        repeats=args.repeats,
    )
    records = select_prompts(read_prompts(args.prompts), args.per_category, args.limit)
    model, drafter, tokenizer = load_from_args(args)
    prompts = [encode_prompt(tokenizer, record.messages) for record in records]
    categories = [record.source for record in records]
    shown = is_main_process()  # sharded: every rank decodes, rank 0 reports
    progress = progress_printer() if shown else None
    result = run_benchmark(model, drafter, tokenizer, prompts, config, progress, categories)
    if not shown:
        return 0
    print(file=sys.stderr)
    warning = slow_blas_warning(result["environment"])
    if warning:
        print(warning, file=sys.stderr)
    env = result["environment"]
    print(
        f"{len(prompts)} prompts x {config.max_tokens} tokens, {env['device_name']}, "
        f"fp32 matmul {env['matmul_gflops_fp32']} GFLOP/s, "
        f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}"
    )
    print(format_table(result))
    out = Path(args.out)
    path = write_result(result, out)
    print(f"wrote {path}")
    if not args.no_plots:
        from ..bench_plots import write_plots

        for plot in write_plots(result, out):
            print(f"wrote {plot}")
    if warning:
        print(warning, file=sys.stderr)
    return 0
