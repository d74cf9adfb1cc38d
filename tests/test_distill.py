"""Self-distillation: prompt files, batched decoding into shards, resuming, bad input."""

from __future__ import annotations

import json
import stat

import mlx.core as mx
import numpy as np
import pytest
from conftest import mlx_lm_greedy
from tiny_models import tiny_model, tiny_tokenizer

from mlx_redrafter import distill as distill_module
from mlx_redrafter.cli import main
from mlx_redrafter.config import TreeConfig
from mlx_redrafter.distill import (
    DistillConfig,
    balanced_order,
    distill,
    length_batches,
    load_distilled,
    shard_paths,
)
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.prompts import PromptRecord, read_prompts
from mlx_redrafter.session import DecodingSession
from mlx_redrafter.target import prepare_target

EOS = 20  # the tiny target emits it in some replies


@pytest.fixture(scope="module")
def target():
    model = prepare_target(tiny_model("llama"))
    return model, tiny_tokenizer(eos_token=f"w{EOS}")


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def prompt_file(tmp_path, count=10):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(count):
        words = " ".join(f"w{t}" for t in rng.integers(8, 64, size=int(rng.integers(2, 7))))
        lines.append(json.dumps({"id": f"p{i}", "source": "a" if i % 3 else "b", "prompt": words}))
    return write_jsonl(tmp_path / "prompts.jsonl", lines)


def test_bad_lines_are_reported_with_their_numbers_and_skipped(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "hello"}),
            "",
            "{not json",
            json.dumps({"prompt": ""}),
            json.dumps({"text": "no prompt field"}),
            json.dumps(
                {
                    "id": "conv",
                    "conversations": [
                        {"from": "system", "value": "Be brief."},
                        {"from": "human", "value": "Hi there"},
                        {"from": "gpt", "value": "Hello"},
                        {"from": "human", "value": "second turn"},
                    ],
                }
            ),
            json.dumps({"question_id": 81, "turns": ["first", "second"]}),
        ],
    )
    warnings: list[str] = []
    records = read_prompts(path, warn=warnings.append)
    assert [r.id for r in records] == ["line-1", "conv", "81"]
    assert records[1].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert records[2].messages == [{"role": "user", "content": "first"}]
    assert [w.split(": ")[0].rsplit(":", 1)[1] for w in warnings] == ["2", "3", "4", "5"]
    assert "empty line" in warnings[0] and "invalid JSON" in warnings[1]
    with pytest.raises(ValueError, match=r"p\.jsonl:2: empty line \(--strict\)"):
        read_prompts(path, strict=True)


def test_balanced_order_follows_the_weights():
    records = [PromptRecord(f"m{i}", "math", []) for i in range(60)]
    records += [PromptRecord(f"r{i}", "roleplay", []) for i in range(20)]
    order = balanced_order(records, {"math": 1, "roleplay": 3})
    first = [r.source for r in order[:20]]
    assert first.count("roleplay") == 15 and first.count("math") == 5
    assert sorted(r.id for r in order) == sorted(r.id for r in records)  # nothing lost
    assert [r.id for r in balanced_order(records, {"roleplay": 0})] == [
        r.id for r in balanced_order(records, {"roleplay": 0})
    ]
    assert all(r.source == "math" for r in balanced_order(records, {"roleplay": 0}))


def test_length_batches_sort_within_windows_and_keep_the_order_across_them():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4, 6, 0]
    assert length_batches(lengths, 3, 1) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    batches = length_batches(lengths, 2, 2)  # windows of 4: positions 0-3, 4-7, 8-9
    assert batches == [[1, 3], [0, 2], [5, 7], [4, 6], [9, 8]]
    assert sorted(i for rows in batches for i in rows) == list(range(10))

    # Padding (every row prefilled to its batch's longest prompt) is what sorting saves.
    def padded(batches):
        return sum(len(rows) * max(lengths[i] for i in rows) for rows in batches)

    assert padded(length_batches(lengths, 2, 5)) < padded(length_batches(lengths, 2, 1))
    with pytest.raises(ValueError, match="window"):
        length_batches(lengths, 2, 0)


