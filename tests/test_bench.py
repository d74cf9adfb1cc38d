"""The benchmark on a tiny model: every figure present, greedy outputs match, plots written."""

import json
import os
import sys
from dataclasses import replace

import mlx.core as mx
import pytest
from tiny_models import tiny_model, tiny_tokenizer

from mlx_redrafter.bench import (
    BenchConfig,
    benchmark_methods,
    environment,
    format_table,
    run_benchmark,
    slow_blas_warning,
    write_result,
)
from mlx_redrafter.bench_plots import write_plots
from mlx_redrafter.calibrate import device_name
from mlx_redrafter.commands.bench import parse_sizes
from mlx_redrafter.commands.common import describe_tree, parse_tree, parse_trees
from mlx_redrafter.config import PLAIN_DECODING, SamplingConfig, TreeConfig
from mlx_redrafter.decode import plan_step
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.prompts import read_prompts


@pytest.fixture(scope="module")
def result(trained_llama):
    model, drafter, prompts = trained_llama
    config = BenchConfig(
        max_tokens=24,
        trees=(
            TreeConfig(3, 3),
            TreeConfig(2, 4),
            TreeConfig(1, 2, lookup_branches=1, lookup_length=4),
            TreeConfig(4, 3, draft_nodes=7),
            "auto",
        ),
        warmup_tokens=4,
        profile_prompts=2,
        batch_sizes=(1, 2),
    )
    categories = ["writing", "coding", "writing"]
    return run_benchmark(
        model, drafter, tiny_tokenizer(), prompts[:3], config, categories=categories
    )


def test_every_method_runs_on_every_prompt(result):
    names = [s["method"] for s in result["summary"]]
    assert names == [
        "mlx-lm",
        "plain",
        "redrafter 3x3",
        "redrafter 3x3 unpacked",
        "redrafter 2x4",
        "redrafter 2x4 unpacked",
        "redrafter 1x2+1x4",
        "redrafter 1x2+1x4 unpacked",
        "redrafter 4x3@7",
        "redrafter auto",
    ]
    assert len(result["runs"]) == 3 * len(names)


def test_dynamic_trees_are_compared_with_fixed_trees_of_equal_size(result):
    """4x3@7 verifies 7 tokens, as 3x3 and 2x4 do (1x2+1x4 has 5, auto none): the
    run reports its tau against each of those two, and the table prints it."""
    tau = {s["tree"]: s["tau"] for s in result["summary"]}
    gains = result["dynamic_trees"]
    assert [(g["dynamic"], g["fixed"], g["num_packed"]) for g in gains] == [
        ("4x3@7", "3x3", 7),
        ("4x3@7", "2x4", 7),
    ]
    for gain in gains:
        assert gain["tau"] == [tau["4x3@7"], tau[gain["fixed"]]]
        assert gain["tau_gain"] == pytest.approx(tau["4x3@7"] / tau[gain["fixed"]])
    assert tau["4x3@7"] > 1.2  # the dynamic tree really accepts drafted tokens
    table = format_table(result)
    assert "dynamic tree against fixed trees of equal N" in table
    assert "4x3@7          vs 3x3" in table


def test_greedy_outputs_match_the_baseline_and_figures_are_sane(result):
    for summary in result["summary"]:
        assert summary["match_rate"] == 1.0, summary["method"]
        assert summary["decode_tps"] > 0 and summary["prefill_tps"] > 0
        assert summary["peak_memory_gb"] > 0
    by_name = {s["method"]: s for s in result["summary"]}
    assert by_name["mlx-lm"]["speedup"] == pytest.approx(1.0)
    assert by_name["plain"]["tau"] == pytest.approx(1.0)
    packed = by_name["redrafter 3x3"]
    assert packed["tau"] > 1.3
    assert len(packed["acceptance_by_depth"]) == 2
    first, second = packed["acceptance_by_depth"]
    assert 1 >= first >= second >= 0
    assert 0 < packed["tree_compression"] <= 7 / 9  # the root is always shared
    assert by_name["redrafter 3x3 unpacked"]["tree_compression"] == pytest.approx(1.0)
    split = packed["time_split"]
    assert set(split) == {"draft", "verify", "other"}
    assert sum(split.values()) == pytest.approx(1.0)
    assert sum(packed["accepted_histogram"]) > 0
    lookup = by_name["redrafter 1x2+1x4"]
    assert lookup["lookup_branches"] == 1 and lookup["lookup_length"] == 4
    assert lookup["tau"] > 1.3
    # Positions 1-3: the lookup branch is longer than the drafter's.
    assert len(lookup["acceptance_by_depth"]) == 3
    assert len(lookup["accepted_histogram"]) == 4
    assert 0 < lookup["tree_compression"] <= 5 / 6  # N = 5 of 2 + 4


