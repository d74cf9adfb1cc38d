"""The drafter trainer on a tiny target: learning, resume, checkpoints, bad input."""

from __future__ import annotations

import errno
import json
import stat
from dataclasses import replace
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import decode_tokens, random_prompts
from mlx.utils import tree_flatten
from tiny_models import tiny_model, tiny_tokenizer

from mlx_redrafter.cli import main
from mlx_redrafter.config import PLAIN_DECODING, TreeConfig
from mlx_redrafter.distill import load_distilled
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.target import output_logits, prepare_target
from mlx_redrafter.training import (
    CheckpointError,
    TrainConfig,
    TrainingSequence,
    choose_draft_vocab,
    latest_checkpoint,
    measure_tau,
    read_checkpoint,
    soft_head,
    train,
    vocab_coverage,
    write_checkpoint,
)
from mlx_redrafter.training import checkpoints as checkpoints_module
from mlx_redrafter.training import data as data_module
from mlx_redrafter.training import loss as loss_module


@pytest.fixture(scope="module")
def data():
    """A tiny llama and 64 sequences of its own greedy continuations (prompt + reply)."""
    model = prepare_target(tiny_model("llama"))
    prompts = random_prompts(64, seed=5, lengths=(2, 8))
    replies, _ = decode_tokens(model, None, prompts, TreeConfig(1, 1), max_tokens=32)
    sequences = [TrainingSequence(p + r, len(p)) for p, r in zip(prompts, replies)]
    ids = [f"s{i}" for i in range(len(sequences))]
    return model, sequences, ids


def weights(drafter):
    flat = cast(list[tuple[str, mx.array]], tree_flatten(drafter.parameters()))
    return {k: np.array(v) for k, v in flat}


CONFIG = TrainConfig(
    num_steps=3,
    batch_size=8,
    micro_batch_size=4,
    epochs=20,
    learning_rate=1e-2,
    validation_fraction=0.25,
    eval_every=6,
    checkpoint_every=5,
)


def test_loss_falls_and_per_step_accuracy_rises(data):
    model, sequences, ids = data
    mx.random.seed(0)
    drafter = Drafter.create(model)
    report = train(model, drafter, sequences, ids, CONFIG, progress=False)
    assert report.steps == report.total_steps == 20 * 5  # 20 epochs of 5 global batches
    assert np.mean(report.train_loss[-5:]) < 0.5 * np.mean(report.train_loss[:3])
    early = np.mean(report.train_accuracy[:3], axis=0)  # (K,) per draft step
    late = np.mean(report.train_accuracy[-5:], axis=0)
    assert late.shape == (3,) and np.all(late > 2 * early) and np.all(late > 0.4)
    # Held-out sequences: a random target generalises little (its loss soon
    # overfits), but top-1 accuracy on unseen prompts still rises.
    first, last = report.validation[0], report.validation[-1]
    assert len(last["accuracy"]) == 3
    assert last["accuracy"][0] > first["accuracy"][0]


def test_distillation_against_the_target_distribution_learns(data):
    model, sequences, ids = data
    mx.random.seed(0)
    drafter = Drafter.create(model, exit_dim=32)
    config = replace(CONFIG, kl_weight=1.0, epochs=8)
    report = train(model, drafter, sequences, ids, config, progress=False)
    assert report.validation[-1]["loss"] < report.validation[0]["loss"]
    early = np.mean(report.train_accuracy[:3], axis=0)
    late = np.mean(report.train_accuracy[-5:], axis=0)
    assert np.all(late > 1.5 * early)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text"])
@pytest.mark.parametrize("quantized", [False, True])
def test_soft_head_is_the_target_head_on_the_draft_vocabulary(family, quantized):
    """Tied (llama) and separate (mistral, gemma3) heads, float and 4-bit."""
    model = tiny_model(family)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    draft_ids = mx.array([3, 17, 40, 63])
    head = soft_head(model, draft_ids, dim=32)
    assert head is not None and head.weight.shape == (32, 4) and head.bias.shape == (4,)
    hidden = mx.random.normal((2, 5, 32), key=mx.random.key(3))  # (B, T, D)
    expected = output_logits(model, hidden)[..., draft_ids]  # (B, T, Vd)
    assert mx.allclose(hidden @ head.weight + head.bias, expected, rtol=1e-4, atol=1e-4).item()
    assert soft_head(model, None, dim=32) is None


