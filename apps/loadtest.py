"""Measurements for the server: step cost by batch size and tree, and a load test.

    python -m mlx_redrafter.apps.loadtest steps [--batch 1,2,4,8] [--tree plain,2x3,4x4]
        Seconds per decoding step of the decode loop for each batch size and tree,
        and the break-even tau: speculation beats plain decoding at that batch size
        exactly when its tau exceeds (speculative step / plain step). The step cost does
        not depend on the drafter's weights, so an untrained drafter of the shipped
        shape (or --drafter) measures it.

    python -m mlx_redrafter.apps.loadtest http [--clients 1,4,8] [--requests 2] [--max-tokens 48]
        Starts the server on a loopback port (in this process), then for each number of
        concurrent clients sends a bounded number of streamed chat requests per client:
        speculation off, on with the --tree policy as is ("fixed"), and on with the
        speed guard the server uses by default ("guarded"); prints throughput and latency.

    python -m mlx_redrafter.apps.loadtest stall [--prompt-tokens 1024,4096] [--prefill-latency 0.5]
        One request decodes; a long prompt joins. For whole prefills and for chunks
        sized to --prefill-latency from the calibrated cost (as `serve` does), prints the
        running request's longest pause between two updates (the time `add` takes,
        then each step) and the long prompt's time to its first token.

All load the embedded default model unless --model is given. Everything stays on
127.0.0.1; request counts and a wall-clock limit bound the run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_redrafter.config import DEFAULT_TREE, PLAIN_DECODING, StopConfig, TreeConfig
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.session import DecodingSession, Request

FALLBACK_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me three tips for learning to cook.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "How does a refrigerator keep food cold?",
    "Describe a good morning routine for a student.",
    "Why do cats purr?",
]


def prompts() -> list[str]:
    from mlx_redrafter.prompts import MT_BENCH, read_prompts

    if MT_BENCH.is_file():
        return [record.messages[-1]["content"] for record in read_prompts(MT_BENCH)]
    return FALLBACK_PROMPTS


def load_models(args: argparse.Namespace) -> tuple[Any, Drafter | None, Any]:
    import warnings

    from mlx_redrafter.loading import load, load_drafter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, drafter, tokenizer = load(args.model)
    if args.drafter == "untrained":  # the shipped shape, untrained: tau ~1, the worst case
        hidden = int(model.model.embed_tokens.weight.shape[1])
        drafter = Drafter.create(model, exit_dim=hidden, draft_vocab_size=2048)
    elif args.drafter:
        drafter = load_drafter(args.drafter)
        drafter.check_fits(model)
    return model, drafter, tokenizer


# -- step cost by batch size ----------------------------------------------------------


def step_costs(args: argparse.Namespace) -> int:
    from mlx_redrafter.prompts import chat_tokens

    model, drafter, tokenizer = load_models(args)
    if drafter is None:  # the cost does not depend on the weights: the shipped shape
        hidden = int(model.model.embed_tokens.weight.shape[1])
        drafter = Drafter.create(model, exit_dim=hidden, draft_vocab_size=2048)
    texts = prompts()
    batches = [int(b) for b in args.batch.split(",")]
    trees = [TreeConfig.parse(b) for b in args.tree.split(",")]
    rows: list[dict[str, Any]] = []
    endless = StopConfig(max_tokens=1 << 30)
    for batch_size in batches:
        encoded = [
            chat_tokens(tokenizer, [{"role": "user", "content": texts[i % len(texts)]}])
            for i in range(batch_size)
        ]
        sessions = [
            # prefetch=False: no session drafts ahead during another one's timed step.
            DecodingSession(
                model, None if tree == PLAIN_DECODING else drafter, tree=tree, prefetch=False
            )
            for tree in trees
        ]
        for session in sessions:
            session.add([Request(prompt, stop=endless) for prompt in encoded])
        times: list[list[float]] = [[] for _ in trees]
        # Interleaved rounds (plain, 2x3, 4x4, plain, ...): load from other jobs on the
        # machine hits every shape alike.
        for index in range(args.warmup + args.steps):
            for position, session in enumerate(sessions):
                started = time.perf_counter()
                session.step()
                if index >= args.warmup:
                    times[position].append(time.perf_counter() - started)
        for tree, seconds in zip(trees, times):
            name = "plain" if tree == PLAIN_DECODING else tree.label
            rows.append(
                {
                    "batch": batch_size,
                    "tree": name,
                    "step_ms": 1e3 * statistics.median(seconds),
                    "min_ms": 1e3 * min(seconds),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del sessions
        mx.clear_cache()
    print("| batch | tree | step median (min), ms | break-even tau (median, min) |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        plain = next(r for r in rows if r["batch"] == row["batch"] and r["tree"] == "plain")
        print(
            f"| {row['batch']} | {row['tree']} | {row['step_ms']:.0f} ({row['min_ms']:.0f}) | "
            f"{row['step_ms'] / plain['step_ms']:.2f}, {row['min_ms'] / plain['min_ms']:.2f} |"
        )
    return 0


# -- the HTTP load test ---------------------------------------------------------------


@dataclass
class Sample:
    seconds: float
    first_token: float
    tokens: int
    tau: float


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def stream_chat(host: str, port: int, body: dict[str, Any], timeout: float) -> Sample:
    """One streamed chat request; time to first text and to the end."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    started = time.perf_counter()
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first = None
    tokens, tau = 0, 0.0
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        for choice in chunk.get("choices", []):
            if first is None and choice["delta"].get("content"):
                first = time.perf_counter() - started
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("redrafter"):
            tau = chunk["redrafter"]["tokens_per_step"]
    connection.close()
    seconds = time.perf_counter() - started
    return Sample(seconds, first if first is not None else seconds, tokens, tau)


