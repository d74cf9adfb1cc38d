"""The n-gram table: continuations of the target's own replies for lookup branches without
a match in the row's text."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_tokens, mlx_lm_greedy, random_prompts
from tiny_models import VOCAB_SIZE

from mlx_redrafter.cli import main
from mlx_redrafter.config import TreeConfig
from mlx_redrafter.distill import Shard, write_shard
from mlx_redrafter.drafter import Drafter, DrafterError
from mlx_redrafter.loading import DEFAULT_DRAFTER
from mlx_redrafter.ngrams import (
    NGRAMS_FILE,
    NgramTableError,
    build_ngram_table,
    index_table,
    load_ngram_table,
    lookup_continuations,
    ngram_hash,
    ngram_hash_numpy,
    save_ngram_table,
    table_branches,
)
from mlx_redrafter.tree import ABSENT


def look_up(table, rows):
    """lookup_continuations on plain lists (each row: its tokens, the newest last)."""
    capacity = max(len(row) for row in rows) + 2
    context = mx.array([row + [0] * (capacity - len(row)) for row in rows])
    continuations, found = lookup_continuations(table, context, mx.array([len(r) for r in rows]))
    return [c if f else None for c, f in zip(np.array(continuations).tolist(), found.tolist())]


def test_worked_example():
    # ngrams.py's docstring
    replies = [[5, 6, 7], [5, 6, 7], [5, 6, 8], [9, 6, 8]]
    table = build_ngram_table(replies, order=2, length=2, min_count=1)
    assert look_up(table, [[5], [6], [9], [1, 9, 6], [5, 6], [7], [8], [1]]) == [
        [6, 7],
        [7, ABSENT],  # 7 and 8 both follow 6 twice: the smaller id; then the reply ends
        [6, 8],
        [8, ABSENT],  # (9, 6) has its own entry
        [7, ABSENT],  # (5, 6) was pruned: the same as 6 alone
        None,  # 7 and 8 only end replies
        None,
        None,  # never seen
    ]
    # Entries: 5, 6, 9 and (9, 6); (5, 6) is left out because 6 alone gives the same.
    assert table.size == 4


def test_hash_is_the_same_on_the_host_and_the_device():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 4):
        tokens = rng.integers(0, 262_144, size=(50, n))
        assert np.array_equal(ngram_hash_numpy(tokens), np.array(ngram_hash(mx.array(tokens))))
    # n is part of the key: a token and the same token after nothing else differ.
    assert ngram_hash_numpy(np.array([[3]]))[0] != ngram_hash_numpy(np.array([[0, 3]]))[0]


def reference_table(replies, order, length, min_count):
    """Every n-gram's greedy continuation, in plain Python (no pruning)."""
    followers: dict[tuple[int, ...], list[list[int]]] = {}
    for reply in replies:
        for end in range(len(reply) - 1):
            for n in range(1, order + 1):
                if end - n + 1 < 0:
                    continue
                gram = tuple(reply[end - n + 1 : end + 1])
                followers.setdefault(gram, []).append(reply[end + 1 : end + 1 + length])
    table = {}
    for gram, rows in followers.items():
        if len(gram) >= 2 and len(rows) < min_count:
            continue
        continuation = []
        for k in range(length):
            counts = Counter(row[k] for row in rows if len(row) > k)
            if not counts:
                break
            best = min(counts, key=lambda token: (-counts[token], token))
            continuation.append(best)
            rows = [row for row in rows if len(row) > k and row[k] == best]
        table[gram] = continuation + [ABSENT] * (length - len(continuation))
    return table


def test_lookup_agrees_with_a_plain_python_table_on_random_text():
    rng = random.Random(0)
    for order, min_count in ((1, 1), (2, 1), (3, 2)):
        replies = [[rng.randrange(6) for _ in range(rng.randint(1, 30))] for _ in range(40)]
        table = build_ngram_table(replies, order=order, length=4, min_count=min_count)
        expected_table = reference_table(replies, order, 4, min_count)
        rows = [[rng.randrange(7) for _ in range(rng.randint(1, 6))] for _ in range(200)]
        expected = []
        for row in rows:
            known = [
                expected_table[tuple(row[-n:])]
                for n in range(min(order, len(row)), 0, -1)
                if tuple(row[-n:]) in expected_table
            ]
            expected.append(known[0] if known else None)
        assert look_up(table, rows) == expected


