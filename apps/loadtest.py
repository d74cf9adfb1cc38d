"""Measurements for the server: step cost by batch size and tree, and a load test.

    python -m mlx_redrafter.apps.loadtest steps [--batch 1,2,4,8] [--tree plain,2x3,4x4]
        Seconds per decoding step of the decode loop for each batch size and tree,
        and the break-even tau: speculation beats plain decoding at that batch size
        exactly when its tau exceeds (speculative step / plain step). The step cost does
        not depend on the drafter's weights, so an untrained drafter of the shipped
        shape (or --drafter) measures it.

    python -m mlx_redrafter.apps.loadtest http [--clients 1,2,4,8] [--requests 2]
            [--repeats 2] [--max-tokens 64] [--against-mlx-lm] [--out DIR]
        Starts every server in its own process on a loopback port (mlx_lm.server with
        --against-mlx-lm, and `mlx-redrafter serve` with speculation off and on: the
        auto tree, or a --tree as is ("fixed") and with its speed guard ("guarded")).
        For each number of concurrent clients, the servers take turns for --repeats
        rounds each, every client sending --requests streamed greedy chat requests per
        round; prints throughput, latency and time to first token (p50, p95) over all
        of a server's rounds and writes loadtest.json and loadtest.png to --out.

    python -m mlx_redrafter.apps.loadtest soak [--clients 4] [--minutes 2] [--requests 1000]
        Concurrent clients send mixed short and long greedy requests, drop some streams
        and requests mid-way and send bad requests, for a bounded time; then checks no
        5xx, no row left in the batch, resident memory flat after the first quarter,
        and every completed reply equal to the same request served alone (`soak.py`).

    python -m mlx_redrafter.apps.loadtest stall [--prompt-tokens 1024,4096] [--prefill-latency 0.5]
        One request decodes; a long prompt joins, and a short chat request arrives once
        --arrival of it is prefilled. For whole prefills and for chunks sized to
        --prefill-latency from the calibrated cost (as `serve` does), prints the
        running request's longest pause between two updates (the time `add` takes,
        then each step), the short request's and the long prompt's times to their
        first tokens.

All load the embedded default model unless --model is given. Everything stays on
127.0.0.1; request counts and a wall-clock limit bound the run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_redrafter.commands.serve import add_capacity_arguments
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


def untrained_drafter(model: Any) -> Drafter:
    """An untrained drafter of a small shape (a draft vocabulary of at most 2048 tokens)."""
    hidden, vocab = (int(n) for n in model.model.embed_tokens.weight.shape[::-1])
    return Drafter.create(model, exit_dim=hidden, draft_vocab_size=min(2048, vocab))


def load_models(args: argparse.Namespace) -> tuple[Any, Drafter | None, Any]:
    import warnings

    from mlx_redrafter.loading import load, load_drafter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, drafter, tokenizer = load(args.model)
    if args.drafter == "untrained":  # the shipped shape, untrained: tau ~1, the worst case
        drafter = untrained_drafter(model)
    elif args.drafter:
        drafter = load_drafter(args.drafter)
        drafter.check_fits(model)
    return model, drafter, tokenizer


# -- step cost by batch size ----------------------------------------------------------


class MlxLmBatch:
    """mlx-lm's own batched plain decoding (`BatchGenerator`) of the same prompts, a
    step at a time, for comparison: its first step prefills them (a warm-up step)."""

    name = "mlx-lm BatchGenerator"

    def __init__(self, model: Any, prompts: list[list[int]]):
        from mlx_lm.generate import BatchGenerator

        self.generator = BatchGenerator(model, stop_tokens=[])  # rows never stop
        self.generator.insert(prompts, max_tokens=[1 << 30] * len(prompts))

    def step(self) -> None:
        self.generator.next()
        # It launches its next step before returning: wait for it, so that its
        # work is not timed in the step of the session measured after it.
        mx.synchronize()


def step_costs(args: argparse.Namespace) -> int:
    from mlx_redrafter.prompts import chat_tokens

    model, drafter, tokenizer = load_models(args)
    if drafter is None:  # the cost does not depend on the weights: the shipped shape
        drafter = untrained_drafter(model)
    texts = prompts()
    batches = [int(b) for b in args.batch.split(",")]
    trees = [TreeConfig.parse(b) for b in args.tree.split(",")]
    if PLAIN_DECODING not in trees:  # the break-even tau is against plain steps
        trees.insert(0, PLAIN_DECODING)
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
        stepped: list[Any] = [*sessions, MlxLmBatch(model, encoded)]
        times: list[list[float]] = [[] for _ in stepped]
        # Interleaved rounds (plain, 2x3, 4x4, plain, ...): load from other jobs on the
        # machine hits every shape alike.
        for index in range(args.warmup + args.steps):
            for position, session in enumerate(stepped):
                started = time.perf_counter()
                session.step()
                if index >= args.warmup:
                    times[position].append(time.perf_counter() - started)
        names = ["plain" if tree == PLAIN_DECODING else tree.label for tree in trees]
        for name, seconds in zip([*names, MlxLmBatch.name], times):
            rows.append(
                {
                    "batch": batch_size,
                    "tree": name,
                    "step_ms": 1e3 * statistics.median(seconds),
                    "min_ms": 1e3 * min(seconds),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del sessions, stepped
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
    seconds: float = 0.0  # wall-clock of the rounds added into this run (`add`)

    def add(self, other: Run, seconds: float) -> None:
        """Count another round's requests and wall-clock into this run."""
        self.samples += other.samples
        self.errors += other.errors
        self.seconds += seconds


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
    host: str,
    port: int,
    clients: int,
    requests: int,
    max_tokens: int,
    deadline: float,
    offset: int = 0,
) -> tuple[Run, float]:
    """Each of `clients` sends `requests` streamed greedy requests in turn, with the
    prompts from `offset` on in the prompt list (each once, while it lasts)."""
    texts = prompts()
    run = Run()

    def client(index: int) -> None:
        for number in range(requests):
            if time.monotonic() > deadline:
                return
            text = texts[(offset + index * requests + number) % len(texts)]
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