def test_tau_is_reported_per_category(result):
    assert result["config"]["categories"] == ["writing", "coding", "writing"]
    runs = result["runs"]
    for summary in result["summary"]:
        mine = [r for r in runs if r["method"] == summary["method"]]
        baseline = [r for r in runs if r["method"] == "mlx-lm"]
        by_category = summary["by_category"]
        assert list(by_category) == ["writing", "coding"]
        for category, prompts in (("writing", (0, 2)), ("coding", (1,))):
            chosen = [r for r in mine if r["prompt"] in prompts]
            expected = sum(r["produced_tokens"] for r in chosen) / sum(r["steps"] for r in chosen)
            assert by_category[category]["tau"] == pytest.approx(expected)
            base = [r for r in baseline if r["prompt"] in prompts]
            speed = sum(r["decode_tokens"] / r["decode_seconds"] for r in chosen) / len(chosen)
            base_speed = sum(r["decode_tokens"] / r["decode_seconds"] for r in base) / len(base)
            assert by_category[category]["speedup"] == pytest.approx(speed / base_speed)
        if summary["method"] == "plain":
            assert [c["tau"] for c in by_category.values()] == [1.0, 1.0]
            assert {c["tree"] for c in by_category.values()} == {"1x1"}
    assert "speed-up / tau by category" in format_table(result)
    with pytest.raises(ValueError, match="2 categories for 3 prompts"):
        model = None
        run_benchmark(model, None, None, [[1], [2], [3]], BenchConfig(), categories=["a", "b"])


def test_batch_sweep_reports_throughput(result):
    sweep = result["batch_sweep"]
    assert [row["batch_size"] for row in sweep] == [1, 2]
    for row in sweep:
        assert row["mlx_lm_tps"] > 0 and row["redrafter_tps"] > 0 and row["plain_tps"] > 0


def test_outputs_json_table_and_plots(result, tmp_path):
    path = write_result(result, tmp_path)
    loaded = json.loads(path.read_text())
    assert loaded["environment"]["device"] and "mlx" in loaded["environment"]
    table = format_table(result)
    assert "redrafter 2x4 unpacked" in table and "batch" in table
    plots = write_plots(result, tmp_path)
    assert sorted(p.name for p in plots) == [
        "accepted_histogram.png",
        "cost_curve.png",
        "speedup_by_category.png",
        "speedup_heatmap.png",
        "tokens_per_second.png",
    ]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in plots)


def test_the_auto_tree_reports_the_trees_it_used(result):
    auto = next(s for s in result["summary"] if s["method"] == "redrafter auto")
    assert auto["tree"] == "auto" and auto["beam_width"] is None
    steps = sum(r["steps"] for r in result["runs"] if r["method"] == "redrafter auto")
    assert sum(auto["trees_used"].values()) == steps
    assert all(c["tree"] in auto["trees_used"] for c in auto["by_category"].values())
    assert result["calibration"]["sizes"][0] == 1


def test_environment_and_slow_blas_warning():
    env = environment()
    assert env["matmul_gflops_fp32"] > 0
    assert env["device_name"] == device_name()  # the machine's model, as calibrations key it
    if sys.platform == "linux" and env["backend"] == "cpu":
        assert env["device_name"].endswith(f":{os.cpu_count()} cores")
    preloaded = os.environ.get("LD_PRELOAD", "")
    if sys.platform == "linux" and "sgemm_router" in preloaded:
        # The router's two libraries are loaded once a matmul has run.
        assert any("scipy_openblas" in path for path in env["blas_libraries"])
        assert any("libopenblas" in path for path in env["blas_libraries"])
    elif sys.platform == "linux" and "openblas" in preloaded:
        assert any("libopenblas" in path for path in env["blas_libraries"])
    assert all(name.startswith(("OPENBLAS_", "MLX_REDRAFTER_")) for name in env["blas_settings"])
    assert slow_blas_warning({**env, "slow_blas": True}).startswith("WARNING")
    assert slow_blas_warning({**env, "slow_blas": False}) is None


