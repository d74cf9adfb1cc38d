"""Data-parallel training: 2 processes over MLX's ring backend (loopback) end with
identical weights, equal bit for bit to one process training on the same global batch.

Run as a script, this file is the worker `mlx.launch` starts on each rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from ports import free_ports  # noqa: E402

BATCH, MICRO = 8, 4  # global batch of 8 sequences: 2 micro-batches of 4


def _setup():
    from conftest import decode_tokens
    from tiny_models import tiny_model

    from mlx_redrafter.config import TreeConfig
    from mlx_redrafter.drafter import Drafter
    from mlx_redrafter.target import prepare_target
    from mlx_redrafter.training import TrainConfig, TrainingSequence

    model = prepare_target(tiny_model("llama"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, size=int(rng.integers(3, 8))).tolist() for _ in range(40)]
    outputs, _ = decode_tokens(model, None, prompts, TreeConfig(1, 1), 24)
    sequences = [TrainingSequence(p + o, len(p)) for p, o in zip(prompts, outputs)]
    ids = [f"seq-{i}" for i in range(len(sequences))]
    mx.random.seed(0)
    drafter = Drafter.create(model, exit_dim=24, draft_vocab_ids=list(range(0, 64, 2)))
    config = TrainConfig(
        num_steps=3,
        batch_size=BATCH,
        micro_batch_size=MICRO,
        epochs=3,
        learning_rate=3e-3,
        validation_fraction=0.1,
        checkpoint_every=0,
        kl_weight=0.3,
    )
    return model, drafter, sequences, ids, config


def _train_and_save(out: Path, group) -> None:
    from mlx.utils import tree_flatten

    from mlx_redrafter.training import train

    model, drafter, sequences, ids, config = _setup()
    rank = 0 if group is None else group.rank()
    report = train(
        model,
        drafter,
        sequences,
        ids,
        config,
        group=group,
        progress=False,
        checkpoint_dir=out / "checkpoints",
    )
    weights = dict(tree_flatten(drafter.parameters()))
    mx.save_safetensors(str(out / f"rank{rank}.safetensors"), weights)
    (out / f"rank{rank}.loss").write_text(repr(report.train_loss))


def _load(path: Path) -> dict[str, np.ndarray]:
    loaded = cast(dict[str, mx.array], mx.load(str(path)))
    return {k: np.array(v) for k, v in loaded.items()}


# mlx.launch is installed next to this interpreter (a venv need not be on PATH).
LAUNCHER = shutil.which(
    "mlx.launch", path=os.pathsep.join([sys.prefix + "/bin", os.environ.get("PATH", "")])
)


@pytest.mark.skipif(LAUNCHER is None, reason="mlx.launch is not installed")
def test_two_ranks_match_one_process(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir()
    multi.mkdir()
    _train_and_save(single, None)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    command = [
        str(LAUNCHER),
        "--backend",
        "ring",
        "-n",
        "2",
        "--starting-port",
        str(free_ports(2)),
        sys.executable,
        str(Path(__file__).resolve()),
        str(multi),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    # mlx.launch exits 0 even when a rank fails, so check the ranks' outputs too.
    assert result.returncode == 0, result.stderr[-3000:]
    assert (multi / "rank1.safetensors").is_file(), result.stdout[-3000:] + result.stderr[-3000:]

    rank0, rank1 = _load(multi / "rank0.safetensors"), _load(multi / "rank1.safetensors")
    alone = _load(single / "rank0.safetensors")
    assert rank0.keys() == rank1.keys() == alone.keys()
    for name in alone:
        assert np.array_equal(rank0[name], rank1[name]), name
        assert np.array_equal(rank0[name], alone[name]), name
    assert (multi / "rank0.loss").read_text() == (single / "rank0.loss").read_text()
    # Only rank 0 writes checkpoints, and it wrote the final one.
    assert (multi / "checkpoints" / "LATEST").is_file()


if __name__ == "__main__":
    _group = mx.distributed.init()
    _train_and_save(Path(sys.argv[1]), _group if _group.size() > 1 else None)