def percentile(values: list[float], share: float) -> float:
    """The value below which `share` of the sorted `values` lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def summarize(name: str, clients: int, run: Run, wall: float) -> dict[str, Any]:
    """One round's figures: throughput of all clients, latency and first-token
    percentiles, mean tau (0 where the server reports none)."""
    latencies = [s.seconds for s in run.samples]
    firsts = [s.first_token for s in run.samples]
    return {
        "server": name,
        "clients": clients,
        "requests": len(run.samples),
        "failed": run.errors,
        "tokens_per_second": sum(s.tokens for s in run.samples) / wall,
        "latency_p50": percentile(latencies, 0.5),
        "latency_p95": percentile(latencies, 0.95),
        "first_token_p50": percentile(firsts, 0.5),
        "first_token_p95": percentile(firsts, 0.95),
        "tau": statistics.mean(s.tau for s in run.samples),
    }


HEADER = (
    "| server | clients | requests | tokens/s (all clients) | latency p50 / p95 (s) "
    "| first token p50 / p95 (s) | mean tau |\n| --- | --- | --- | --- | --- | --- | --- |"
)


def table_row(row: dict[str, Any]) -> str:
    failed = f" ({row['failed']} failed)" if row["failed"] else ""
    tau = f"{row['tau']:.2f}" if row["tau"] else "-"
    return (
        f"| {row['server']} | {row['clients']} | {row['requests']}{failed} | "
        f"{row['tokens_per_second']:.1f} | {row['latency_p50']:.1f} / {row['latency_p95']:.1f} | "
        f"{row['first_token_p50']:.2f} / {row['first_token_p95']:.2f} | {tau} |"
    )


@dataclass(frozen=True)
class Server:
    """One server of the load test: its name, command, port and readiness path."""

    name: str
    command: list[str]
    port: int
    ready: str


def warm_up(server: Server) -> None:
    """One short request: the first forward of a shape compiles kernels."""
    warm = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    stream_chat("127.0.0.1", server.port, warm, timeout=300)


def interleaved_rounds(
    servers: list[Server], args: argparse.Namespace, deadline: float
) -> list[dict[str, Any]]:
    """For each number of clients, `--repeats` rounds per server, the servers taking
    turns (in a rotated order each repeat), so that a machine that slows down or
    speeds up during the run favours none of them. Every server gets the same
    prompts in a repeat; each repeat (and each number of clients) sends prompts no
    earlier one sent, so no round hits a prefix cache. One row per server and
    number of clients, over all its repeats."""
    rows, offset = [], 0
    for clients in (int(c) for c in args.clients.split(",")):
        runs = {server.name: Run() for server in servers}
        for repeat in range(args.repeats):
            turn = repeat % len(servers)
            for server in servers[turn:] + servers[:turn]:
                run, wall = load_round(
                    "127.0.0.1",
                    server.port,
                    clients,
                    args.requests,
                    args.max_tokens,
                    deadline,
                    offset,
                )
                runs[server.name].add(run, wall)
            offset += clients * args.requests
        for server in servers:
            total = runs[server.name]
            if not total.samples:
                print(f"| {server.name} | {clients} | 0 | (time limit reached) | | | |")
                continue
            rows.append(summarize(server.name, clients, total, total.seconds))
            print(table_row(rows[-1]), flush=True)
    return rows


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def server_process(command: list[str], port: int, ready_path: str) -> Iterator[None]:
    """Run a server command (listening on 127.0.0.1:port) until the block ends; wait
    up to 300 s for `ready_path` to answer 200 first."""
    # Quiet: servers log every request; run the command by hand to see why it fails.
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = time.monotonic() + 300
        while not _answers(port, ready_path):
            if server.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {server.returncode}: "
                    f"run {' '.join(command)} to see why"
                )
            if time.monotonic() > ready:
                raise RuntimeError(f"{' '.join(command[:4])} did not answer within 300 s")
            time.sleep(1.0)
        yield
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _answers(port: int, path: str) -> bool:
    """Whether GET `path` on 127.0.0.1:port answers 200 now."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def server_commands(args: argparse.Namespace) -> list[Server]:
    """Every server the load test runs, each on its own loopback port: mlx_lm.server
    (with --against-mlx-lm), then `mlx-redrafter serve` with speculation off and on,
    all on the same model folder and otherwise with their default settings."""
    from mlx_redrafter.loading import model_path

    python = sys.executable
    common = ["--model", model_path(args.model), "--host", "127.0.0.1"]
    commands = []
    if args.against_mlx_lm:
        commands.append(("mlx_lm.server", [python, "-m", "mlx_lm.server", *common], "/health"))
    ours = [python, "-c", "import sys; from mlx_redrafter.cli import main; sys.exit(main())"]
    ours += ["serve", *common] + (["--drafter", args.drafter] if args.drafter else [])
    modes = [("off", ["--tree", "plain"])]
    if args.tree.strip().lower() == "auto":
        modes.append(("on, auto", []))
    else:
        modes += [("on, fixed", ["--tree", args.tree, "--fixed-tree"])]
        modes += [("on, guarded", ["--tree", args.tree])]
    for name, flags in modes:
        commands.append((f"mlx-redrafter, {name}", ours + flags, "/v1/models"))
    servers, ports = [], set()
    for name, command, ready in commands:
        port = free_port()
        while port in ports:
            port = free_port()
        ports.add(port)
        servers.append(Server(name, [*command, "--port", str(port)], port, ready))
    return servers


