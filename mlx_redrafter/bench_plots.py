"""PNG plots of a benchmark result (needs matplotlib: `pip install mlx-redrafter[bench]`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "plots need matplotlib: pip install 'mlx-redrafter[bench]' (or pass --no-plots)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _speculative(summary: list[dict[str, Any]], with_lookup: bool) -> list[dict[str, Any]]:
    """The packed speculative methods (those with lookup branches only if `with_lookup`)."""
    return [
        s
        for s in summary
        if s.get("accepted_histogram")
        and s.get("share_prefixes")
        and (s.get("beam_length") or 0) > 1
        and (with_lookup or not s.get("lookup_branches"))
    ]


def _grid_trees(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fixed drafter trees of a W x L grid (a dynamic tree verifies fewer of its W x L)."""
    return [s for s in _speculative(summary, with_lookup=False) if not s.get("draft_nodes")]


def speedup_heatmap(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    entries = _grid_trees(result["summary"])
    widths = sorted({s["beam_width"] for s in entries})
    lengths = sorted({s["beam_length"] for s in entries})
    grid = [[float("nan")] * len(lengths) for _ in widths]
    for s in entries:
        grid[widths.index(s["beam_width"])][lengths.index(s["beam_length"])] = s["speedup"]
    figure, axes = plt.subplots(figsize=(1.4 * len(lengths) + 2.5, 1.0 * len(widths) + 1.8))
    image = axes.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
    axes.set_xticks(range(len(lengths)), [str(v) for v in lengths])
    axes.set_yticks(range(len(widths)), [str(v) for v in widths])
    axes.set_xlabel("beam length L")
    axes.set_ylabel("beam width W")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                axes.text(j, i, f"{value:.2f}x", ha="center", va="center", color="white")
    figure.colorbar(image, label="speed-up over mlx-lm")
    axes.set_title("Decode speed-up over mlx-lm plain decoding")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def accepted_histogram(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    entries = _speculative(result["summary"], with_lookup=True)
    best = max(entries, key=lambda s: s["speedup"])
    counts = best["accepted_histogram"]
    total = max(sum(counts), 1)
    figure, axes = plt.subplots(figsize=(5, 3.2))
    axes.bar(range(len(counts)), [c / total for c in counts], color="#4477aa")
    axes.set_xlabel("drafted tokens accepted in a step (a step emits one more)")
    axes.set_ylabel("fraction of steps")
    axes.set_title(f"{best['method']}: tau = {best['tau']:.2f}")
    axes.set_xticks(range(len(counts)))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def tokens_per_second(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    names = [s["method"] for s in result["summary"]]
    per_method: dict[str, list[float]] = {name: [] for name in names}
    for run in result["runs"]:
        if run["decode_seconds"] > 0:
            per_method[run["method"]].append(run["decode_tokens"] / run["decode_seconds"])
    means = [s["decode_tps"] for s in result["summary"]]
    spreads = [statistics.pstdev(v) if len(v) > 1 else 0.0 for v in per_method.values()]
    figure, axes = plt.subplots(figsize=(max(5, 1.1 * len(names)), 3.6))
    colors = ["#999999" if n in ("mlx-lm", "plain") else "#228833" for n in names]
    axes.bar(range(len(names)), means, yerr=spreads, color=colors, capsize=3)
    axes.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes.set_ylabel("decode tokens/s (mean over prompts)")
    axes.set_title("Decode speed per method (error bars: spread across prompts)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_load(rows: list[dict[str, Any]], path: Path) -> Path:
    """Throughput and p95 latency by concurrent clients, a line per server (the rounds
    of `python -m mlx_redrafter.apps.loadtest http`)."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for server in dict.fromkeys(row["server"] for row in rows):
        mine = [row for row in rows if row["server"] == server]
        clients = [row["clients"] for row in mine]
        left.plot(clients, [row["tokens_per_second"] for row in mine], marker="o", label=server)
        right.plot(clients, [row["latency_p95"] for row in mine], marker="o", label=server)
    left.set_ylabel("tokens/s, all clients")
    right.set_ylabel("request latency p95 (s)")
    counts = sorted({row["clients"] for row in rows})
    for axes in (left, right):
        axes.set_xlabel("concurrent clients")
        axes.set_xscale("log", base=2)
        axes.set_xticks(counts, [str(c) for c in counts])
        axes.minorticks_off()
    left.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [tokens_per_second(result, out_dir / "tokens_per_second.png")]
    if _grid_trees(result["summary"]):
        paths.append(speedup_heatmap(result, out_dir / "speedup_heatmap.png"))
    if _speculative(result["summary"], with_lookup=True):
        paths.append(accepted_histogram(result, out_dir / "accepted_histogram.png"))
    if any(s.get("by_category") for s in result["summary"]):
        paths.append(category_speedups(result, out_dir / "speedup_by_category.png"))
    if result.get("calibration"):
        paths.append(cost_curve(result["calibration"], out_dir / "cost_curve.png"))
    return paths


def cost_curve(calibration: dict[str, Any], path: Path) -> Path:
    """The calibrated step cost against N packed tokens, as a multiple of one token's,
    one line per context band (`calibrate.Calibration.to_dict()`)."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(5.5, 3.6))
    sizes = calibration["sizes"]
    for context, row in zip(calibration["contexts"], calibration["verify"]):
        axes.plot(sizes, [s / row[0] for s in row], marker="o", label=f"context {context}")
    axes.plot(sizes, sizes, color="#bbbbbb", linestyle="--", label="cost = N x one token")
    axes.set_xlabel("packed tokens N verified in one step")
    axes.set_ylabel("step cost / one-token step")
    key = calibration["key"]
    axes.set_title(
        f"{key['device'][:40]}, {key['dtype'].split('.')[-1]}, q={key['quantization']}", fontsize=9
    )
    axes.set_ylim(bottom=0)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def category_speedups(result: dict[str, Any], path: Path) -> Path:
    """Speed-up over mlx-lm per benchmark category, one bar group per category."""
    plt = _pyplot()
    rows = [s for s in result["summary"] if s.get("by_category") and s["method"] != "mlx-lm"]
    names = list(rows[0]["by_category"])
    figure, axes = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 3.8))
    width = 0.8 / len(rows)
    for i, s in enumerate(rows):
        values = [s["by_category"][n]["speedup"] for n in names]
        axes.bar([j + i * width for j in range(len(names))], values, width, label=s["method"])
    axes.axhline(1.0, color="#555555", linewidth=0.8)
    axes.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, ha="right"
    )
    axes.set_ylabel("speed-up over mlx-lm")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
