"""Sharded targets: 2 ranks over MLX's ring backend (loopback), tensor and pipeline
sharding of a tiny model. Greedy speculative output is token-identical on both
ranks, to mlx-lm's own decoding of the same sharded model and to one process
decoding the whole model; sampled output is the same on both ranks.

Run as a script, this file is the worker `mlx.launch` starts on each rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from subprocess import PIPE

import mlx.core as mx
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from ports import free_ports  # noqa: E402

MAX_TOKENS = 24
# A drafter-less tree, a drafter tree with a lookup branch, and the auto tree (its
# choices come from timings, which must agree across ranks).
TREES = {"plain": "1x1", "lookup": "0x1+2x4", "beams": "2x3+1x4", "auto": "auto"}


def _worker(mode: str, family: str, out: Path) -> None:
    from conftest import decode_tokens, mlx_lm_greedy, random_prompts
    from mlx_lm.generate import generation_stream
    from tiny_models import tiny_model

    from mlx_redrafter.config import SamplingConfig
    from mlx_redrafter.distributed import shard_model, sharding_label
    from mlx_redrafter.drafter import Drafter
    from mlx_redrafter.target import prepare_target

    group = mx.distributed.init()
    prompts = random_prompts(3, seed=5)
    whole = tiny_model(family)
    alone = [mlx_lm_greedy(whole, p, MAX_TOKENS) for p in prompts]
    model = shard_model(tiny_model(family), mode, group)
    mx.eval(model.parameters())
    sharded = [mlx_lm_greedy(model, p, MAX_TOKENS) for p in prompts]
    # mlx-lm leaves its last forward in flight on its stream: let it finish before
    # this process issues collectives on another stream.
    mx.synchronize(generation_stream)
    prepare_target(model)
    mx.random.seed(0)
    drafter = Drafter.create(model)
    ours = {}
    for name, tree in TREES.items():
        ours[name] = decode_tokens(model, drafter, prompts, tree, MAX_TOKENS)[0]
    # Each rank seeds differently (as an unseeded request would): rank 0's keys rule.
    key = mx.random.key(4 + group.rank())
    sampled = decode_tokens(model, drafter, prompts, "2x3", MAX_TOKENS, SamplingConfig(0.8), key)[0]
    report = {
        "label": sharding_label(model),
        "alone": alone,
        "sharded": sharded,
        "ours": ours,
        "sampled": sampled,
    }
    (out / f"rank{group.rank()}.json").write_text(json.dumps(report))


def _bench_worker(folder: Path, out: Path) -> None:
    """`load(folder, shard="pipeline")` and the benchmark's methods on token-id prompts
    (the tiny word tokenizer does not survive transformers' Qwen2 tokenizer class)."""
    from conftest import random_prompts

    from mlx_redrafter.bench import BenchConfig, run_benchmark
    from mlx_redrafter.commands.common import parse_trees
    from mlx_redrafter.loading import load

    model, drafter, tokenizer = load(folder, shard="pipeline")
    trees = parse_trees("auto,0x1+1x4")
    config = BenchConfig(max_tokens=12, trees=trees, unpacked=False, profile_prompts=0)
    result = run_benchmark(model, drafter, tokenizer, random_prompts(2, seed=3), config)
    rates = {m["method"]: m["match_rate"] for m in result["summary"]}
    (out / f"rank{mx.distributed.init().rank()}.json").write_text(json.dumps(rates))


def _model_folder(folder: Path, family: str, eos: str = "w20") -> Path:
    """A tiny model folder of `family` that `mlx_redrafter.load` opens."""
    import mlx_lm.utils
    from tiny_models import _COMMON, FAMILY_CONFIGS, tiny_model, tiny_tokenizer

    folder.mkdir(parents=True)
    mlx_lm.utils.save_model(folder, tiny_model(family))
    mlx_lm.utils.save_config({**_COMMON, **FAMILY_CONFIGS[family]}, folder / "config.json")
    tiny_tokenizer(eos_token=eos)._tokenizer.save_pretrained(str(folder))
    return folder


def _launch(arguments: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
        "MLX_REDRAFTER_CACHE": str(tmp_path / "cache"),
    }
    command = [str(LAUNCHER), "--backend", "ring", "-n", "2", "--starting-port"]
    command += [str(free_ports(2)), *arguments]
    # Its own process group: on a timeout (ranks stuck in a collective) every rank
    # is killed, not only the launcher.
    process = subprocess.Popen(
        command, env=env, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"the ranks did not finish within 300 s (stuck in a collective?)\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# mlx.launch is installed next to this interpreter (a venv need not be on PATH).
LAUNCHER = shutil.which(
    "mlx.launch", path=os.pathsep.join([sys.prefix + "/bin", os.environ.get("PATH", "")])
)


@pytest.mark.skipif(LAUNCHER is None, reason="mlx.launch is not installed")
@pytest.mark.parametrize(
    ("mode", "family"), [("tensor", "qwen2"), ("pipeline", "qwen2"), ("pipeline", "llama")]
)
def test_two_ranks_decode_like_one_process_and_mlx_lm_sharded(mode, family, tmp_path):
    """qwen2 through mlx-lm's own tensor and pipeline sharding; llama through this
    package's pipeline stages (mlx-lm's plain decoding runs on them as on its own)."""
    script = [sys.executable, str(Path(__file__).resolve()), mode, family, str(tmp_path)]
    result = _launch(script, tmp_path)
    # mlx.launch exits 0 even when a rank fails, so check the ranks' outputs too.
    assert result.returncode == 0, result.stderr[-3000:]
    reports = []
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.is_file(), result.stdout[-3000:] + result.stderr[-3000:]
        reports.append(json.loads(path.read_text()))
    first, second = reports
    assert first["label"] == f"{mode}-sharded over 2 ranks (rank 0)"
    assert second["label"] == f"{mode}-sharded over 2 ranks (rank 1)"
    for name in TREES:
        assert first["ours"][name] == second["ours"][name], name
        assert first["ours"][name] == first["sharded"], name
    assert first["sharded"] == second["sharded"] == first["alone"]
    assert first["sampled"] == second["sampled"]


class PairGroup:
    """Stands in for a group of 2 ranks where only its size is read."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


@pytest.mark.skipif(LAUNCHER is None, reason="mlx.launch is not installed")
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_bench_on_a_sharded_llama_folder(mode, tmp_path):
    """`mlx-redrafter bench --shard MODE` under mlx.launch: load(shard=) from a folder,
    every method (mlx-lm's, plain, the auto tree and a lookup tree) on the sharded
    model, greedy output identical to mlx-lm's; rank 0 alone writes the result."""
    model = _model_folder(tmp_path / "model", "llama")
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"id": str(i), "prompt": " ".join(f"w{(7 * i + j) % 60}" for j in range(6))}
        for i in range(2)
    ]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "bench"
    cli = [sys.executable, "-m", "mlx_redrafter.cli", "bench", "--model", str(model)]
    cli += ["--prompts", str(prompts), "--max-tokens", "12", "--tree", "auto,0x1+1x4"]
    cli += ["--profile-prompts", "0", "--no-plots", "--no-unpacked", "--out", str(out)]
    result = _launch([*cli, "--shard", mode], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "bench.json").is_file(), result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "bench.json").read_text())["summary"]
    assert len(summary) == 4  # mlx-lm, plain, auto, 0x1+1x4
    assert all(method["match_rate"] == 1.0 for method in summary), summary
    assert result.stdout.count("wrote ") == 1  # rank 0 reports, once


