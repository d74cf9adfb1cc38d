"""The drafter card, DIR/README.md: what `make-drafter` made, from what, how well, and
the commands that reproduce it. Every figure is read from the run's own records
(work/train/report.json, work/evaluation.json, work/recipe.json)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from .recipe import Prompts, Recipe, Run, Target


def _read(run: Run, name: str) -> dict[str, Any]:
    return dict(json.loads((run.work / name).read_text()))


def drafter_card(run: Run, recipe: Recipe, target: Target, prompts: Prompts) -> str:
    """The card's Markdown text."""
    from ..fingerprint import target_fingerprint

    report = _read(run, "train/report.json")
    evaluation = _read(run, "evaluation.json")
    fingerprint = target_fingerprint(target.model, target.tokenizer)
    sections = [
        f"# ReDrafter drafter for {target.name}\n",
        "A recurrent drafter for mlx-redrafter (ReDrafter speculative decoding on MLX), "
        "made by `mlx-redrafter make-drafter`. Decoding with it is lossless: the target "
        "verifies every drafted token, so greedy output is the target's own.\n",
        _use(target, run),
        _base(target, fingerprint.describe(), fingerprint.tokenizer),
        _data(report, recipe, prompts),
        _recipe(report, recipe),
        _metrics(report, evaluation),
        _reproduce(target, run, recipe, prompts, report),
        _license(target),
    ]
    return "\n".join(sections)


def _use(target: Target, run: Run) -> str:
    # Names on lines of their own: the call stays one short line under any formatter.
    return (
        "## Use\n\n```python\nimport mlx_redrafter\n\n"
        f'model_name = "{target.name}"\ndrafter_folder = "{run.output}"\n'
        "model, drafter, tokenizer = mlx_redrafter.load(model_name, drafter=drafter_folder)\n"
        f"```\n\nor `mlx-redrafter generate --model {target.name} --drafter {run.output} "
        "--prompt ...`. Placed in a `drafter/` folder inside the model's folder, "
        "`load(model)` finds it by itself (matched by `target.json`).\n"
    )


def _base(target: Target, description: str, tokenizer: str) -> str:
    return (
        "## Base model\n\n"
        f"- model: `{target.name}`\n- architecture: {description}\n"
        f"- tokenizer vocabulary SHA-256: `{tokenizer}`\n"
        "- `target.json` holds this fingerprint and a probe of the embedding weights; a "
        "model with other weights or another tokenizer refuses this drafter.\n"
    )


def _data(report: dict[str, Any], recipe: Recipe, prompts: Prompts) -> str:
    data = report["data"]
    wanted = prompts.train[: recipe.records]
    sources = Counter(r.source or "-" for r in wanted)
    mix = ", ".join(f"{name} {count}" for name, count in sources.most_common())
    coverage = data.get("draft_vocab_coverage")
    lines = [
        "## Data\n",
        f"- prompts: {prompts.label}; {data['records']} answered by the model itself "
        f"(greedy, up to {recipe.max_tokens} tokens each): {data['reply_tokens']} reply tokens",
        f"- prompt mix of the distilled records: {mix}",
        f"- held out: {len(prompts.held_out)} prompts never distilled (`eval_prompts.jsonl`), "
        f"and {recipe.train.validation_fraction:.0%} of the distilled records for validation",
    ]
    if coverage is not None:
        lines.append(f"- the draft vocabulary covers {coverage:.1%} of the replies' tokens")
    return "\n".join(lines) + "\n"


def _recipe(report: dict[str, Any], recipe: Recipe) -> str:
    drafter = report["drafter"]
    train = report["train"]
    config = report["train"]["config"]
    lines = [
        "## Recipe\n",
        f"- drafter: {drafter['num_draft_layers']} layers, input projection to "
        f"{drafter['exit_dim']}, draft vocabulary "
        f"{drafter.get('draft_vocab_size') or drafter['vocab_size']} tokens, "
        f"K = {config['num_steps']} draft steps (beams up to L = {config['num_steps'] + 1})",
        f"- training: {report['steps']} steps of {config['batch_size']} sequences "
        f"({config['epochs']:g} epochs), AdamW lr {config['learning_rate']:g} with warm-up "
        f"and cosine decay, seed {config['seed']}; {train['positions_per_second']:.0f} "
        "positions/s",
        f"- n-gram table: {report['ngrams']['entries']} n-grams (n <= "
        f"{report['ngrams']['order']}) of the training replies, for lookup branches",
    ]
    if recipe.budget_seconds:
        rates = ", ".join(f"{k} {v:.3g}" for k, v in recipe.rates.items())
        lines.append(
            f"- sized for a time budget of {recipe.budget_seconds / 60:.0f} min from a "
            f"measurement of this machine ({rates})"
        )
    return "\n".join(lines) + "\n"


