"""The HTTP load test: its figures, and a short run against mlx_lm.server and this
project's server (each in its own process) on the tiny llama."""

from __future__ import annotations

import json

import pytest
from mlx_redrafter.apps.loadtest import Run, Sample, main, percentile, summarize
from test_chat import save_tiny


def test_percentiles_by_nearest_rank():
    values = [float(v) for v in range(1, 21)]  # 1 .. 20
    assert percentile(values, 0.5) == 10.0
    assert percentile(values, 0.95) == 19.0
    assert percentile([3.0], 0.95) == 3.0
    five, twelve = [1.0, 2.0, 3.0, 4.0, 5.0], [float(v) for v in range(1, 13)]
    assert percentile(five, 0.5) == 3.0  # the 3rd of 5
    assert percentile(twelve, 0.95) == 12.0  # ceil(11.4) = 12th of 12


def test_a_round_is_summarized_over_all_clients():
    run = Run([Sample(2.0, 0.5, 10, 1.5), Sample(4.0, 1.5, 30, 2.5)], errors=1)
    row = summarize("x", 2, run, wall=4.0)
    assert row["tokens_per_second"] == 10.0  # 40 tokens in 4 s of wall-clock
    assert (row["latency_p50"], row["latency_p95"]) == (2.0, 4.0)
    assert (row["first_token_p50"], row["tau"], row["failed"]) == (0.5, 2.0, 1)


def test_a_short_load_test_against_mlx_lm_server(trained_llama, tmp_path, capsys, monkeypatch):
    pytest.importorskip("starlette", reason="the server needs mlx-redrafter[serve]")
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "cache"))  # the servers' calibration
    model, drafter, _ = trained_llama
    model_dir, drafter_dir = save_tiny(model, drafter, tmp_path / "tiny")
    argv = ["--model", str(model_dir), "--drafter", str(drafter_dir), "http"]
    argv += ["--clients", "1,2", "--requests", "1", "--max-tokens", "6", "--against-mlx-lm"]
    argv += ["--time-limit", "600", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "out" / "loadtest.json").read_text())["rounds"]
    servers = [row["server"] for row in rows]
    assert (
        servers
        == ["mlx_lm.server"] * 2 + ["mlx-redrafter, off"] * 2 + ["mlx-redrafter, on, auto"] * 2
    )
    assert [row["clients"] for row in rows] == [1, 2] * 3
    assert all(row["failed"] == 0 and row["requests"] == row["clients"] for row in rows)
    assert all(row["tokens_per_second"] > 0 for row in rows)
    assert "| mlx_lm.server | 2 | 2 |" in capsys.readouterr().out
