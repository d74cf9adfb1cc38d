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
        and s["share_prefixes"]
        and s["beam_length"] > 1
        and (with_lookup or not s.get("lookup_branches"))
    ]


def speedup_heatmap(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    entries = _speculative(result["summary"], with_lookup=False)  # a W x L grid
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


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [tokens_per_second(result, out_dir / "tokens_per_second.png")]
    if _speculative(result["summary"], with_lookup=False):
        paths.append(speedup_heatmap(result, out_dir / "speedup_heatmap.png"))
    if _speculative(result["summary"], with_lookup=True):
        paths.append(accepted_histogram(result, out_dir / "accepted_histogram.png"))
    return paths