def test_soft_head_refuses_a_head_that_is_not_affine(monkeypatch):
    model = tiny_model("llama")

    def capped(m, h):  # logit soft-capping, as some families apply
        return 5.0 * mx.tanh(output_logits(m, h) / 5.0)

    monkeypatch.setattr(loss_module, "output_logits", capped)
    assert soft_head(model, mx.array([1, 2]), dim=32) is None


def test_reduced_vocabulary_and_exit_dim_train_and_decode_faster(data):
    model, sequences, ids = data
    vocab = choose_draft_vocab(sequences, 24)
    assert len(vocab) == 24 and vocab == sorted(vocab)
    assert vocab_coverage(sequences, vocab) > vocab_coverage(sequences, list(range(24)))
    mx.random.seed(0)
    drafter = Drafter.create(model, exit_dim=32, draft_vocab_ids=vocab)
    train(model, drafter, sequences, ids, CONFIG, progress=False)
    prompts = [s.tokens[: s.prompt_length] for s in sequences[:6]]
    tokenizer = tiny_tokenizer()
    tau = measure_tau(model, drafter, tokenizer, prompts, tree=TreeConfig(2, 4), max_tokens=24)
    plain = measure_tau(model, None, tokenizer, prompts, tree=PLAIN_DECODING, max_tokens=24)
    assert plain.tau == 1.0
    assert tau.tau > 1.4  # the drafter is accepted: more than one token per target step
    assert tau.tokens == plain.tokens == 6 * 24


def test_draft_vocabulary_keeps_forced_ids_and_orders_by_frequency():
    sequences = [TrainingSequence([9, 9, 1, 1, 1, 2, 2, 3], prompt_length=2)]
    assert choose_draft_vocab(sequences, 2) == [1, 2]
    assert choose_draft_vocab(sequences, 2, always=[7]) == [1, 7]
    assert choose_draft_vocab(sequences, 5) == [0, 1, 2, 3, 4]  # filled with unseen ids


def test_resume_is_bit_identical_to_an_uninterrupted_run(data, tmp_path):
    model, sequences, ids = data
    config = replace(CONFIG, epochs=3, kl_weight=0.5)

    mx.random.seed(1)
    whole = Drafter.create(model, exit_dim=32, draft_vocab_ids=choose_draft_vocab(sequences, 40))
    initial = weights(whole)
    full = train(
        model, whole, sequences, ids, config, progress=False, checkpoint_dir=tmp_path / "a"
    )

    # Interrupted after 7 steps (checkpoints at 5 and at the stop), then resumed
    # in a fresh drafter that starts from other weights.
    mx.random.seed(1)
    part = Drafter.create(model, exit_dim=32, draft_vocab_ids=choose_draft_vocab(sequences, 40))
    assert all(np.array_equal(initial[k], v) for k, v in weights(part).items())
    train(
        model,
        part,
        sequences,
        ids,
        config,
        progress=False,
        checkpoint_dir=tmp_path / "b",
        max_steps=7,
    )
    assert latest_checkpoint(tmp_path / "b") == tmp_path / "b" / "ckpt-0000007"
    mx.random.seed(99)
    fresh = Drafter.create(model, exit_dim=32, draft_vocab_ids=choose_draft_vocab(sequences, 40))
    resumed = train(
        model,
        fresh,
        sequences,
        ids,
        config,
        progress=False,
        checkpoint_dir=tmp_path / "b",
        resume=True,
    )

    assert resumed.steps == full.steps == 15
    assert resumed.train_loss == full.train_loss
    for name, value in weights(whole).items():
        assert np.array_equal(value, weights(fresh)[name]), name
    # Only the newest checkpoint is kept.
    assert [p.name for p in (tmp_path / "b").glob("ckpt-*")] == ["ckpt-0000015"]


def train_new_drafter(data, config, checkpoint_dir, **options):
    """Train a fresh drafter on the fixture's data with checkpoints in `checkpoint_dir`."""
    model, sequences, ids = data
    return train(
        model,
        Drafter.create(model),
        sequences,
        ids,
        config,
        progress=False,
        checkpoint_dir=checkpoint_dir,
        **options,
    )