def http_load(args: argparse.Namespace) -> int:
    """Every server in its own process, all running at once (an idle server waits
    without using the CPU), the clients in this one; rounds interleaved."""
    if args.drafter == "untrained":
        raise SystemExit("loadtest http: --drafter untrained is for `steps` only; give a folder")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    deadline = time.monotonic() + args.time_limit
    servers = server_commands(args)
    with contextlib.ExitStack() as running:
        for server in servers:
            running.enter_context(server_process(server.command, server.port, server.ready))
        for server in servers:
            warm_up(server)
        print(HEADER, flush=True)
        rows = interleaved_rounds(servers, args, deadline)
    if args.out:
        write_load_results(Path(args.out), rows, args)
    return 0


def write_load_results(folder: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """loadtest.json (every round) and loadtest.png (throughput and p95 latency by clients;
    needs matplotlib)."""
    from mlx_redrafter.bench import environment
    from mlx_redrafter.files import write_json

    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        "requests_per_client": args.requests,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
    }
    result = {"environment": environment(), "config": settings, "rounds": rows}
    write_json(folder / "loadtest.json", result)
    print(f"wrote {folder / 'loadtest.json'}")
    try:
        from mlx_redrafter.bench_plots import plot_load

        print(f"wrote {plot_load(rows, folder / 'loadtest.png')}")
    except ValueError as error:  # no matplotlib
        print(f"note: no plot: {error}", file=sys.stderr)


