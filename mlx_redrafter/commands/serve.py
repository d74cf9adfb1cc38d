"""`mlx-redrafter serve`: an OpenAI-compatible server with continuous batching, and a chat
page at `/`."""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from pathlib import Path
from typing import Any

from ..config import DEFAULT_TREE
from ..distributed import SHARD_MODES, is_main_process, sharding_label
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
    serve.add_argument(
        "--port", type=port_number, default=8080, help="TCP port, 0-65535 (default: 8080)"
    )
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
    add_capacity_arguments(serve)
    serve.add_argument(
        "--shard",
        choices=SHARD_MODES,
        help="under mlx.launch: split the model across the ranks (tensor or pipeline "
        "parallel); rank 0 serves, the other ranks decode in step with it, and the "
        "prefix cache is off",
    )
    serve.add_argument("--seed", type=int, default=None, help="seed of the sampling stream")
    serve.set_defaults(run=run)


def add_capacity_arguments(serve: argparse.ArgumentParser) -> None:
    """The server's limits: rows, queue, prefill chunks, prefix cache, reply length."""
    serve.add_argument(
        "--max-batch", type=int, default=16, help="rows decoded together (default: 16)"
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for a row; more get 503 with Retry-After (default: 64)",
    )
    serve.add_argument(
        "--prefill-latency",
        type=float,
        default=0.5,
        help="seconds a new prompt's prefill may add to each step of the running requests: "
        "prompts are prefilled in chunks sized from the calibrated cost, one chunk "
        "between two steps (0: whole prompts at once; default: 0.5)",
    )
    serve.add_argument(
        "--prompt-cache-mb",
        type=int,
        default=1024,
        help="memory for the prefix cache, the K/V of finished requests that later "
        "prompts sharing a prefix reuse (least recently used dropped first; 0 turns it "
        "off; default: 1024)",
    )
    serve.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="reply length when a request gives no max_tokens (default: 512)",
    )


def port_number(text: str) -> int:
    """argparse type of --port: an integer in 0..65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {port}")
    return port


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a busy port fails at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise ValueError(f"cannot listen on --host {host!r}: {error}") from None
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is already in use: stop the program using it, or "
                "pick another with --port (0 picks a free one)"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return listener


def chunk_for_latency(model: Any, drafter: Any, seconds: float) -> int | None:
    """Prefill chunk (tokens) whose calibrated cost is about `seconds` (0: no chunks)."""
    if seconds == 0:
        return None
    from mlx_redrafter.calibrate import cached_calibration, prefill_chunk

    calibration, _ = cached_calibration(model, drafter, announce=True)
    return prefill_chunk(calibration, seconds)


def capacity_batcher(
    args: argparse.Namespace,
    model: Any,
    drafter: Any,
    tokenizer: Any,
    policy: TreePolicy | str,
    guard: SpeedGuard | None = None,
) -> Any:
    """The server's batcher with the limits of `add_capacity_arguments`, warmed up."""
    from mlx_redrafter.apps.batcher import Batcher
    from mlx_redrafter.prompt_cache import PrefixStore

    prefix_cache = args.prompt_cache_mb and getattr(args, "shard", None) is None
    batcher = Batcher(
        model,
        drafter,
        tokenizer,
        policy,
        max_batch=args.max_batch,
        seed=args.seed,
        guard=guard,
        max_queue=args.max_queue,
        prefixes=PrefixStore(args.prompt_cache_mb << 20) if prefix_cache else None,
        prefill_chunk=chunk_for_latency(model, drafter, args.prefill_latency),
    )
    batcher.warm_up()
    return batcher


def model_names(model: str | None) -> tuple[str, tuple[str, ...]]:
    """The id /v1/models shows, and other names requests may use for it."""
    if model is None:
        from ..defaults import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME, ("default",)
    name = Path(model).name or model
    return name, (model, "default")


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401

        from mlx_redrafter.apps import server  # noqa: F401
    except ImportError as error:
        raise ValueError(f"the server needs {SERVE_EXTRA}: {error}") from None
    auto = args.tree is None or args.tree.strip().lower() == DEFAULT_TREE
    policy: TreePolicy | str = DEFAULT_TREE if auto else TreePolicy.parse(args.tree)
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not args.prefill_latency >= 0:
        raise ValueError(f"--prefill-latency must be >= 0 seconds, got {args.prefill_latency}")
    if args.prompt_cache_mb < 0:
        raise ValueError(f"--prompt-cache-mb must be >= 0, got {args.prompt_cache_mb}")
    if not is_main_process():  # sharded: this rank decodes what rank 0 serves
        return _follow(args, policy, auto)
    listener = bind(args.host, args.port)
    try:
        return _serve(args, listener, policy, auto)
    finally:
        listener.close()


def _follow(args: argparse.Namespace, policy: TreePolicy | str, auto: bool) -> int:
    """A rank other than 0 of a sharded server: the same model and batcher as rank 0,
    which decode each of rank 0's steps with it, until rank 0 stops."""
    batcher = _loaded_batcher(args, policy, auto)
    batcher.wait()
    return 0


def _loaded_batcher(args: argparse.Namespace, policy: TreePolicy | str, auto: bool) -> Any:
    """The model of `args`, loaded, in the server's batcher (a speed guard with a fixed
    tree or policy unless --fixed-tree; the auto tree guards itself)."""
    model, drafter, tokenizer = load_from_args(args)
    guard = None if args.fixed_tree or auto else SpeedGuard()
    return capacity_batcher(args, model, drafter, tokenizer, policy, guard)


def _serve(
    args: argparse.Namespace, listener: socket.socket, policy: TreePolicy | str, auto: bool
) -> int:
    import uvicorn

    from mlx_redrafter.apps.server import Server, create_app

    batcher = _loaded_batcher(args, policy, auto)
    model, guarded = batcher.model, not (args.fixed_tree or auto)
    chunk = batcher.session.prefill_chunk
    model_id, aliases = model_names(args.model)
    app = create_app(Server(batcher, model_id, aliases, default_max_tokens=args.max_tokens))
    speculates = batcher.session.speculates
    mode = f"ReDrafter, {batcher.session.describe()}" if speculates else "plain decoding"
    if speculates and guarded:
        mode += "; plain where the tree measurably does not pay"
    if chunk is not None:
        mode += f"; new prompts prefilled {chunk} tokens per step"
    if batcher.group is not None:
        mode += f"; {sharding_label(model)}"
    port = listener.getsockname()[1]
    print(
        f"serving {model_id} ({mode}) on http://{args.host}:{port}/  "
        f"(OpenAI API at /v1, chat page at /)",
        file=sys.stderr,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: listening on {args.host}, not only on this machine", file=sys.stderr)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
    finally:
        batcher.close()
    return 0
