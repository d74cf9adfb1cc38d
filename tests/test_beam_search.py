"""The beam expansion step: fully determined, ties included (the kernels' reference)."""

import math
import random

import mlx.core as mx
import pytest
from tiny_models import VOCAB_SIZE, tiny_model

from mlx_redrafter.beam_search import expand_beams


def brute_force(scores, logits):
    """Rank every candidate by (score desc, flat index asc) in plain Python."""
    out = []
    for row_scores, row_logits in zip(scores, logits):
        candidates = []
        for parent, (score, beam_logits) in enumerate(zip(row_scores, row_logits)):
            top = max(beam_logits)
            norm = top + math.log(sum(math.exp(v - top) for v in beam_logits))
            for token, value in enumerate(beam_logits):
                flat = parent * len(beam_logits) + token
                candidates.append((-(score + value - norm), flat))
        candidates.sort()
        out.append([flat for _, flat in candidates[: len(row_scores)]])
    return out


def test_first_expansion_picks_distinct_tokens_of_beam_zero():
    scores = mx.array([[0.0, -mx.inf, -mx.inf]])
    logits = mx.array([[[0.0, 3.0, 1.0, 2.0]] * 3])
    result = expand_beams(scores, logits)
    assert result.parents.tolist() == [[0, 0, 0]]
    assert result.draft_tokens.tolist() == [[1, 3, 2]]
    assert result.scores.tolist()[0][0] > result.scores.tolist()[0][1]


def test_ties_go_to_the_lower_flat_index():
    # Every candidate ties: the first W flat indices win, in flat order.
    scores = mx.array([[0.0, 0.0]])
    logits = mx.zeros((1, 2, 5))
    result = expand_beams(scores, logits)
    assert result.parents.tolist() == [[0, 0]]
    assert result.draft_tokens.tolist() == [[0, 1]]
    # A tie across parents at the boundary: parent 0's token beats parent 1's.
    scores = mx.array([[0.0, 0.0]])
    logits = mx.array([[[5.0, 1.0, 1.0], [1.0, 1.0, 5.0]]])
    result = expand_beams(scores, logits)
    assert list(zip(result.parents.tolist()[0], result.draft_tokens.tolist()[0])) == [
        (0, 0),
        (1, 2),
    ]


@pytest.mark.parametrize("shape", [(1, 1, 7), (2, 3, 11), (3, 4, 64), (1, 8, 33)])
def test_matches_brute_force_on_random_inputs_with_ties(shape):
    batch, width, vocab = shape
    rng = random.Random(sum(shape))
    for _ in range(5):
        # Few distinct values, so ties are frequent.
        logits = [
            [[float(rng.randrange(4)) for _ in range(vocab)] for _ in range(width)]
            for _ in range(batch)
        ]
        scores = [[float(rng.randrange(3)) for _ in range(width)] for _ in range(batch)]
        result = expand_beams(mx.array(scores), mx.array(logits))
        flat = (result.parents * vocab + result.draft_tokens).tolist()
        assert flat == brute_force(scores, logits)


def tiny_drafter():
    """A tiny llama target, a fresh drafter for it, and the target's embedding."""
    from mlx_redrafter.drafter import Drafter

    model = tiny_model("llama")
    return model, Drafter.create(model), model.model.embed_tokens


def test_coupling_moves_only_the_sampled_rows_guesses():
    """beam_search with a Coupling: a greedy row (scale 1, no noise) drafts exactly what
    it drafts without one; a sampled row whose noise at a position favours a token by
    far drafts that token there."""
    from mlx_redrafter.beam_search import Coupling, beam_search

    model, drafter, embed = tiny_drafter()
    hidden = mx.random.normal((2, model.args.hidden_size), key=mx.random.key(3))
    roots = mx.array([5, 7])
    alone = beam_search(drafter, embed, hidden, roots, 2, 4)
    noise = mx.zeros((2, 3, VOCAB_SIZE))
    noise[1, 1, 11] = 1e4  # the sampled row's second drafted position: token 11
    coupling = Coupling(mx.array([1.0, 1 / 0.7]), noise)
    coupled = beam_search(drafter, embed, hidden, roots, 2, 4, coupling=coupling)
    assert coupled[0].tolist() == alone[0].tolist()
    assert coupled[1, 0, 2].item() == 11


