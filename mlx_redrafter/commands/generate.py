"""`mlx-redrafter generate`: one prompt, streamed, with tau and speed."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..config import DEFAULT_TREE
from ..distributed import SHARD_MODES, is_main_process
from ..generate import format_summary, stream_generate
from ..prompts import chat_tokens
from .common import describe_tree, load_from_args, parse_tree

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="MLX model folder or Hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--drafter",
        help="drafter folder or Hub id (default: the shipped drafter of the default model)",
    )
    parser.add_argument(
        "--no-drafter",
        action="store_true",
        help="decode without a drafter (lookup branches from the text, or plainly)",
    )


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    add_tree_argument(parser)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def add_tree_argument(parser: argparse.ArgumentParser) -> None:
    """--tree, the tree of each step (read with `common.parse_tree`)."""
    parser.add_argument(
        "--tree",
        default=DEFAULT_TREE,
        help="the tree: WxL (W drafter beams of L tokens), WxL+GxLl (and G lookup branches "
        "of Ll tokens from the text or the drafter's n-gram table; ':text' after it: "
        "the text only), e.g. 2x2, 1x3+1x7, 0x5+1:text (no drafter needed); "
        f"default {DEFAULT_TREE}",
    )


def register(commands: Any) -> None:
    """Add the `generate` subcommand to the `mlx-redrafter` parser."""
    gen = commands.add_parser(
        "generate",
        help="generate a reply to one prompt",
        description="Generate a reply, streamed, then print tau (tokens per target step) "
        "and speed.",
        epilog="example: mlx-redrafter generate --prompt 'Write a haiku about the sea.'",
    )
    add_model_arguments(gen)
    gen.add_argument("--prompt", "-p", default=DEFAULT_PROMPT)
    gen.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send the prompt as raw text instead of a chat turn",
    )
    add_generation_arguments(gen)
    gen.add_argument(
        "--shard",
        choices=SHARD_MODES,
        help="under mlx.launch: split the model across the ranks (tensor or pipeline "
        "parallel, mlx-lm's sharding); rank 0 prints",
    )
    gen.set_defaults(run=run)


def _chat_prompt(tokenizer: object, prompt: str, use_template: bool) -> str | list[int]:
    """The prompt as one user turn of the chat template, or as raw text."""
    if not use_template or not getattr(tokenizer, "chat_template", None):
        return prompt
    return chat_tokens(tokenizer, [{"role": "user", "content": prompt}])


def run(args: argparse.Namespace) -> int:
    tree = parse_tree(args.tree)
    model, drafter, tokenizer = load_from_args(args)
    prompt = _chat_prompt(tokenizer, args.prompt, not args.no_chat_template)
    started = time.perf_counter()
    last = None
    shown = is_main_process()  # sharded: every rank decodes, rank 0 prints
    for response in stream_generate(
        model,
        drafter,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        tree=tree,
    ):
        if shown:
            print(response.text, end="", flush=True)
        last = response
    if not shown:
        return 0
    print()
    if last is not None:
        summary = format_summary(last, time.perf_counter() - started)
        print(f"==========\n{describe_tree(drafter, tree)}\n{summary}", file=sys.stderr)
    return 0
