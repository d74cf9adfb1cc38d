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
    argv += ["--clients", "1,2", "--requests", "1", "--repeats", "2", "--max-tokens", "6"]
    argv += ["--against-mlx-lm"]
    argv += ["--time-limit", "600", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "out" / "loadtest.json").read_text())["rounds"]
    servers = [row["server"] for row in rows]
    names = ["mlx_lm.server", "mlx-redrafter, off", "mlx-redrafter, on, auto"]
    assert servers == names * 2  # every server at 1 client, then at 2
    assert [row["clients"] for row in rows] == [1] * 3 + [2] * 3
    # Two interleaved rounds per server and number of clients, one request per client each.
    assert all(row["failed"] == 0 and row["requests"] == 2 * row["clients"] for row in rows)
    assert all(row["tokens_per_second"] > 0 for row in rows)
    assert "| mlx_lm.server | 2 | 4 |" in capsys.readouterr().out


def test_step_costs_include_plain_and_mlx_lm_batched_decoding(trained_llama, tmp_path, capsys):
    model, drafter, _ = trained_llama
    model_dir, drafter_dir = save_tiny(model, drafter, tmp_path / "tiny")
    argv = ["--model", str(model_dir), "--drafter", str(drafter_dir), "steps"]
    assert main(argv + ["--batch", "1,2", "--tree", "2x2", "--steps", "2"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    names = [line.split(" | ")[1] for line in table[2:]]
    assert names == ["plain", "2x2", "mlx-lm BatchGenerator"] * 2  # plain added for the ratio
    cells = [line.split(" | ") for line in table[2:]]
    assert all(float(cell[2].split()[0]) > 0 for cell in cells)  # median ms
    assert [cell[3] for cell in cells if cell[1] == "plain"] == ["1.00, 1.00 |"] * 2


def test_stall_times_a_short_request_arriving_during_a_long_prefill(
    trained_llama, tmp_path, capsys
):
    model, drafter, _ = trained_llama
    model_dir, drafter_dir = save_tiny(model, drafter, tmp_path / "tiny")
    argv = ["--model", str(model_dir), "--drafter", str(drafter_dir), "stall"]
    argv += ["--prompt-tokens", "200", "--arrival", "0.5", "--prefill-latency", "1e-6"]
    assert main(argv) == 0  # the smallest chunk, 64 tokens: 4 chunks
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    rows = [row for row in rows if row[0] == "| 200"]
    assert [row[1] for row in rows] == ["whole", "chunks of 64"]
    # Seconds, in ms: a tiny model's pauses may round to 0, its prefill does not.
    assert all(float(value.strip(" |")) >= 0 for row in rows for value in row[2:])
    assert all(float(row[-1].strip(" |")) > 0 for row in rows)


def test_bad_input_gets_an_error_not_a_traceback(trained_llama, tmp_path, capsys):
    model, drafter, _ = trained_llama
    model_dir, _ = save_tiny(model, drafter, tmp_path / "tiny")
    assert main(["--model", str(model_dir), "steps", "--tree", "0x0"]) == 2
    assert "loadtest: error: a tree needs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(model_dir), "stall", "--arrival", "2"])