def test_scored_beam_search_gives_the_beams_and_their_prefixes_log_probabilities():
    """The scores are the cumulative draft log-probabilities of each prefix: 0 at the
    root, never rising along a beam, and the beams are beam_search's own."""
    from mlx_redrafter.beam_search import beam_search, scored_beam_search

    model, drafter, embed = tiny_drafter()
    hidden = mx.random.normal((2, model.args.hidden_size), key=mx.random.key(4))
    roots = mx.array([5, 7])
    beams, scores, contest = scored_beam_search(drafter, embed, hidden, roots, 3, 2)
    assert beams.tolist() == beam_search(drafter, embed, hidden, roots, 3, 2).tolist()
    assert mx.allclose(contest, scores).item()  # greedy: no noise in the contest
    deep, deep_scores, _ = scored_beam_search(drafter, embed, hidden, roots, 3, 4)
    assert mx.all(deep_scores[:, :, 1:] <= deep_scores[:, :, :-1]).item()
    assert scores.shape == (2, 3, 2)
    assert mx.all(scores[:, :, 0] == 0).item()
    assert mx.all(scores[:, :, 1:] <= scores[:, :, :-1]).item()
    # The first drafted token's score is its log-softmax under the drafter.
    state = drafter.recurrent_step(mx.zeros((2, 1, hidden.shape[1])), embed(roots[:, None]))
    logits = drafter.draft_logits(hidden[:, None, :], state)[:, 0]  # (B, Vd)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    first = drafter.to_target_ids(mx.argmax(logits, axis=-1))
    assert beams[:, 0, 1].tolist() == first.tolist()
    best = mx.max(logprobs, axis=-1)
    assert mx.allclose(scores[:, 0, 1], best, atol=1e-5).item()


def test_a_sampled_rows_prefix_scores_leave_the_targets_noise_out():
    """Noise that forces a token makes it win the perturbed contest, but its prefix
    score stays its draft log-probability at the row's temperature: the chance a
    sample takes it, not the certainty of the perturbed argmax."""
    from mlx_redrafter.beam_search import Coupling, scored_beam_search

    model, drafter, embed = tiny_drafter()
    hidden = mx.random.normal((1, model.args.hidden_size), key=mx.random.key(5))
    roots = mx.array([5])
    noise = mx.zeros((1, 1, VOCAB_SIZE))
    state = drafter.recurrent_step(mx.zeros((1, 1, hidden.shape[1])), embed(roots[:, None]))
    logits = drafter.draft_logits(hidden[:, None, :], state)[0, 0] * 2.0  # temperature 0.5
    logprobs = logits - mx.logsumexp(logits)
    forced = int(mx.argmin(logits).item())  # the drafter's least likely token
    noise[0, 0, forced] = 1e4
    coupling = Coupling(mx.array([2.0]), noise)
    beams, scores, contest = scored_beam_search(
        drafter, embed, hidden, roots, 1, 2, coupling=coupling
    )
    assert beams[0, 0, 1].item() == drafter.to_target_ids(mx.array(forced)).item()
    assert scores[0, 0, 1].item() == pytest.approx(logprobs[forced].item(), abs=1e-4)
    assert contest[0, 0, 1].item() == pytest.approx(0.0, abs=1e-4)  # won the contest clearly


@pytest.mark.parametrize("compiled", [False, True])
def test_a_dynamic_trees_step_drafts_the_likeliest_prefixes(compiled):
    """With neutral rates, the step functions of `4x4@5` draft exactly `keep_best_nodes`
    of the scored beam search (so the tree is chosen by score, not cut in packed
    order), and pack them into 5 tokens."""
    from mlx_redrafter.beam_search import scored_beam_search
    from mlx_redrafter.confidence import neutral_rates
    from mlx_redrafter.config import TreeConfig
    from mlx_redrafter.decode import step_functions
    from mlx_redrafter.target import prepare_target
    from mlx_redrafter.tree import keep_best_nodes, pack_tree

    model, drafter, embed = tiny_drafter()
    prepare_target(model)
    steps = step_functions(model, drafter, TreeConfig(4, 4, draft_nodes=5), compiled=compiled)
    hidden = mx.random.normal((3, model.args.hidden_size), key=mx.random.key(6))
    roots = mx.array([5, 7, 9])
    neutral = neutral_rates(3)  # every rate 1: the draft probabilities rank
    drafted, drafted_contest = steps.draft(hidden, roots, None, neutral)  # (B, W, L) each
    beams, scores, contest = scored_beam_search(drafter, embed, hidden, roots, 4, 4)
    assert drafted.tolist() == keep_best_nodes(beams, scores, 5).tolist()
    assert mx.allclose(drafted_contest, contest).item()
    assert drafted.tolist() != pack_tree(beams, 5).tokens.tolist()  # not the full beams
    assert mx.sum(drafted < 0).item() > 0  # some prefixes were cut
    assert steps.pack(drafted).num_tokens.tolist() == [5, 5, 5]
