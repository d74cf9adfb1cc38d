"""`mlx-redrafter chat`: a multi-turn chat in the terminal, streamed, with /stats."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import TreeConfig
from ..decode import plan_step
from .common import describe_tree, load_from_args, parse_tree
from .generate import add_model_arguments, add_tree_argument


def register(commands: Any) -> None:
    """Add the `chat` subcommand to the `mlx-redrafter` parser."""
    chat = commands.add_parser(
        "chat",
        help="chat with the model in the terminal",
        description="Multi-turn chat with the model's chat template, streamed token by "
        "token. Commands: /reset, /stats (tau, tokens/s, speed-up of the last reply), "
        "/help, /quit. Ctrl-C stops the current reply.",
        epilog="example: mlx-redrafter chat --show-drafts",
    )
    add_model_arguments(chat)
    chat.add_argument("--system", default=None, help="a system message opening the chat")
    chat.add_argument("--max-tokens", type=int, default=512, help="longest reply (tokens)")
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--top-k", type=int, default=0)
    add_tree_argument(chat)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    chat.add_argument(
        "--show-drafts",
        action="store_true",
        help="colour the text of drafted tokens the target accepted (green)",
    )
    chat.add_argument(
        "--drop-oldest",
        action="store_true",
        help="when a turn does not fit the model's context, drop the oldest turns "
        "(by default the turn is refused with a message)",
    )
    chat.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from mlx_redrafter.apps.chat import DRAFTED, RESET, ChatSession, run_chat, terminal_input

    tree = parse_tree(args.tree)
    model, drafter, tokenizer = load_from_args(args)
    session = ChatSession(
        model,
        drafter,
        tokenizer,
        tree=tree,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        system=args.system,
        show_drafts=args.show_drafts,
        drop_oldest=args.drop_oldest,
    )
    plain = isinstance(tree, TreeConfig) and plan_step(tree, drafter is not None).plain
    mode = describe_tree(drafter, tree)
    print(f"chat ({mode}); /help lists the commands, /quit leaves", file=sys.stderr)
    if args.show_drafts and not plain:
        print(f"{DRAFTED}green{RESET}: text from drafted tokens the target accepted")
    return run_chat(session, read=terminal_input if sys.stdin.isatty() else input)
