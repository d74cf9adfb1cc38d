"""The real models the suite uses when their packages are installed, and MT-Bench."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MLX_REDRAFTER_DATA", REPO.parent / "shared" / "data"))
MT_BENCH = DATA / "eval" / "mt_bench.jsonl"


def mt_bench_first_turns(limit: int) -> list[str]:
    if not MT_BENCH.is_file():
        pytest.skip(f"MT-Bench not found at {MT_BENCH} (set MLX_REDRAFTER_DATA)")
    with MT_BENCH.open() as lines:
        questions = [json.loads(line)["turns"][0] for line in lines if line.strip()]
    return questions[:limit]


def smollm2_path() -> Path:
    from mlx_redrafter.defaults import default_model_path

    try:
        return default_model_path()
    except Exception as error:  # the package is missing: say so, visibly
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {error}")
        raise