@pytest.mark.skipif(LAUNCHER is None, reason="mlx.launch is not installed")
def test_benchmark_methods_on_a_pipeline_sharded_model_folder(tmp_path):
    """Plain steps (mlx-lm's, this loop's), the auto tree and a lookup tree on a
    pipeline-sharded model loaded by `load(shard="pipeline")`: exact, on both ranks."""
    model = _model_folder(tmp_path / "model", "qwen2")
    script = [sys.executable, str(Path(__file__).resolve()), "bench", str(model), str(tmp_path)]
    result = _launch(script, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        assert path.is_file(), result.stdout[-3000:] + result.stderr[-3000:]
        rates = json.loads(path.read_text())
        assert len(rates) == 4 and set(rates.values()) == {1.0}, rates


@pytest.mark.skipif(LAUNCHER is None, reason="mlx.launch is not installed")
def test_serve_on_a_pipeline_sharded_llama(tmp_path):
    """`mlx-redrafter serve --shard pipeline` under mlx.launch: rank 0 serves, rank 1
    decodes in step. Concurrent greedy replies equal one process's decoding of the
    whole model, and a client that leaves mid-stream frees its row on both ranks (a
    later reply is still right, so the ranks never diverged)."""
    from mlx_redrafter import generate, load

    folder = _model_folder(tmp_path / "model", "llama", eos="w63")
    model, _, tokenizer = load(folder)
    # Prompts whose replies run long (no end-of-sequence token early): the comparisons
    # span whole replies, and the dropped stream is still decoding when it is dropped.
    candidates = [" ".join(f"w{(5 * i + j) % 60}" for j in range(7)) for i in range(40)]
    replies = {p: generate(model, None, tokenizer, p, max_tokens=200) for p in candidates}
    prompts = [p for p in candidates if len(tokenizer.encode(replies[p])) >= 150][:3]
    assert len(prompts) == 3
    expected = [generate(model, None, tokenizer, p, max_tokens=12) for p in prompts]
    port = free_ports(1)
    cli = [sys.executable, "-m", "mlx_redrafter.cli", "serve", "--model", str(folder)]
    cli += ["--shard", "pipeline", "--port", str(port), "--max-tokens", "12"]
    server = _start(cli, tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        _wait_for(url.replace("completions", "models"), server)
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda p: _complete(url, p, 12), prompts[:2]))
        assert replies == expected[:2]
        _leave_mid_stream(url, prompts[2])
        assert _complete(url, prompts[2], 12) == expected[2]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        _, errors = server.communicate(timeout=60)
    assert "pipeline-sharded over 2 ranks (rank 0)" in errors, errors[-3000:]


