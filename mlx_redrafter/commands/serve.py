"""`mlx-redrafter serve`: an OpenAI-compatible server with continuous batching, and a chat
page at `/`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..config import DEFAULT_TREE
from ..policy import SpeedGuard, TreePolicy
from .common import load_from_args
from .generate import add_model_arguments

SERVE_EXTRA = "pip install 'mlx-redrafter[serve]'  (starlette and uvicorn)"


def register(commands: Any) -> None:
    """Add the `serve` subcommand to the `mlx-redrafter` parser."""
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible API and a chat page",
        description="Serve /v1/chat/completions, /v1/completions and /v1/models "
        "(streaming or not) and a chat page at /. Requests that arrive while others "
        "decode join the running batch at the next step.",
        epilog="example: mlx-redrafter serve --port 8080, then open http://127.0.0.1:8080/",
    )
    add_model_arguments(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument(
        "--tree",
        default=None,
        help="'auto' (the default: the tree chosen per step and batch size from this "
        "machine's calibrated cost and the running acceptance), the tree at every batch "
        "size (e.g. 1x2+1x7), or a tree per batch size, MAXBATCH:TREE comma-separated, "
        "plain beyond the last tier; 'plain' never speculates",
    )
    serve.add_argument(
        "--fixed-tree",
        action="store_true",
        help="always use the --tree shape; by default the server measures tau and step "
        "times as it runs and decodes plainly where the tree does not pay",
    )
    serve.add_argument(
        "--max-batch", type=int, default=16, help="rows decoded together (default: 16)"
    )
    serve.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="reply length when a request gives no max_tokens (default: 512)",
    )
    serve.add_argument("--seed", type=int, default=None, help="seed of the sampling stream")
    serve.set_defaults(run=run)


def model_names(model: str | None) -> tuple[str, tuple[str, ...]]:
    """The id /v1/models shows, and other names requests may use for it."""
    if model is None:
        from ..defaults import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME, ("default",)
    name = Path(model).name or model
    return name, (model, "default")


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from mlx_redrafter.apps.batcher import Batcher
        from mlx_redrafter.apps.server import Server, create_app
    except ImportError as error:
        raise ValueError(f"the server needs {SERVE_EXTRA}: {error}") from None
    auto = args.tree is None or args.tree.strip().lower() == DEFAULT_TREE
    policy: TreePolicy | str = DEFAULT_TREE if auto else TreePolicy.parse(args.tree)
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    model, drafter, tokenizer = load_from_args(args)
    guard = None if args.fixed_tree or auto else SpeedGuard()
    batcher = Batcher(
        model, drafter, tokenizer, policy, max_batch=args.max_batch, seed=args.seed, guard=guard
    )
    batcher.warm_up()
    model_id, aliases = model_names(args.model)
    app = create_app(Server(batcher, model_id, aliases, default_max_tokens=args.max_tokens))
    speculates = batcher.session.speculates
    mode = f"ReDrafter, {batcher.session.describe()}" if speculates else "plain decoding"
    if speculates and guard is not None:
        mode += "; plain where the tree measurably does not pay"
    print(
        f"serving {model_id} ({mode}) on http://{args.host}:{args.port}/  "
        f"(OpenAI API at /v1, chat page at /)",
        file=sys.stderr,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: listening on {args.host}, not only on this machine", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        batcher.close()
    return 0