def test_the_tree_a_session_decodes_with_and_how_commands_name_it():
    drafter = Drafter.create(tiny_model("llama"))
    lookup_only = TreeConfig.parse("0x5+1:text")
    # Without a drafter, drafter beams drop out and lookup branches stay.
    assert plan_step(TreeConfig(2, 2), has_drafter=False).plain
    kept = plan_step(TreeConfig.parse("1x2+1x7"), has_drafter=False)
    assert kept.tree == TreeConfig.parse("0x1+1x7") == TreeConfig.parse("1x2+1x7").lookup_only
    assert not kept.drafts and kept.lookup_branches == 1 and kept.num_packed == 7
    assert TreeConfig(2, 2).lookup_only == PLAIN_DECODING
    assert describe_tree(None, TreeConfig.parse("1x2+1x7")).startswith("ReDrafter 0x1+1x7 ")
    asked = BenchConfig(trees=(TreeConfig(2, 3), TreeConfig.parse("1x2+1x7")), without_drafter=True)
    names = [method.name for method in benchmark_methods(asked, has_drafter=True)]
    assert "redrafter 2x3 no drafter" not in names  # plain decoding, measured as "plain"
    assert "redrafter 1x2+1x7 no drafter" in names
    assert lookup_only.lookup_only == lookup_only
    only = plan_step(lookup_only, has_drafter=False)
    assert not only.plain and not only.drafts and only.lookup_branches == 1
    assert only.num_packed == 5 and not only.lookup_table and only.depth == 5
    with_drafter = plan_step(TreeConfig(2, 2), has_drafter=True)
    assert with_drafter.drafts and with_drafter.num_packed == 3 and with_drafter.depth == 2
    assert plan_step(PLAIN_DECODING, has_drafter=True).plain
    assert describe_tree(None, TreeConfig(2, 2)) == "plain decoding"
    assert describe_tree(drafter, PLAIN_DECODING) == "plain decoding"
    assert describe_tree(None, lookup_only).startswith("ReDrafter 0x5+1:text ")
    assert describe_tree(drafter, TreeConfig(2, 2)).startswith("ReDrafter 2x2 ")


def test_argument_parsing_and_prompt_files(tmp_path):
    assert parse_trees("4x4,2x5") == (TreeConfig(4, 4), TreeConfig(2, 5))
    with pytest.raises(ValueError, match="WxL"):
        parse_trees("4by4")
    with pytest.raises(ValueError):
        parse_trees("0x4")
    assert parse_trees("1x3+1,0x4+2,1x2+1x6") == (
        TreeConfig(1, 3, lookup_branches=1),
        TreeConfig(0, 4, lookup_branches=2),
        TreeConfig(1, 2, lookup_branches=1, lookup_length=6),
    )
    assert parse_tree("1x2+1x7") == TreeConfig(1, 2, lookup_branches=1, lookup_length=7)
    with pytest.raises(ValueError, match="--tree takes one tree"):
        parse_tree("1x2+1x7,2x2")
    with pytest.raises(ValueError, match="^--tau-trees: '4by4'"):
        parse_trees("4by4", "--tau-trees")
    assert parse_sizes("1,2,4") == (1, 2, 4)
    file = tmp_path / "p.jsonl"
    file.write_text(
        '{"prompt": "a"}\n{"turns": ["b", "c"], "category": "math"}\nnot json\n{"x": 1}\n'
    )
    warnings: list[str] = []
    records = read_prompts(file, warn=warnings.append)
    assert [r.messages for r in records] == [
        [{"role": "user", "content": "a"}],
        [{"role": "user", "content": "b"}],
    ]
    assert [r.source for r in records] == ["", "math"]  # MT-Bench's category is the source
    assert [w.split(": ")[0] for w in warnings] == [f"{file}:3", f"{file}:4"]
    with pytest.raises(ValueError, match=":3:"):
        read_prompts(file, strict=True)


