"""The real models the suite uses when their packages are installed, and MT-Bench."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_redrafter.prompts import MT_BENCH, read_prompts


def mt_bench_first_turns(limit: int) -> list[str]:
    """The first turns of the packaged MT-Bench (or MLX_REDRAFTER_DATA's copy)."""
    return [record.messages[-1]["content"] for record in read_prompts(MT_BENCH)][:limit]


def smollm2_path() -> Path:
    from mlx_redrafter.defaults import default_model_path

    try:
        return default_model_path()
    except Exception as error:  # the package is missing: say so, visibly
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {error}")
        raise