@dataclass
class Stall:
    """What a running request and a short one saw while a long prompt joined."""

    chunk: int | None
    longest_pause: float  # seconds between two of the running request's updates
    short_first_token: float  # a short request arriving mid-prefill: seconds to its first
    first_token: float  # the long prompt's seconds to its first update


SHORT_QUESTION = "What is the capital of France?"


def measure_stall(
    model: Any,
    drafter: Drafter | None,
    tokenizer: Any,
    length: int,
    chunk: int | None,
    arrival: float = 0.5,
) -> Stall:
    """A request decodes (in the decoding session the server's worker drives); a
    `length`-token prompt joins, and a short chat request arrives once `arrival` of
    the long prompt is prefilled (whole prefills block the worker: it arrives at that
    share of the prefill's time and waits for its end). Measures the running request's
    longest wait between two updates until the long prompt's first token, and the
    short and long requests' times to their first tokens."""
    from mlx_redrafter.prompts import chat_tokens

    session = DecodingSession(model, drafter, tokenizer, prefill_chunk=chunk)
    prompt = tokenizer.encode("Tell me a long story about a lighthouse.")
    session.add([Request(prompt, stop=StopConfig(100_000))], ids=[0])  # no EOS: runs on
    for _ in range(3):
        session.step()
    vocab = int(model.model.embed_tokens.weight.shape[0])
    long_prompt = [int(t) for t in mx.random.randint(0, vocab, (length,), key=mx.random.key(5))]
    short = Request(chat_tokens(tokenizer, [{"role": "user", "content": SHORT_QUESTION}]))
    submitted = last = time.perf_counter()
    session.add([Request(long_prompt, stop=StopConfig(1))], ids=[1])
    arrived, steps, pauses = None, 0, []
    firsts: dict[int, float] = {}  # request -> time of its first update
    if chunk is None:  # the worker was busy with the whole prefill when it arrived
        arrived = submitted + arrival * (time.perf_counter() - submitted)
        session.add([short], ids=[2])
    chunks_before = math.ceil(arrival * (length - 1) / chunk) if chunk else 0
    while len(firsts) < 2:
        if arrived is None and steps == chunks_before:
            arrived = time.perf_counter()
            session.add([short], ids=[2])
        updates = session.step()
        steps, now = steps + 1, time.perf_counter()
        if 1 not in firsts:
            pauses.append(now - last)
        last = now
        for update in updates:
            if update.request in (1, 2):
                firsts.setdefault(update.request, now)
    session.close()
    assert arrived is not None
    return Stall(chunk, max(pauses), firsts[2] - arrived, firsts[1] - submitted)


