"""The drafter: architecture, the one recurrence, persistence and its errors."""

import json
import stat

import mlx.core as mx
import pytest
from tiny_models import tiny_model

from mlx_redrafter.beam_search import beam_search
from mlx_redrafter.drafter import Drafter, DrafterConfig, DrafterError
from mlx_redrafter.ngrams import NGRAMS_FILE, build_ngram_table
from mlx_redrafter.training import FitConfig, draft_batch, draft_loss, fit


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def parameter_shapes(drafter):
    from mlx.utils import tree_flatten

    return {k: tuple(v.shape) for k, v in tree_flatten(drafter.parameters())}


def test_reference_architecture_and_names(model):
    drafter = Drafter.create(model)
    assert drafter.config == DrafterConfig(vocab_size=64, hidden_size=32, exit_dim=64)
    assert parameter_shapes(drafter) == {
        "rnn_u.weight": (32, 32),
        "rnn_u.bias": (32,),
        "rnn_w.weight": (32, 32),
        "lm_head.0.linear.weight": (64, 64),
        "lm_head.0.linear.bias": (64,),
        "lm_head.1.linear.weight": (64, 64),
        "lm_head.1.linear.bias": (64,),
        "lm_head.2.weight": (64, 64),
    }
    small = Drafter.create(model, num_draft_layers=1, rnn=False, exit_dim=16, draft_vocab_size=8)
    assert parameter_shapes(small) == {
        "input_proj.weight": (16, 64),
        "input_proj.bias": (16,),
        "lm_head.0.linear.weight": (16, 16),
        "lm_head.0.linear.bias": (16,),
        "lm_head.1.weight": (8, 16),
        "draft_vocab_ids": (8,),
    }
    assert "draft_vocab_ids" not in dict(_flat(small.trainable_parameters()))


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def test_recurrence_matches_the_formula(model):
    drafter = Drafter.create(model)
    state, embedding = mx.random.normal((3, 32)), mx.random.normal((3, 32))
    expected = (
        mx.sigmoid(
            x := (
                state @ drafter.rnn_u.weight.T
                + drafter.rnn_u.bias
                + embedding @ drafter.rnn_w.weight.T
            )
        )
        * x
    )
    assert mx.allclose(drafter.recurrent_step(state, embedding), expected, atol=1e-5).item()
    summing = Drafter.create(model, rnn=False)
    assert mx.array_equal(summing.recurrent_step(state, embedding), state + embedding).item()


def test_beam_search_and_training_share_the_recurrence(model):
    """Width-1 beam search follows the argmax of the teacher-forced logits on its own beam."""
    drafter = Drafter.create(model)
    hidden = mx.random.normal((2, 32))
    root = mx.array([3, 9])
    beams = beam_search(drafter, model.model.embed_tokens, hidden, root, 1, 5)  # (2, 1, 5)
    embeddings = model.model.embed_tokens(beams[:, 0, :4])[:, None]  # (2, 1, 4, D)
    logits = drafter.teacher_forced_logits(hidden[:, None], embeddings)  # (2, 1, 4, V)
    assert mx.array_equal(mx.argmax(logits, axis=-1)[:, 0], beams[:, 0, 1:]).item()
    assert beams[:, 0, 0].tolist() == [3, 9]


def test_beam_search_keeps_the_best_distinct_beams(model):
    drafter = Drafter.create(model)
    beams = beam_search(
        drafter, model.model.embed_tokens, mx.random.normal((1, 32)), mx.array([5]), 4, 3
    )
    assert beams.shape == (1, 4, 3)
    assert len({tuple(b) for b in beams[0].tolist()}) == 4
    assert len({b[1] for b in beams[0].tolist()}) >= 2  # first expansion: distinct tokens


def test_reduced_vocabulary_maps_back_to_target_ids(model):
    ids = [60, 2, 33, 7]
    drafter = Drafter.create(model, draft_vocab_ids=ids)
    beams = beam_search(
        drafter, model.model.embed_tokens, mx.random.normal((2, 32)), mx.array([1, 1]), 3, 4
    )
    assert set(mx.flatten(beams[:, :, 1:]).tolist()) <= set(ids)


def test_save_load_round_trip_is_exact(model, tmp_path):
    drafter = Drafter.create(model, exit_dim=48, draft_vocab_ids=[5, 6, 7, 8, 9])
    drafter.save(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["model_type"] == "recurrent_drafting_drafter"
    assert config["exit_dim"] == 48 and config["draft_vocab_size"] == 5
    loaded = Drafter.load(tmp_path / "d")
    assert parameter_shapes(loaded) == parameter_shapes(drafter)
    for (name, a), (_, b) in zip(_flat(drafter.parameters()), _flat(loaded.parameters())):
        assert mx.array_equal(a, b).item(), name
    with pytest.raises(FileExistsError):
        drafter.save(tmp_path / "d")
    drafter.save(tmp_path / "d", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no staging leftovers


def test_saved_folders_get_the_umask_permissions_not_the_private_staging_ones(
    model, tmp_path, umask_022
):
    """Saving stages in a private temporary folder (mkdtemp: 0700); what lands must
    be readable like any folder the user makes (umask 022 here: 0755 and 0644)."""
    table = build_ngram_table([[1, 2, 3, 4]], order=2, length=2, min_count=1)
    folder = Drafter(Drafter.create(model).config, ngrams=table).save(tmp_path / "d")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, NGRAMS_FILE: 0o644}


def test_quantized_drafter_round_trip(model, tmp_path):
    drafter = Drafter.create(model)
    drafter.quantize(group_size=32, bits=8)
    drafter.save(tmp_path / "q")
    loaded = Drafter.load(tmp_path / "q")
    h, s = mx.random.normal((2, 32)), mx.random.normal((2, 32))
    assert mx.array_equal(loaded.draft_logits(h, s), drafter.draft_logits(h, s)).item()


def test_load_errors_are_clear(model, tmp_path):
    with pytest.raises(DrafterError, match="config.json is missing"):
        Drafter.load(tmp_path)
    Drafter.create(model).save(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text("{not json")
    with pytest.raises(DrafterError, match="not valid JSON"):
        Drafter.load(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(
        json.dumps(
            {"model_type": "recurrent_drafting_drafter", "vocab_size": 64, "hidden_size": 40}
        )
    )
    with pytest.raises(DrafterError, match="shape"):
        Drafter.load(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(DrafterError, match="not a drafter config"):
        Drafter.load(tmp_path / "d")
    Drafter.create(model).save(tmp_path / "e")
    (tmp_path / "e" / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(DrafterError, match="cannot read"):
        Drafter.load(tmp_path / "e")


def test_training_lowers_loss_and_raises_accuracy(model):
    sequences = [[(3 * i + 5 * k) % 64 for k in range(24)] for i in range(16)]
    drafter = Drafter.create(model)
    import mlx.core as mx_

    batch = draft_batch(model, drafter, mx_.array(sequences[:8]), mx_.array([24] * 8), 3)
    loss_before, accuracy_before = draft_loss(drafter, batch)
    losses = fit(model, drafter, sequences, FitConfig(num_steps=3, iterations=60))
    loss_after, accuracy_after = draft_loss(drafter, batch)
    assert losses[-1] < losses[0] / 4
    assert loss_after.item() < loss_before.item() / 4
    assert mx.all(accuracy_after > accuracy_before).item()
    assert accuracy_after.shape == (3,)