def test_resume_refuses_other_settings(data, tmp_path):
    config = replace(CONFIG, epochs=1)
    train_new_drafter(data, config, tmp_path, max_steps=2)
    other = replace(config, learning_rate=5e-2)
    with pytest.raises(CheckpointError, match="other training settings"):
        train_new_drafter(data, other, tmp_path, resume=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train_new_drafter(data, config, tmp_path / "empty", resume=True)


def test_full_disk_mid_checkpoint_keeps_the_previous_one(data, tmp_path, monkeypatch):
    model, _, _ = data
    import mlx.optimizers as optim

    drafter = Drafter.create(model)
    optimizer = optim.AdamW(learning_rate=1e-3)
    optimizer.init(drafter.trainable_parameters())
    write_checkpoint(tmp_path, 1, drafter, optimizer, {"step": 1})
    before = weights(read_checkpoint(tmp_path / "ckpt-0000001")[0])

    real_save = mx.save_safetensors

    def full_disk(path, *args, **kwargs):
        if "optimizer" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(checkpoints_module.mx, "save_safetensors", full_disk)
    drafter.update({"rnn_w": {"weight": mx.zeros_like(drafter.rnn_w.weight)}})
    with pytest.raises(CheckpointError, match="No space left.*ckpt-0000001 is intact"):
        write_checkpoint(tmp_path, 2, drafter, optimizer, {"step": 2})
    monkeypatch.undo()

    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-0000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "ckpt-0000001"]
    after = weights(read_checkpoint(tmp_path / "ckpt-0000001")[0])
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_a_drafter_for_another_target_refuses_to_train(data):
    model, sequences, ids = data
    other = tiny_model("llama", hidden_size=48)
    with pytest.raises(ValueError, match="does not match the model's hidden size"):
        train(model, Drafter.create(other), sequences, ids, CONFIG, progress=False)
    bad = [TrainingSequence([1, 2, 3, 900, 4], 1)] + list(sequences[1:])
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        train(model, Drafter.create(model), bad, ids, CONFIG, progress=False)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "missing"), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no distilled data folder") and "\n" not in err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--data", str(tmp_path / "empty"), "--output", str(tmp_path)]) == 2
    assert "holds no shard-*.npz shards" in capsys.readouterr().err
    assert main(["train", "--data", "x", "--output", "y", "--tau-trees", "4by4"]) == 2
    assert "--tau-trees" in capsys.readouterr().err
    assert main(["train", "--data", "x", "--output", "y", "--ngram-order", "-1"]) == 2
    assert "--ngram-order must be >= 0" in capsys.readouterr().err


def test_checkpoint_state_is_json(data, tmp_path, umask_022):
    config = replace(CONFIG, epochs=1)
    train_new_drafter(data, config, tmp_path)
    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    # Staged in a private temporary folder (mkdtemp: 0700), kept as the umask says.
    assert stat.S_IMODE(latest.stat().st_mode) == 0o755
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == state["total_steps"] == 5
    assert len(state["train_loss"]) == 5