def test_each_tree_also_runs_without_the_drafter_when_asked(trained_llama):
    """--also-no-drafter: the same tree with its lookup branches alone, in the same run;
    the drafter's beams are what tell the two apart."""
    model, drafter, prompts = trained_llama
    config = BenchConfig(
        max_tokens=16,
        trees=(TreeConfig(2, 3, lookup_branches=1, lookup_length=3), "auto"),
        unpacked=False,
        warmup_tokens=4,
        profile_prompts=0,
        without_drafter=True,
    )
    result = run_benchmark(model, drafter, tiny_tokenizer(), prompts[:2], config)
    rows = {s["method"]: s for s in result["summary"]}
    assert list(rows) == [
        "mlx-lm",
        "plain",
        "redrafter 2x3+1 no drafter",
        "redrafter 2x3+1",
        "redrafter auto no drafter",
        "redrafter auto",
    ]
    assert all(row["match_rate"] == 1.0 for row in rows.values())
    assert rows["redrafter 2x3+1"]["tau"] > rows["redrafter 2x3+1 no drafter"]["tau"]
    fixed = [r for r in result["runs"] if r["method"] == "redrafter 2x3+1 no drafter"]
    sizes = [size for run in fixed for size in run["tree_sizes"]]
    assert max(sizes) == 3 and all(size <= 3 for size in sizes)  # the branch, no beams
    assert all(set(run["trees_used"]) <= {"0x1+1x3", "1x1"} for run in fixed)


def test_ignore_eos_decodes_every_method_to_max_tokens(trained_llama):
    """--ignore-eos: every method, mlx-lm's included, runs to max_tokens (equal work),
    even when the EOS token is the first one chosen; the caller's tokenizer keeps its
    EOS, which still ends replies without the flag."""
    model, drafter, prompts = trained_llama
    first = int(mx.argmax(model(mx.array([prompts[0]]))[0, -1]).item())
    tokenizer = tiny_tokenizer()
    tokenizer.eos_token_ids = [first]  # the greedy reply to prompt 0 ends at once
    config = BenchConfig(
        max_tokens=12,
        trees=(TreeConfig(2, 3),),
        unpacked=False,
        warmup_tokens=4,
        profile_prompts=0,
    )
    ended = run_benchmark(model, drafter, tokenizer, prompts[:1], config)
    assert all(len(run["tokens"]) == 0 for run in ended["runs"])
    config = replace(config, ignore_eos=True, sampling=SamplingConfig(temperature=1.0))
    result = run_benchmark(model, drafter, tokenizer, prompts[:2], config)
    assert {run["method"] for run in result["runs"]} == {"mlx-lm", "plain", "redrafter 2x3"}
    assert all(len(run["tokens"]) == 12 for run in result["runs"])
    assert result["config"]["ignore_eos"] is True
    assert set(tokenizer.eos_token_ids) == {first}


def test_repeats_keep_each_methods_fastest_run_of_a_prompt(trained_llama, monkeypatch):
    """--repeats R: every method runs R times on each prompt, in rounds over the
    methods, and its fastest run (per token) counts, whichever round it came in;
    greedy replies still match mlx-lm's, every repeat of them."""
    from mlx_redrafter import bench as bench_module

    model, drafter, prompts = trained_llama
    real = bench_module.run_method
    calls: list[tuple[str, int]] = []
    slow = {("plain", 0): 2, ("redrafter 2x3", 1): 1}  # a slow spell hits this repeat

    def timed(method, *args):
        run = real(method, *args)
        key = (method.name, run.prompt)
        calls.append(key)
        if run.prompt >= 0 and slow.get(key) == sum(c == key for c in calls):
            run.decode_seconds += 5.0
        return run

    monkeypatch.setattr(bench_module, "run_method", timed)
    config = BenchConfig(
        max_tokens=8,
        trees=(TreeConfig(2, 3),),
        unpacked=False,
        warmup_tokens=4,
        profile_prompts=0,
        repeats=2,
    )
    result = run_benchmark(model, drafter, tiny_tokenizer(), prompts[:2], config)
    names = ["mlx-lm", "plain", "redrafter 2x3"]
    measured = [c for c in calls if c[1] >= 0]  # warm-up runs are prompt -1
    assert measured == [(n, p) for p in (0, 1) for _ in range(2) for n in names]
    assert len(result["runs"]) == 2 * len(names) and result["config"]["repeats"] == 2
    assert all(r["decode_seconds"] < 5.0 for r in result["runs"])  # no slow run counted
    assert all(r["matches_baseline"] for r in result["runs"])
    with pytest.raises(ValueError, match="repeats"):
        BenchConfig(repeats=0)