def test_table_beams_put_the_root_first_and_fit_the_beam_length():
    table = build_ngram_table([[1, 2, 3, 4, 5]], order=1, length=3)
    context = mx.array([[9, 1, 0], [9, 4, 0], [8, 8, 0]])
    lengths = mx.array([2, 2, 1])
    fallback = mx.full((3, 6), -7)
    beams = table_branches(table, context, lengths, fallback)  # (3, 6)
    assert np.array(beams).tolist() == [
        [1, 2, 3, 4, ABSENT, ABSENT],  # padded past the stored length
        [4, 5, ABSENT, ABSENT, ABSENT, ABSENT],  # the reply ended after 5
        [-7] * 6,  # 8 is unknown: the fallback
    ]
    cut = table_branches(table, context, lengths, mx.full((3, 2), -7))
    assert np.array(cut).tolist() == [[1, 2], [4, 5], [-7, -7]]


def test_save_and_load_round_trip(tmp_path):
    small = build_ngram_table([[1, 2, 3], [2, 3, 1, 2]], order=2, length=3)
    big = build_ngram_table([[70_000, 1, 70_001]], order=2, length=2)  # ids past uint16
    for table in (small, big):
        folder = tmp_path / str(table.size)
        folder.mkdir()
        path = save_ngram_table(table, folder)
        assert [p.name for p in folder.iterdir()] == [NGRAMS_FILE]  # no staging file left
        loaded = load_ngram_table(path)
        assert np.array_equal(np.array(loaded.keys), np.array(table.keys))
        assert np.array_equal(np.array(loaded.continuations), np.array(table.continuations))
        assert loaded.order == table.order
        assert loaded.bucket_size == table.bucket_size
    with pytest.raises(NgramTableError, match="vocabulary"):
        load_ngram_table(tmp_path / str(big.size) / NGRAMS_FILE, vocab_size=50_000)


def test_bad_tables_are_refused_clearly(tmp_path):
    garbage = tmp_path / NGRAMS_FILE
    garbage.write_bytes(b"not a table")
    with pytest.raises(NgramTableError, match="cannot read the n-gram table"):
        load_ngram_table(garbage)
    other = tmp_path / "other.safetensors"
    mx.save_safetensors(str(other), {"weights": mx.zeros((2, 2))})
    with pytest.raises(NgramTableError, match="is not an n-gram table"):
        load_ngram_table(other)
    with pytest.raises(NgramTableError, match="ascending"):
        index_table(np.array([5, 3], dtype=np.uint32), np.zeros((2, 1)), 1)
    with pytest.raises(NgramTableError, match="no reply tokens"):
        build_ngram_table([[], []])
    with pytest.raises(NgramTableError, match="no reply has two tokens"):
        build_ngram_table([[4], [5]])
    with pytest.raises(NgramTableError, match=">= 1"):
        build_ngram_table([[1, 2]], order=0)


def test_a_drafter_keeps_its_table_when_saved_and_loaded(tmp_path, trained_llama):
    model, drafter, _ = trained_llama
    table = build_ngram_table([[1, 2, 3, 4], [2, 3, 5]], order=2, length=3)
    with_table = Drafter(drafter.config, ngrams=table)
    with_table.update(drafter.parameters())
    assert "ngrams" not in dict(with_table.parameters())  # data, never trained
    with_table.save(tmp_path / "d")
    loaded = Drafter.load(tmp_path / "d")
    assert loaded.ngrams is not None
    assert np.array_equal(np.array(loaded.ngrams.keys), np.array(table.keys))
    assert Drafter.load(tmp_path / "d").ngrams is not None
    (tmp_path / "d" / NGRAMS_FILE).write_bytes(b"broken")
    with pytest.raises(DrafterError, match="cannot read the n-gram table"):
        Drafter.load(tmp_path / "d")


