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
import socket
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import mlx.core as mx
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

MAX_TOKENS = 24
# A drafter-less tree, a drafter tree with a lookup branch, and the auto tree (its
# choices come from timings, which must agree across ranks).
TREES = {"plain": "1x1", "lookup": "0x1+2x4", "beams": "2x3+1x4", "auto": "auto"}


def _worker(mode: str, out: Path) -> None:
    from conftest import decode_tokens, mlx_lm_greedy, random_prompts
    from mlx_lm.generate import generation_stream
    from tiny_models import tiny_model

    from mlx_redrafter.config import SamplingConfig
    from mlx_redrafter.distributed import shard_model, sharding_label
    from mlx_redrafter.drafter import Drafter
    from mlx_redrafter.target import prepare_target

    group = mx.distributed.init()
    prompts = random_prompts(3, seed=5)
    whole = tiny_model("qwen2")
    alone = [mlx_lm_greedy(whole, p, MAX_TOKENS) for p in prompts]
    model = shard_model(tiny_model("qwen2"), mode, group)
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


def _model_folder(folder: Path, family: str) -> Path:
    """A tiny model folder of `family` that `mlx_redrafter.load` opens."""
    import mlx_lm.utils
    from tiny_models import _COMMON, FAMILY_CONFIGS, tiny_model, tiny_tokenizer

    folder.mkdir(parents=True)
    mlx_lm.utils.save_model(folder, tiny_model(family))
    mlx_lm.utils.save_config({**_COMMON, **FAMILY_CONFIGS[family]}, folder / "config.json")
    tiny_tokenizer(eos_token="w20")._tokenizer.save_pretrained(str(folder))
    return folder


def _launch(arguments: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
        "MLX_REDRAFTER_CACHE": str(tmp_path / "cache"),
    }
    command = [str(LAUNCHER), "--backend", "ring", "-n", "2", "--starting-port"]
    command += [str(_free_port()), *arguments]
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# mlx.launch is installed next to this interpreter (a venv need not be on PATH).
LAUNCHER = shutil.which(
    "mlx.launch", path=os.pathsep.join([sys.prefix + "/bin", os.environ.get("PATH", "")])
)


@pytest.mark.skipif(LAUNCHER is None, reason="mlx.launch is not installed")
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_two_ranks_decode_like_one_process_and_mlx_lm_sharded(mode, tmp_path):
    result = _launch([sys.executable, str(Path(__file__).resolve()), mode, str(tmp_path)], tmp_path)
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
def test_bench_on_a_tensor_sharded_model_folder(tmp_path):
    """`mlx-redrafter bench --shard tensor` under mlx.launch: load(shard=) from a folder,
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
    result = _launch([*cli, "--shard", "tensor"], tmp_path)
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


def test_a_family_that_cannot_shard_is_named():
    from tiny_models import tiny_model

    from mlx_redrafter.distributed import ShardingError, shard_model

    group = mx.distributed.init()
    with pytest.raises(ShardingError, match="'gemma3_text' cannot be tensor-sharded"):
        shard_model(tiny_model("gemma3_text"), "tensor", group)
    with pytest.raises(ShardingError, match="'llama' cannot be pipeline-sharded"):
        shard_model(tiny_model("llama"), "pipeline", group)
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
        _worker(sys.argv[1], Path(sys.argv[2]))