def _start(arguments: list[str], tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "MLX_REDRAFTER_CACHE": str(tmp_path / "cache")}
    command = [str(LAUNCHER), "--backend", "ring", "-n", "2", "--starting-port"]
    command += [str(free_ports(2)), *arguments]
    return subprocess.Popen(
        command, env=env, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True
    )


def _wait_for(url: str, process: subprocess.Popen[str], seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                os.killpg(process.pid, signal.SIGKILL)
                pytest.fail(f"the server did not start\n{process.communicate()[1][-3000:]}")
            time.sleep(0.3)


def _complete(url: str, prompt: str, max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return str(json.load(response)["choices"][0]["text"])


def _leave_mid_stream(url: str, prompt: str) -> None:
    """A streamed request for many tokens that the client drops after its first chunk."""
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.readline().startswith(b"data: ")


def test_an_agenda_reaches_the_other_ranks_whole():
    """What rank 0 sends before a step decodes to the same requests on another rank
    (their updates go nowhere there)."""
    from mlx_redrafter.apps.batcher import Agenda, Job

    from mlx_redrafter.config import SamplingConfig

    job = Job([5, 6, 7], print, SamplingConfig(0.7, 0.9, 20), 33, ("\n\n",), 4, 2, id=11)
    agenda = Agenda([job], cancelled=[3, 9], closed=False)
    received = Agenda.decode(agenda.encode())
    assert [j.spec() for j in received.jobs] == [job.spec()]
    assert received.jobs[0].sampling == job.sampling and received.jobs[0].stop == ("\n\n",)
    assert (received.cancelled, received.closed) == ([3, 9], False)
    # Most steps have nothing to do: nothing to send beyond a zero length.
    assert Agenda([], [], closed=False).encode() == b""
    assert Agenda.decode(b"") == Agenda([], [], closed=False)


def test_a_family_that_cannot_shard_is_named():
    from tiny_models import tiny_model

    from mlx_redrafter.distributed import ShardingError, shard_model

    group = mx.distributed.init()
    with pytest.raises(ShardingError, match="'gemma3_text' cannot be tensor-sharded"):
        shard_model(tiny_model("gemma3_text"), "tensor", group)
    with pytest.raises(ShardingError, match="'gemma3_text' cannot be pipeline-sharded"):
        shard_model(tiny_model("gemma3_text"), "pipeline", group)
    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    with pytest.raises(ShardingError, match="'llama' cannot be pipeline-sharded.*sliding window"):
        shard_model(tiny_model("llama", num_hidden_layers=2, **sliding), "pipeline", group)
    with pytest.raises(ShardingError, match=r"9 attention and 3 key/value heads.*\(3\)"):
        # As SmolLM2-135M: its heads split over 3 ranks, not 2 (a group of 2 is faked).
        shard_model(
            tiny_model("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=36),
            "tensor",
            PairGroup(),
        )
    with pytest.raises(ShardingError, match="this process is alone: start it with mlx.launch"):
        shard_model(tiny_model("llama"), "tensor", group)
    with pytest.raises(ShardingError, match="unknown shard mode 'rows'"):
        shard_model(tiny_model("llama"), "rows", group)


if __name__ == "__main__":
    if sys.argv[1] == "bench":
        _bench_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        _worker(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