def test_hidden_state_cache_is_reused(data, tmp_path, monkeypatch):
    from mlx_redrafter.training import compute_hidden, make_window

    model, sequences, _ = data
    first = [make_window(s) for s in sequences[:5]]
    compute_hidden(model, sequences[:5], first, cache_dir=tmp_path, cache_tag="tiny")
    assert len(list(tmp_path.glob("*.npy"))) == 5

    def no_target(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(data_module, "target_hidden_states", no_target)
    again = [make_window(s) for s in sequences[:5]]
    compute_hidden(model, sequences[:5], again, cache_dir=tmp_path, cache_tag="tiny")
    for a, b in zip(first, again):
        assert a.hidden is not None and b.hidden is not None
        assert np.array_equal(a.hidden, b.hidden)
        assert a.hidden.shape == (len(a.tokens), 32) and a.hidden.dtype == np.float16


def test_soft_labels_line_up_with_the_hard_ones(data):
    """On greedy self-distilled data the target's distribution peaks at the token it wrote."""
    from mlx_redrafter.training import compute_hidden, host_batch, make_window
    from mlx_redrafter.training.loss import _soft_targets

    model, sequences, _ = data
    windows = [make_window(s) for s in sequences[:6]]
    compute_hidden(model, sequences[:6], windows)
    batch = host_batch(windows, 3, None)
    full = _soft_targets(model, batch, 3, None)
    assert full.ids is None and full.probs.shape == (*batch.targets.shape, 64)  # (b, T', K, V)
    predicted = np.array(mx.argmax(full.probs, axis=-1))
    assert batch.valid.sum() > 100
    assert np.array_equal(predicted[batch.valid], batch.targets[batch.valid])
    # The top-k form keeps the k most likely tokens with their full-distribution
    # probabilities: the written token among them, the kept mass below 1.
    top = _soft_targets(model, batch, 3, None, top_k=5)
    assert top.ids is not None and top.probs.shape == (*batch.targets.shape, 5)
    gathered = mx.take_along_axis(full.probs, top.ids, axis=-1)
    assert mx.allclose(top.probs, gathered, atol=1e-6).item()
    kept = np.array(top.ids)[batch.valid]  # (n, 5)
    assert all(t in row for t, row in zip(batch.targets[batch.valid], kept))
    smallest_kept = np.array(mx.min(top.probs, axis=-1))[batch.valid]
    others = np.array(full.probs)[batch.valid].copy()  # (n, V)
    np.put_along_axis(others, kept, 0.0, axis=-1)
    assert np.all(others.max(axis=-1) <= smallest_kept + 1e-6)


def teacher_forcing(data, count, vocab_index=None):
    """The first `count` sequences as one micro-batch: (host batch, device batch, valid)."""
    from mlx_redrafter.training import compute_hidden, host_batch, make_window
    from mlx_redrafter.training.loss import _device_batch

    model, sequences, _ = data
    windows = [make_window(s) for s in sequences[:count]]
    compute_hidden(model, sequences[:count], windows)
    host = host_batch(windows, 3, vocab_index)
    return host, _device_batch(model, host, 3), mx.array(host.valid.astype(np.float32))


def test_soft_loss_with_every_token_kept_is_the_dense_loss(data):
    from mlx_redrafter.training.loss import _loss_sums, _soft_targets

    model = data[0]
    host, batch, valid = teacher_forcing(data, 4)
    mx.random.seed(0)
    drafter = Drafter.create(model)
    dense = _soft_targets(model, host, 3, None)
    every = _soft_targets(model, host, 3, None, top_k=63)  # all but the least likely token
    loss_dense, _, _ = _loss_sums(drafter, batch, valid, dense, 1.0)
    loss_top, _, _ = _loss_sums(drafter, batch, valid, every, 1.0)
    assert abs(loss_top.item() - loss_dense.item()) < 1e-3 * abs(loss_dense.item())
    logits = drafter.teacher_forced_logits(batch.hidden, batch.token_embeddings)
    reference = -mx.sum(dense.probs * nn.log_softmax(logits, axis=-1), axis=-1)  # (b, T', K)
    assert mx.allclose(loss_dense, mx.sum(reference * valid), rtol=1e-5).item()


def test_hard_half_of_the_soft_loss_skips_tokens_outside_the_draft_vocabulary(data):
    """Targets outside the draft vocabulary are stored as index 0 with weight 0: the
    hard part of a mixed loss must not pull them toward draft token 0."""
    from mlx_redrafter.training.loss import SoftTargets, _loss_sums

    model, sequences, _ = data
    vocab = choose_draft_vocab(sequences, 24)
    index = np.full((64,), -1, dtype=np.int32)
    index[vocab] = np.arange(24, dtype=np.int32)
    host, batch, valid = teacher_forcing(data, 4, index)
    assert (host.valid & ~host.in_vocab).sum() > 10  # some targets fall outside
    mx.random.seed(0)
    drafter = Drafter.create(model, exit_dim=16, draft_vocab_ids=vocab)
    shape = (*host.targets.shape, 5)
    no_mass = SoftTargets(mx.zeros(shape), mx.zeros(shape, dtype=mx.int32))
    dense_no_mass = SoftTargets(mx.zeros((*host.targets.shape, 24)), None)
    for soft in (no_mass, dense_no_mass):
        loss, _, ce_sum = _loss_sums(drafter, batch, valid, soft, 0.25)
        assert loss.item() == pytest.approx(0.75 * ce_sum.item(), rel=1e-5)


def test_distill_then_train_from_the_command_line(tmp_path, capsys):
    """The two commands end to end on a tiny model folder: data, drafter, report, export."""
    import mlx_lm.utils
    from tiny_models import _COMMON, FAMILY_CONFIGS

    folder = tmp_path / "model"
    folder.mkdir()
    mlx_lm.utils.save_model(folder, tiny_model("llama"))
    mlx_lm.utils.save_config({**_COMMON, **FAMILY_CONFIGS["llama"]}, folder / "config.json")
    tiny_tokenizer(eos_token="w20")._tokenizer.save_pretrained(str(folder))
    rng = np.random.default_rng(2)
    lines = [
        json.dumps({"id": f"q{i}", "prompt": " ".join(f"w{t}" for t in rng.integers(21, 64, 5))})
        for i in range(40)
    ]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    data = tmp_path / "data"
    base = ["--model", str(folder), "--quiet"]
    assert (
        main(
            [
                "distill",
                "--prompts",
                str(tmp_path / "prompts.jsonl"),
                "--output",
                str(data),
                "--max-tokens",
                "24",
                "--batch-size",
                "16",
                *base,
            ]
        )
        == 0
    )
    assert len(list(data.glob("shard-*.npz"))) == 3
    run = [
        "train", "--data", str(data), "--output", str(tmp_path / "run"), *base,
        "--draft-vocab", "32", "--exit-dim", "24", "--num-steps", "3", "--batch-size", "8",
        "--micro-batch-size", "4", "--epochs", "10", "--learning-rate", "1e-2",
        "--validation-fraction", "0.2", "--eval-every", "5", "--tau-prompts", "8",
        "--tau-max-tokens", "24",
        "--tau-trees", "2x4,1x1,0x4+1,0x4+1:text", "--export", str(tmp_path / "shipped"),
        "--export-dtype", "float16",
    ]  # fmt: skip
    assert main(run) == 0
    err = capsys.readouterr().err
    assert "draft vocabulary: 32 tokens cover" in err
    assert "top-1 accuracy per draft step 1:" in err and "tau 2x4:" in err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["steps"] == report["total_steps"] > 0
    assert [t["tree"] for t in report["tau"]] == ["2x4", "1x1", "0x4+1", "0x4+1:text"]
    assert report["tau"][1]["tau"] == 1.0 and report["tau"][0]["tau"] >= 1.0
    # The report decodes with the drafter as saved, n-gram table included: a lookup
    # beam with the table drafts otherwise than one from the text alone (with no table
    # both would decode alike). On this tiny data the table does not help.
    assert report["tau"][2]["tau"] != report["tau"][3]["tau"]
    assert min(report["tau"][2]["tau"], report["tau"][3]["tau"]) >= 1.0
    shipped = Drafter.load(tmp_path / "shipped")
    assert shipped.config.draft_vocab_size == 32 and shipped.config.exit_dim == 24
    stored = mx.load(str(tmp_path / "shipped" / "model.safetensors"))
    assert stored["lm_head.2.weight"].dtype == mx.float16  # exported in half precision
    assert shipped.lm_head[-1].weight.dtype == mx.float32  # loaded for the CPU backend
    # The n-gram table of the training replies comes with both copies (--ngram-order 2).
    assert "n-gram table:" in err and report["ngrams"]["order"] == 2
    assert shipped.ngrams is not None
    assert Drafter.load(tmp_path / "run" / "drafter").ngrams is not None
    # A second run into the same folder must be told to --resume.
    assert main(run) == 2
    assert "pass --resume" in capsys.readouterr().err
    # Distilling through the speculative loop with the trained drafter (and its table)
    # stores the same greedy replies as plain distillation.
    drafted = [
        "distill", "--prompts", str(tmp_path / "prompts.jsonl"), "--output",
        str(tmp_path / "drafted"), "--max-tokens", "24", "--batch-size", "16", "--drafter",
        str(tmp_path / "run" / "drafter"), "--tree", "2x3+1x5", *base,
    ]  # fmt: skip
    assert main(drafted) == 0
    plain = {d.id: d.tokens for d in load_distilled([data])}
    assert {d.id: d.tokens for d in load_distilled([tmp_path / "drafted"])} == plain
    # Evaluating a drafter on a prompt file.
    assert (
        main(
            [
                "train",
                "--evaluate-only",
                "--init-drafter",
                str(tmp_path / "run" / "drafter"),
                "--tau-file",
                str(tmp_path / "prompts.jsonl"),
                "--tau-prompts",
                "2",
                "--tau-max-tokens",
                "8",
                "--tau-batch-size",
                "2",
                *base,
            ]
        )
        == 0
    )
    assert "over 2 prompts of" in capsys.readouterr().err
    # Evaluating it on the distilled data's validation split reproduces the run's
    # final figures (same split, same drafter), and its start was recorded at step 0.
    evaluation = [
        "train", "--evaluate-only", "--init-drafter", str(tmp_path / "run" / "drafter"),
        "--data", str(data), "--validation-fraction", "0.2", "--num-steps", "3",
        "--output", str(tmp_path / "eval"), *base,
    ]  # fmt: skip
    assert main(evaluation) == 0
    assert "top-1 accuracy per draft step 1:" in capsys.readouterr().err
    measured = json.loads((tmp_path / "eval" / "evaluation.json").read_text())["validation"]
    final = report["validation"][-1]
    assert measured["accuracy"] == final["accuracy"]
    assert measured["positions"] == final["positions"] > 0
    assert measured["loss"] == pytest.approx(final["loss"], rel=1e-5)
    assert report["validation"][0]["step"] == 0
    assert main(["train", "--evaluate-only", "--init-drafter", str(tmp_path / "run"), *base]) == 2
    assert "--tau-file" in capsys.readouterr().err