def test_distilled_sequences_are_the_targets_greedy_replies(target, tmp_path, umask_022):
    model, tokenizer = target
    records = read_prompts(prompt_file(tmp_path, count=7))
    config = DistillConfig(max_tokens=12)
    shards = list(
        distill(model, tokenizer, records, tmp_path / "out", config, batch_size=3, progress=False)
    )
    assert [p.name for p in shards] == ["shard-00000.npz", "shard-00001.npz", "shard-00002.npz"]
    # Written through private temporary files (mkstemp: 0600), stored as the umask says.
    for path in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name
    data = load_distilled([tmp_path / "out"])
    assert sorted(d.id for d in data) == sorted(r.id for r in records)
    # One window of 8 batches holds all 7 prompts: shards come shortest prompt first.
    assert [d.prompt_length for d in data] == sorted(d.prompt_length for d in data)
    stopped = 0
    for item in data:
        prompt = item.tokens[: item.prompt_length]
        reply = item.tokens[item.prompt_length :]
        expected = mlx_lm_greedy(model, prompt, 12)
        if EOS in expected[: len(reply)]:  # the row stopped at its own EOS, which is kept
            stopped += 1
            assert reply == expected[: expected.index(EOS) + 1]
        else:
            assert reply == expected
    first = next(d for d in data if d.id == "p0")
    assert first.tokens[: first.prompt_length] == tokenizer.encode(
        json.loads((tmp_path / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    )
    assert stopped >= 2  # some rows stopped at EOS while others went on


def test_distilling_with_a_drafter_and_lookup_beams_writes_the_same_replies(
    target, tmp_path, monkeypatch
):
    """Greedy distillation through the speculative loop (a drafter beam and a lookup
    beam, as generation's default) stores exactly what plain decoding stores."""
    model, tokenizer = target
    records = read_prompts(prompt_file(tmp_path, count=7))
    config = DistillConfig(max_tokens=12)
    plain_run = distill(
        model, tokenizer, records, tmp_path / "plain", config, batch_size=3, progress=False
    )
    assert len(list(plain_run)) == 3
    used = []

    class Spy(DecodingSession):
        def step_functions(self, tree):
            used.append(tree)  # the tree each step was decoded with
            return super().step_functions(tree)

    monkeypatch.setattr(distill_module, "DecodingSession", Spy)
    mx.random.seed(0)
    drafter = Drafter.create(model)
    tree = TreeConfig.parse("1x3+1x7")
    run = distill(
        model, tokenizer, records, tmp_path / "drafted", config,
        batch_size=3, drafter=drafter, tree=tree, progress=False,
    )  # fmt: skip
    assert len(list(run)) == 3
    assert used and set(used) == {tree}
    plain = {d.id: d.tokens for d in load_distilled([tmp_path / "plain"])}
    assert {d.id: d.tokens for d in load_distilled([tmp_path / "drafted"])} == plain


def test_an_interrupted_run_resumes_without_losing_or_repeating(target, tmp_path):
    model, tokenizer = target
    records = read_prompts(prompt_file(tmp_path, count=8))
    config = DistillConfig(max_tokens=10)
    whole = list(
        distill(model, tokenizer, records, tmp_path / "a", config, batch_size=3, progress=False)
    )
    assert len(whole) == 3

    run = distill(model, tokenizer, records, tmp_path / "b", config, batch_size=3, progress=False)
    next(run)  # one shard written, then the process "dies"
    run.close()
    (tmp_path / "b" / ".shard-dead.npz.partial").write_bytes(b"half a shard")
    assert len(shard_paths(tmp_path / "b")) == 1
    rest = list(
        distill(model, tokenizer, records, tmp_path / "b", config, batch_size=3, progress=False)
    )
    assert [p.name for p in rest] == ["shard-00001.npz", "shard-00002.npz"]
    a, b = load_distilled([tmp_path / "a"]), load_distilled([tmp_path / "b"])
    assert [(x.id, x.tokens) for x in a] == [(x.id, x.tokens) for x in b]
    # Everything is done: running again writes nothing.
    assert list(distill(model, tokenizer, records, tmp_path / "b", config, progress=False)) == []
    # Other settings in the same folder are refused.
    with pytest.raises(ValueError, match="other settings.*max_tokens"):
        list(distill(model, tokenizer, records, tmp_path / "b", DistillConfig(max_tokens=5)))


def test_a_window_of_one_keeps_the_prompt_order(target, tmp_path):
    model, tokenizer = target
    records = read_prompts(prompt_file(tmp_path, count=5))
    config = DistillConfig(max_tokens=4)
    list(
        distill(
            model,
            tokenizer,
            records,
            tmp_path / "out",
            config,
            batch_size=2,
            length_window=1,
            progress=False,
        )
    )
    assert [d.id for d in load_distilled([tmp_path / "out"])] == [r.id for r in records]


def test_sampled_distillation_is_reproducible(target, tmp_path):
    model, tokenizer = target
    records = read_prompts(prompt_file(tmp_path, count=4))
    config = DistillConfig(max_tokens=8, temperature=1.0, seed=3)
    for name in ("x", "y"):
        list(
            distill(
                model, tokenizer, records, tmp_path / name, config, batch_size=2, progress=False
            )
        )
    x, y = load_distilled([tmp_path / "x"]), load_distilled([tmp_path / "y"])
    assert [s.tokens for s in x] == [s.tokens for s in y]


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    assert main(["distill", "--prompts", str(tmp_path / "none.jsonl"), "--output", "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no prompts file at") and "\n" not in err
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', "[1, 2"])
    assert main(["distill", "--prompts", str(bad), "--output", "o", "--strict"]) == 2
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    assert main(["distill", "--prompts", str(empty), "--output", "o"]) == 2
    assert "holds no usable prompt" in capsys.readouterr().err
    args = ["distill", "--prompts", str(prompt_file(tmp_path)), "--output", "o"]
    assert main([*args, "--source-weights", "a:1"]) == 2
    assert "source=weight" in capsys.readouterr().err
    assert main([*args, "--tree", "2by2"]) == 2
    assert capsys.readouterr().err.startswith("error: --tree: '2by2' is not a tree")


def test_two_workers_fill_one_folder_without_overlap(target, tmp_path):
    model, tokenizer = target
    records = read_prompts(prompt_file(tmp_path, count=9))
    config = DistillConfig(max_tokens=6)
    list(distill(model, tokenizer, records, tmp_path / "one", config, batch_size=2, progress=False))
    for worker in ((0, 2), (1, 2)):
        list(
            distill(
                model,
                tokenizer,
                records,
                tmp_path / "two",
                config,
                batch_size=2,
                worker=worker,
                progress=False,
            )
        )
    names = sorted(p.name for p in shard_paths(tmp_path / "two"))
    assert names[0] == "shard-w0-00000.npz" and names[-1] == "shard-w1-00001.npz"
    one = {x.id: x.tokens for x in load_distilled([tmp_path / "one"])}
    two = load_distilled([tmp_path / "two"])
    assert len(two) == len(one) == 9
    assert {x.id: x.tokens for x in two} == one
    with pytest.raises(ValueError, match="worker"):
        list(distill(model, tokenizer, records, tmp_path / "two", config, worker=(2, 2)))