def load_round(
    host: str, port: int, clients: int, requests: int, max_tokens: int, deadline: float
) -> tuple[Run, float]:
    texts = prompts()
    run = Run()

    def client(index: int) -> None:
        for number in range(requests):
            if time.monotonic() > deadline:
                return
            text = texts[(index * requests + number) % len(texts)]
            body = {
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                sample = stream_chat(
                    host, port, body, timeout=max(1.0, deadline - time.monotonic())
                )
            except Exception as error:
                print(f"request failed: {error}", file=sys.stderr)
                with run.lock:
                    run.errors += 1
                continue
            with run.lock:
                run.samples.append(sample)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return run, time.perf_counter() - started


def http_load(args: argparse.Namespace) -> int:
    from mlx_redrafter.policy import SpeedGuard, TreePolicy

    from .batcher import Batcher
    from .server import BackgroundServer, Server, create_app

    model, drafter, tokenizer = load_models(args)
    if drafter is None and args.tree not in ("plain", "auto"):
        print("note: no drafter: both runs decode plainly", file=sys.stderr)
    deadline = time.monotonic() + args.time_limit
    counts = [int(c) for c in args.clients.split(",")]
    modes: list[tuple[str, TreePolicy | str, SpeedGuard | None]] = [("off", TreePolicy(()), None)]
    if args.tree.strip().lower() == "auto":
        modes.append(("on, auto", "auto", None))
    else:
        on = TreePolicy.parse(args.tree)
        modes += [("on, fixed", on, None), ("on, guarded", on, SpeedGuard())]
    print("| speculation | clients | requests | tokens/s (all clients) | latency mean / p90 (s) "
          "| first token mean (s) | mean tau |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, policy, guard in modes:
        speculative = drafter if isinstance(policy, str) or policy.tiers else None
        batcher = Batcher(model, speculative, tokenizer, policy, seed=0, guard=guard)
        batcher.warm_up()
        server = BackgroundServer(create_app(Server(batcher, "model")))
        with server:
            # One short request first: the first forward of a shape compiles kernels.
            warm = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            stream_chat(server.host, server.port, {**warm, "stream": True}, timeout=120)
            for clients in counts:
                run, wall = load_round(
                    server.host, server.port, clients, args.requests, args.max_tokens, deadline
                )
                if not run.samples:
                    print(f"| {name} | {clients} | 0 | (time limit reached) | | | |")
                    continue
                latencies = sorted(s.seconds for s in run.samples)
                p90 = latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))]
                tokens = sum(s.tokens for s in run.samples)
                print(
                    f"| {name} | {clients} | {len(run.samples)}"
                    + (f" ({run.errors} failed)" if run.errors else "")
                    + f" | {tokens / wall:.1f} | {statistics.mean(latencies):.1f} / {p90:.1f} | "
                    f"{statistics.mean(s.first_token for s in run.samples):.2f} | "
                    f"{statistics.mean(s.tau for s in run.samples):.2f} |",
                    flush=True,
                )
        batcher.close()
    return 0