def stall(args: argparse.Namespace) -> int:
    from mlx_redrafter.commands.serve import chunk_for_latency

    model, drafter, tokenizer = load_models(args)
    chunk = chunk_for_latency(model, drafter, args.prefill_latency)
    print(
        "| prompt tokens | prefill | running request's longest pause (s) "
        f"| short request's first token (s), arriving at {args.arrival:.0%} "
        "| long prompt's first token (s) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for length in (int(n) for n in args.prompt_tokens.split(",")):
        for size in (None, chunk):
            result = measure_stall(model, drafter, tokenizer, length, size, args.arrival)
            label = "whole" if size is None else f"chunks of {size}"
            print(
                f"| {length} | {label} | {result.longest_pause:.3f} "
                f"| {result.short_first_token:.3f} | {result.first_token:.3f} |",
                flush=True,
            )
    return 0


def soak_server(args: argparse.Namespace) -> int:
    """The soak test against this project's server (in this process), configured as
    `serve` is (auto tree, prefix cache, prefill chunks)."""
    from mlx_redrafter.commands.serve import capacity_batcher
    from mlx_redrafter.policy import SpeedGuard, TreePolicy

    from .server import BackgroundServer, Server, create_app
    from .soak import SoakConfig, long_prompts, run_soak

    model, drafter, tokenizer = load_models(args)
    auto = args.tree.strip().lower() == DEFAULT_TREE
    policy = DEFAULT_TREE if auto else TreePolicy.parse(args.tree)
    guard = None if auto else SpeedGuard()
    batcher = capacity_batcher(args, model, drafter, tokenizer, policy, guard)
    short = prompts()
    texts = short + long_prompts(short, max(1, len(short) // 4), parts=6)
    config = SoakConfig(
        clients=args.clients, seconds=60 * args.minutes, requests=args.requests, seed=args.seed
    )
    prefixes = batcher.prefixes

    def cached() -> int:
        return prefixes.nbytes if prefixes is not None else 0

    with BackgroundServer(create_app(Server(batcher, "model"))) as server:
        report = run_soak(server.port, texts, config, cached)
    batcher.close()
    summary = report.summary()
    print(json.dumps(summary, indent=1))
    if args.out:
        from mlx_redrafter.bench import environment
        from mlx_redrafter.files import write_json

        Path(args.out).mkdir(parents=True, exist_ok=True)
        settings = {k: getattr(args, k) for k in ("clients", "minutes", "requests", "seed")}
        settings["prompt_cache_mb"] = args.prompt_cache_mb
        result = {"environment": environment(), "config": settings, "soak": summary}
        write_json(Path(args.out) / "soak.json", result)
    print("soak: " + ("passed" if report.passed else "FAILED"))
    return 0 if report.passed else 1


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
        help="drafter folder, or 'untrained' (steps only) for an untrained drafter of the "
        "shipped shape",
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    steps = sub.add_parser("steps", help="step cost by batch size and tree")
    steps.add_argument("--batch", default="1,2,4,8")
    steps.add_argument("--tree", default="plain,2x3,4x4")
    steps.add_argument("--steps", type=int, default=5)
    steps.add_argument("--warmup", type=int, default=2)
    steps.set_defaults(run=step_costs)
    load = sub.add_parser("http", help="concurrent clients against the server")
    load.add_argument("--clients", default="1,2,4,8")
    load.add_argument("--requests", type=int, default=2, help="requests per client per round")
    load.add_argument(
        "--repeats", type=int, default=2, help="rounds per server and number of clients"
    )
    load.add_argument("--max-tokens", type=int, default=64)
    load.add_argument("--tree", default=DEFAULT_TREE, help="tree or policy when speculation is on")
    load.add_argument("--time-limit", type=float, default=1800, help="seconds for everything")
    load.add_argument(
        "--against-mlx-lm",
        action="store_true",
        help="first run the same rounds against mlx_lm.server on the same model folder",
    )
    load.add_argument("--out", default=None, help="folder for loadtest.json and loadtest.png")
    load.set_defaults(run=http_load)
    endure = sub.add_parser("soak", help="clients, disconnects and bad requests for a while")
    endure.add_argument("--clients", type=int, default=4)
    endure.add_argument("--minutes", type=float, default=2.0)
    endure.add_argument("--requests", type=int, default=1000, help="bound on all requests")
    endure.add_argument("--tree", default=DEFAULT_TREE)
    endure.add_argument("--seed", type=int, default=0)
    add_capacity_arguments(endure)
    endure.add_argument("--out", default=None, help="folder for soak.json")
    endure.set_defaults(run=soak_server)
    pause = sub.add_parser("stall", help="how long a long prompt pauses a running request")
    pause.add_argument("--prompt-tokens", default="1024,4096")
    pause.add_argument("--prefill-latency", type=float, default=0.5)
    pause.add_argument(
        "--arrival",
        type=float,
        default=0.5,
        help="share of the long prefill done when the short request arrives (0-1)",
    )
    pause.set_defaults(run=stall)
    args = parser.parse_args(argv)
    if args.mode == "stall" and not 0 <= args.arrival <= 1:
        parser.error(f"--arrival is a share of the long prefill, 0 to 1; got {args.arrival}")
    try:
        return int(args.run(args))
    except ValueError as error:  # bad input (a tree, a model folder): say what, no traceback
        print(f"loadtest: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