def test_table_beams_decode_exactly_like_mlx_lm_and_draft_more(trained_llama):
    """A table of the target's own greedy replies: lookup branches without a match in
    the row's text copy it, the output stays mlx-lm's, and fewer steps are needed."""
    model, trained, _ = trained_llama
    prompts = random_prompts(24, seed=11, lengths=(2, 6))
    references = [mlx_lm_greedy(model, p, 24) for p in prompts]
    table = build_ngram_table(references, order=2, length=6, min_count=1)
    drafter = Drafter(trained.config, ngrams=table)
    drafter.update(trained.parameters())
    steps = {}
    for label in ("0x7+1", "0x7+1:text", "1x3+1x7", "2x2+1x4"):
        outputs, events = decode_tokens(model, drafter, prompts, TreeConfig.parse(label), 24)
        assert outputs == references, label
        steps[label] = len(events)
    assert steps["0x7+1"] < 0.8 * steps["0x7+1:text"]


def test_the_text_only_spelling():
    beam = TreeConfig.parse("1x3+1x7:text")
    assert beam == TreeConfig(1, 3, lookup_branches=1, lookup_length=7, lookup_table=False)
    assert beam.label == "1x3+1x7:text"
    assert TreeConfig.parse(beam.label) == beam
    assert TreeConfig.parse("0x4+2:text").label == "0x4+2:text"
    assert TreeConfig(2, 2, lookup_table=False) == TreeConfig(2, 2)  # no lookup branches
    for bad in ("2x2:text", "1x3+1:table"):
        with pytest.raises(ValueError, match="':text'"):
            TreeConfig.parse(bad)


def distilled_folder(folder: Path, sequences, prompt_length=2):
    folder.mkdir()
    shard = Shard(
        [f"r{i}" for i in range(len(sequences))],
        [list(s) for s in sequences],
        [prompt_length] * len(sequences),
        [1] * len(sequences),
    )
    write_shard(folder, 0, shard)


def test_cli_adds_a_table_of_the_training_replies(tmp_path, trained_llama, capsys):
    model, drafter, _ = trained_llama
    drafter.save(tmp_path / "drafter")
    rng = random.Random(3)
    sequences = [[rng.randrange(VOCAB_SIZE) for _ in range(12)] for _ in range(30)]
    distilled_folder(tmp_path / "data", sequences)
    args = ["ngrams", "--data", str(tmp_path / "data"), "--drafter", str(tmp_path / "drafter")]
    assert main([*args, "--validation-fraction", "0.3"]) == 0
    assert "n-grams" in capsys.readouterr().err
    table = Drafter.load(tmp_path / "drafter").ngrams
    assert table is not None and table.order == 2
    # Held-out replies (the same split as `train`) are not counted.
    assert main([*args, "--validation-fraction", "0", "--min-count", "1"]) == 0
    everything = Drafter.load(tmp_path / "drafter").ngrams
    assert everything is not None and everything.size > table.size
    # Data of another target (ids past the drafter's vocabulary): one clear line.
    distilled_folder(tmp_path / "other", [[1, 2, VOCAB_SIZE + 5, 3]])
    other = ["ngrams", "--data", str(tmp_path / "other"), "--drafter", str(tmp_path / "drafter")]
    assert main(other) == 2
    assert "written by another model" in capsys.readouterr().err
    assert main(["ngrams", "--data", str(tmp_path / "data"), "--drafter", str(tmp_path)]) == 2
    assert "config.json is missing" in capsys.readouterr().err


def test_the_shipped_drafter_fits_its_budget_and_carries_a_table():
    folder = Path(DEFAULT_DRAFTER)
    assert sum(path.stat().st_size for path in folder.iterdir()) <= 20_000_000  # 20 MB
    drafter = Drafter.load(folder)
    assert drafter.ngrams is not None and drafter.ngrams.order == 2
    assert drafter.ngrams.size > 50_000