@dataclass
class Stall:
    """What a running request saw while a long prompt joined."""

    chunk: int | None
    longest_pause: float  # seconds between two of the running request's updates
    first_token: float  # the long prompt's seconds to its first update


def measure_stall(
    model: Any, drafter: Drafter | None, tokenizer: Any, length: int, chunk: int | None
) -> Stall:
    """A request decodes (in the decoding session the server's worker drives); a
    `length`-token prompt joins: how long the running request waits between two
    updates until the long one has its first token."""
    session = DecodingSession(model, drafter, tokenizer, prefill_chunk=chunk)
    prompt = tokenizer.encode("Tell me a long story about a lighthouse.")
    session.add([Request(prompt, stop=StopConfig(100_000))], ids=[0])  # no EOS: runs on
    for _ in range(3):
        session.step()
    vocab = int(model.model.embed_tokens.weight.shape[0])
    long_prompt = [int(t) for t in mx.random.randint(0, vocab, (length,), key=mx.random.key(5))]
    submitted = last = time.perf_counter()
    session.add([Request(long_prompt, stop=StopConfig(1))], ids=[1])
    pauses = []
    while True:
        updates = session.step()
        now = time.perf_counter()
        pauses.append(now - last)
        last = now
        if any(update.request == 1 for update in updates):
            break
    session.close()
    return Stall(chunk, max(pauses), last - submitted)


def stall(args: argparse.Namespace) -> int:
    from mlx_redrafter.commands.serve import chunk_for_latency

    model, drafter, tokenizer = load_models(args)
    chunk = chunk_for_latency(model, drafter, args.prefill_latency)
    print(
        "| prompt tokens | prefill | running request's longest pause (s) "
        "| long prompt's first token (s) |"
    )
    print("| --- | --- | --- | --- |")
    for length in (int(n) for n in args.prompt_tokens.split(",")):
        for size in (None, chunk):
            result = measure_stall(model, drafter, tokenizer, length, size)
            label = "whole" if size is None else f"chunks of {size}"
            print(
                f"| {length} | {label} | {result.longest_pause:.2f} | {result.first_token:.2f} |",
                flush=True,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_redrafter.apps.loadtest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument(
        "--drafter",
        default=None,
        help="drafter folder, or 'untrained' for an untrained drafter of the shipped shape",
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    steps = sub.add_parser("steps", help="step cost by batch size and tree")
    steps.add_argument("--batch", default="1,2,4,8")
    steps.add_argument("--tree", default="plain,2x3,4x4")
    steps.add_argument("--steps", type=int, default=5)
    steps.add_argument("--warmup", type=int, default=2)
    steps.set_defaults(run=step_costs)
    load = sub.add_parser("http", help="concurrent clients against the server")
    load.add_argument("--clients", default="1,4,8")
    load.add_argument("--requests", type=int, default=2, help="requests per client")
    load.add_argument("--max-tokens", type=int, default=48)
    load.add_argument("--tree", default=DEFAULT_TREE, help="tree or policy when speculation is on")
    load.add_argument("--time-limit", type=float, default=1800, help="seconds for everything")
    load.set_defaults(run=http_load)
    pause = sub.add_parser("stall", help="how long a long prompt pauses a running request")
    pause.add_argument("--prompt-tokens", default="1024,4096")
    pause.add_argument("--prefill-latency", type=float, default=0.5)
    pause.set_defaults(run=stall)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