def _depths(row: list[float]) -> str:
    """One acceptance row, depth by depth: "0.66 / 0.40 / ..."."""
    return " / ".join(f"{p:.2f}" for p in row)


def _metrics(report: dict[str, Any], evaluation: dict[str, Any]) -> str:
    lines = ["## Metrics\n"]
    if report.get("validation"):
        last = report["validation"][-1]
        accuracy = " / ".join(f"{a:.3f}" for a in last["accuracy"])
        lines.append(
            f"- validation top-1 accuracy per draft step ({last['positions']} positions): "
            f"{accuracy}"
        )
    acceptance = evaluation["acceptance"]
    if acceptance["beams"]:
        lines.append(
            f"- acceptance per depth, one beam (share of steps accepting d drafted tokens, "
            f"d = 1, 2, ...): {_depths(acceptance['beams'][0])} ({acceptance['steps']} "
            f"steps of the tree {acceptance['source'].rsplit('tree ', 1)[-1]})"
        )
    if acceptance.get("alone"):
        lines.append(
            f"- acceptance per depth, one lookup branch in trees without beams (the "
            f"measuring tree's lookup branches alone, the n-gram table included): "
            f"{_depths(acceptance['alone'][0])}"
        )
    bench = evaluation["bench"]
    env = bench["environment"]
    machine = env.get("device_name") or f"{env['backend']}, {env['cpu_count']} cores"
    lines += [
        "",
        f"Held-out prompts, {bench['config']['prompts']} x {bench['config']['max_tokens']} "
        f"tokens, greedy, one process ({machine}, MLX "
        f"{env['mlx']}, mlx-lm {env['mlx_lm']}; BLAS: "
        f"{'preloaded ' + env['ld_preload'] if env['ld_preload'] else 'MLX default'}; "
        f"fp32 matmul {env['matmul_gflops_fp32']} GFLOP/s):",
        "",
        "| method | tok/s | speed-up vs mlx-lm | tau | greedy match |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in bench["summary"]:
        match = "-" if row["match_rate"] is None else f"{row['match_rate']:.0%}"
        lines.append(
            f"| {row['method']} | {row['decode_tps']:.1f} | {row['speedup']:.2f}x | "
            f"{row['tau']:.2f} | {match} |"
        )
    return "\n".join(lines) + "\n"


def recipe_flags(recipe: Recipe) -> str:
    """The make-drafter options that give exactly this recipe (no time budget needed)."""
    return (
        f"--records {recipe.records} --max-tokens {recipe.max_tokens} --epochs "
        f"{recipe.train.epochs:g} --draft-vocab {recipe.draft_vocab} --seed {recipe.seed} "
        f"--eval-prompts {recipe.eval_prompts} --eval-max-tokens {recipe.eval_max_tokens}"
    )


def _reproduce(
    target: Target, run: Run, recipe: Recipe, prompts: Prompts, report: dict[str, Any]
) -> str:
    source = "" if prompts.label == "built-in prompts" else f" --prompts {prompts.label}"
    records = int(report.get("data", {}).get("records", recipe.records))
    copy = ""
    budget = ""
    if recipe.budget_seconds:
        budget = " (a --time-budget run is written out here as the recipe its measurement chose)"
    if records > recipe.records:
        # Replies distilled by earlier runs into this folder were used too.
        copy = "mkdir -p NEW_FOLDER/work && cp -r DISTILLED NEW_FOLDER/work/distilled\n"
    text = (
        "## Reproduce\n\n```bash\n"
        f"{copy}mlx-redrafter make-drafter {target.name} --output NEW_FOLDER{source} \\\n"
        f"    {recipe_flags(recipe)}\n"
        f"mlx-redrafter bench --model {target.name} --drafter {run.output} "
        f"--prompts {run.output}/eval_prompts.jsonl --max-tokens {recipe.eval_max_tokens} "
        "--tree auto --also-no-drafter --no-unpacked --profile-prompts 0\n```\n\n"
        "The make-drafter command makes the same drafter bit for bit on a machine of the "
        f"same kind{budget}. The bench command measures the speed figures again "
        "(timings vary with the machine and its load).\n"
    )
    if copy:
        text += (
            f"\nThe drafter was trained on {records} distilled replies, more than the "
            f"{recipe.records} that `--records` asks for: the folder held replies an earlier, "
            "longer run had distilled, and a run uses every reply it finds. DISTILLED is "
            "that set of replies (this run's `work/distilled`); with it in place, the "
            "command distils only what is missing and trains on the same data.\n"
        )
    return text


def _license(target: Target) -> str:
    return (
        "## License\n\n"
        f"The drafter is trained on {target.name}'s own outputs: use it under that model's "
        "license. The built-in prompts are MIT (GSM8K, GPTeacher) and Apache-2.0 "
        "(Self-Instruct); see mlx_redrafter/data/README.md.\n"
    )
