"""The decoding session itself: mixed batches, joining, cancelling, abandoned runs,
request ids, and its generation stream."""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import mlx_lm_greedy

from mlx_redrafter import (
    DecodingSession,
    Drafter,
    PromptCache,
    Request,
    SamplingConfig,
    StopConfig,
    TreeConfig,
)
from mlx_redrafter.config import PLAIN_DECODING
from mlx_redrafter.policy import StepRecord


def test_greedy_rows_without_a_key_share_a_batch_with_sampled_rows(trained_llama):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter, tree="1x2+1x7")
    greedy = Request(prompts[0], stop=StopConfig(20))
    sampled = Request(prompts[1], SamplingConfig(temperature=1.0), StopConfig(20), mx.random.key(3))
    updates = list(session.run([greedy, sampled]))
    tokens = [t for u in updates if u.request == 0 for t in u.tokens]
    assert tokens == mlx_lm_greedy(model, prompts[0], 20)
    alone = list(DecodingSession(model, drafter, tree="1x2+1x7").run([sampled]))
    assert [t for u in updates if u.request == 1 for t in u.tokens] == [
        t for u in alone for t in u.tokens
    ]


def test_a_cancelled_request_leaves_before_the_next_step(trained_llama):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter, tree=TreeConfig(3, 3))
    session.add([Request(p, stop=StopConfig(30)) for p in prompts[:3]])
    first = session.step()
    session.cancel(1)
    second = session.step()
    last = next(u for u in second if u.request == 1)
    assert last.finish_reason == "cancelled" and last.tokens == [] and last.text == ""
    assert last.metrics.steps == 1  # it took no part in the second step
    assert session.state is not None and session.state.row_ids == [0, 2]
    outputs = {u.request: list(u.tokens) for u in first}
    for update in second:
        outputs[update.request] += update.tokens
    while session.active:
        for update in session.step():
            outputs[update.request] += update.tokens
    for row in (0, 2):
        assert outputs[row] == mlx_lm_greedy(model, prompts[row], 30)


def test_ids_in_flight_are_refused_and_an_abandoned_run_leaves_nothing(trained_llama):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter)
    session.add([Request(prompts[0], stop=StopConfig(10))], ids=[5])
    with pytest.raises(ValueError, match="new and distinct"):
        session.add([Request(prompts[1])], ids=[5])
    with pytest.raises(ValueError, match="new and distinct"):
        session.add([Request(prompts[1]), Request(prompts[2])], ids=[6, 6])
    session.close()
    run = session.run([Request(p, stop=StopConfig(40)) for p in prompts[:2]], ids=[0, 1])
    next(run)
    run.close()  # the consumer stops early
    assert session.active == 0 and session.state is None
    again = list(session.run([Request(prompts[2], stop=StopConfig(12))], ids=[0]))
    assert [t for u in again for t in u.tokens] == mlx_lm_greedy(model, prompts[2], 12)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_sessions_share_one_generation_stream_per_thread(trained_llama):
    """An MLX stream holds a worker thread: sessions made again and again (one per
    API call) must not leave a new one each time."""
    model, drafter, prompts = trained_llama
    request = Request(prompts[0], stop=StopConfig(4))
    list(DecodingSession(model, drafter).run([request]))
    before = len(os.listdir("/proc/self/task"))
    for _ in range(5):
        list(DecodingSession(model, drafter).run([request]))
    assert len(os.listdir("/proc/self/task")) == before


class _Alternating:
    """A tree choice that switches between plain decoding and a tree by the context
    length, so that plain forwards launched ahead are taken, and dropped before tree
    steps (the same tokens give the same choices, however often it is asked)."""

    def __init__(self, tree: TreeConfig, pattern: str):
        self.tree, self.pattern = tree, pattern

    @property
    def trees(self) -> list[TreeConfig]:
        return [PLAIN_DECODING, self.tree]

    def describe(self) -> str:
        return f"alternating {self.pattern}"

    def choose(self, batch_size: int, context: int = 0, temperature: float = 0.0) -> TreeConfig:
        return self.tree if self.pattern[context % len(self.pattern)] == "t" else PLAIN_DECODING

    def record(self, step: StepRecord) -> None:
        pass


@pytest.mark.parametrize("pattern", ["p", "ppt", "pt"])
def test_plain_steps_launched_ahead_give_the_same_tokens(trained_llama, monkeypatch, pattern):
    """The next plain step is launched before this one's sync (as mlx-lm pipelines):
    rows ending at different steps (max tokens, EOS, a stop string), a
    row joining, a sampled row and tree steps in between leave every token as it is
    without looking ahead, and greedy rows as mlx-lm decodes them."""
    from mlx_redrafter import decode as decode_module

    launched: list[int] = []
    real_launch = decode_module.launch_plain

    def counting_launch(model, state):
        launched.append(len(state.row_ids))
        real_launch(model, state)

    monkeypatch.setattr(decode_module, "launch_plain", counting_launch)
    model, drafter, prompts = trained_llama
    # A row that meets its EOS as its 9th token, and not before.
    ending = next(p for p in prompts[2:] if len(set(mlx_lm_greedy(model, p, 9))) == 9)
    eos = mlx_lm_greedy(model, ending, 9)[-1]
    requests = [
        Request(prompts[0], stop=StopConfig(12)),
        Request(prompts[1], SamplingConfig(temperature=0.8), StopConfig(25), mx.random.key(4)),
        Request(ending, stop=StopConfig(30, frozenset({eos}))),
    ]
    joining = Request(prompts[3], stop=StopConfig(12))

    def decode(prefetch: bool) -> dict[int, list[int]]:
        choice = _Alternating(TreeConfig(2, 3), pattern)
        session = DecodingSession(model, drafter, tree=choice, prefetch=prefetch)
        session.add(requests)
        outputs: dict[int, list[int]] = {}
        for step in range(200):
            if step == 1:
                session.add([joining], ids=[9])
            if step == 6:
                session.cancel(1)  # the sampled row leaves with a forward launched ahead
            for update in session.step():
                outputs.setdefault(update.request, []).extend(update.tokens)
            if not session.active:
                break
        return outputs

    ahead = decode(prefetch=True)
    assert launched, "no plain forward was launched ahead"
    assert pattern != "p" or max(launched) == 4  # plain throughout: with the joined row
    count = len(launched)
    behind = decode(prefetch=False)
    # The cancelled row leaves at a step, not at a token: a step that looks ahead asks
    # for the next tree before its own token is committed, so the policy (which
    # alternates by context length) may give the two runs different trees and so
    # different token counts by then. Its tokens are the same as far as both went.
    cut = min(len(ahead[1]), len(behind[1]))
    assert cut >= 6 and ahead[1][:cut] == behind[1][:cut]
    assert {k: v for k, v in ahead.items() if k != 1} == {k: v for k, v in behind.items() if k != 1}
    assert len(launched) == count  # without prefetch nothing is launched ahead
    assert ahead[0] == mlx_lm_greedy(model, prompts[0], 12)
    assert ahead[2] == mlx_lm_greedy(model, ending, 9)[:-1]  # cut at its EOS
    assert ahead[9] == mlx_lm_greedy(model, prompts[3], 12)


def test_a_tree_step_drops_a_plain_forward_launched_ahead(trained_llama):
    """`decode_step` of a tree after `launch_plain` decodes as if nothing was launched
    (the launched forward wrote only uncommitted slots)."""
    from mlx_redrafter.config import CacheConfig
    from mlx_redrafter.decode import decode_step, launch_plain, prefill, step_functions

    model, drafter, prompts = trained_llama
    tree = step_functions(model, drafter, TreeConfig(2, 3))
    plain = step_functions(model, drafter, PLAIN_DECODING)
    outputs = []
    for launch in (False, True):
        state = prefill(model, prompts[:3], CacheConfig())
        tokens = []
        for _ in range(4):
            if launch:
                launch_plain(model, state)
            tokens.append(decode_step(model, tree, state, prefetch=False).tokens)
            tokens.append(decode_step(model, plain, state, prefetch=False).tokens)
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


def test_a_quick_choice_corrected_after_the_sync_drops_the_step_launched_from_it(
    trained_llama, monkeypatch
):
    """When the quick greedy choice is unsure and the exact one differs, the plain step
    launched ahead from the quick one is dropped and the history takes the exact root."""
    from mlx_redrafter import decode as decode_module

    def wrong_and_unsure(logits, sampling, keys):
        second = mx.argsort(logits, axis=-1)[..., -2].astype(mx.int32)  # (B, N)
        return second, mx.array(True)

    monkeypatch.setattr(decode_module, "choose_tokens_quickly", wrong_and_unsure)
    model, _, prompts = trained_llama
    session = DecodingSession(model, None, tree="plain")
    caches = [PromptCache(), PromptCache()]  # they take each row's history when it ends
    requests = [Request(p, stop=StopConfig(16), prefix=c) for p, c in zip(prompts, caches)]
    outputs: dict[int, list[int]] = {}
    for update in session.run(requests):
        outputs.setdefault(update.request, []).extend(update.tokens)
    for row in (0, 1):
        assert outputs[row] == mlx_lm_greedy(model, prompts[row], 16)
        text = list(prompts[row]) + outputs[row]
        assert len(caches[row].tokens) >= len(prompts[row]) + 14
        assert caches[row].tokens == text[: len(caches[row].tokens)]


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_others_decode(trained_llama):
    """With prefill_chunk, a prompt that arrives while a row decodes is committed one
    chunk between two steps: the running row gets a token every step meanwhile, the
    new row joins once its last chunk is in, a row cancelled during its prefill never
    joins, and every reply is mlx-lm's."""
    model, drafter, prompts = trained_llama
    long_prompt = [t for p in prompts[4:12] for t in p][:40]  # 39 positions to commit
    session = DecodingSession(model, drafter, tree="2x3", prefill_chunk=8)
    session.add([Request(prompts[0], stop=StopConfig(60))], ids=[0])
    outputs: dict[int, list[int]] = {0: []}
    first = session.step()  # its prompt fits one chunk: prefilled, then its first step
    outputs[0] += first[0].tokens
    joining = [Request(long_prompt, stop=StopConfig(10)), Request(prompts[1], stop=StopConfig(10))]
    session.add(joining, ids=[1, 2])  # prefilled together
    session.cancel(2)  # leaves before their prefill is done; row 1 joins without it
    steps_before_joining = 0
    while 1 not in outputs:
        updates = session.step()
        by_id = {u.request: u for u in updates}
        assert 0 in by_id and by_id[0].tokens, "the running row was stalled"
        outputs[0] += by_id[0].tokens
        if 2 in by_id:
            assert by_id[2].finish_reason == "cancelled" and not by_id[2].tokens
        if 1 in by_id:
            outputs[1] = list(by_id[1].tokens)
        else:
            steps_before_joining += 1
    assert steps_before_joining == 4  # chunks of 8, 8, 8, 8 then 7 with the join
    while session.active:
        for update in session.step():
            outputs[update.request] += update.tokens
            assert update.request != 2
    assert outputs[0] == mlx_lm_greedy(model, prompts[0], 60)
    assert outputs[1] == mlx_lm_greedy(model, long_prompt, 10)
    assert session.state is None


def test_a_short_prompt_overtakes_a_long_prefill(trained_llama):
    """With prefill_chunk, a long prompt is committed a chunk per step even when
    nothing decodes, so a short prompt that arrives meanwhile gets the next chunk,
    joins and decodes while the long one is still being prefilled; the long one gets
    a chunk at least every other step. Both replies are mlx-lm's."""
    model, drafter, prompts = trained_llama
    long_prompt = [t for p in prompts[4:40] for t in p][:81]  # 80 positions: 10 chunks
    short_prompt = prompts[1]  # at most 7 positions: one chunk
    session = DecodingSession(model, drafter, tree="2x3", prefill_chunk=8)
    session.add([Request(long_prompt, stop=StopConfig(10))], ids=[0])
    assert session.step() == []  # its first chunk; nothing decodes yet
    session.add([Request(short_prompt, stop=StopConfig(10))], ids=[1])
    outputs: dict[int, list[int]] = {}
    steps = 1
    while 0 not in outputs:
        steps += 1
        for update in session.step():
            outputs.setdefault(update.request, []).extend(update.tokens)
        if steps == 2:  # the short prompt's chunk, its join and its first step
            assert list(outputs) == [1] and outputs[1]
    assert steps == 11  # 10 chunks of the long prompt and 1 of the short one
    while session.active:
        for update in session.step():
            outputs[update.request] += update.tokens
    assert outputs[0] == mlx_lm_greedy(model, long_prompt, 10)
    assert outputs[1] == mlx_lm_greedy(model, short_prompt, 10)


def test_prefill_chunk_must_be_positive(trained_llama):
    model, drafter, _ = trained_llama
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        DecodingSession(model, drafter, prefill_chunk=0)


class TimedChoice(_Alternating):
    """Records every step the session tells it of."""

    def __init__(self, tree: TreeConfig, pattern: str):
        super().__init__(tree, pattern)
        self.recorded: list[tuple[TreeConfig, int, float]] = []
        self.built: list[bool] = []

    def record(self, step: StepRecord) -> None:
        self.recorded.append((step.tree, step.batch_size, step.seconds))
        self.built.append(step.built)


def test_every_step_is_timed_once_with_the_host_work_after_it(trained_llama):
    """The session tells its choice of each step once, at the next step (or an add, or
    the end of the batch, or close), with the time from the step's launch to then: the
    host's work between steps counts, a wait longer than the step does not."""
    from mlx_redrafter import session as session_module

    model, drafter, prompts = trained_llama
    choice = TimedChoice(TreeConfig(2, 3), "pt")
    session = DecodingSession(model, drafter, tree=choice)
    updates = list(session.run([Request(p, stop=StopConfig(10)) for p in prompts[:2]]))
    assert len(choice.recorded) == session.stats.steps  # the last step too, at the end
    assert sum(u.finish_reason is not None for u in updates) == 2
    # Host work after a step (here 50 ms) is that step's; a wait past it is not, nor
    # anything before a prefill or the end of the batch.
    runs = np.zeros((1, 0), dtype=np.int64)
    for gap, counts, seconds in ((0.05, True, 0.15), (100.0, True, 0.1), (0.05, False, 0.1)):
        ended = time.perf_counter() - gap
        step = StepRecord(PLAIN_DECODING, 1, 0.1, runs, 9)
        session._timed = session_module._TimedStep(step, ended)
        session._settle_timing(gap_counts=counts)
        assert choice.recorded[-1][2] == pytest.approx(seconds, abs=0.01)
    session.add([Request(prompts[2], stop=StopConfig(10))])
    session.step()
    session.step()
    told = len(choice.recorded)
    session.close()
    assert len(choice.recorded) == told + 1  # close tells the pending step


class ProbingChoice(TimedChoice):
    """Asks for a probe of one drafter tree on its 3rd and 6th questions, and notes
    the step each probe started on."""

    def __init__(self, tree: TreeConfig, pattern: str, probe_tree: TreeConfig):
        super().__init__(tree, pattern)
        self.probe_tree, self.asked, self.probed_on = probe_tree, 0, []

    def probe(self, tree: TreeConfig) -> TreeConfig | None:
        self.asked += 1
        if self.asked not in (3, 6):
            return None
        self.probed_on.append(len(self.recorded))  # the steps before are told already
        return self.probe_tree

    def record_probe(self, runs, probe_tree) -> None:
        pass


class LateTreeChoice(ProbingChoice):
    """Decodes plainly on its first `start` steps, then with its tree."""

    def __init__(self, tree: TreeConfig, start: int, probe_tree: TreeConfig):
        super().__init__(tree, "t", probe_tree)
        self.start, self.chosen = start, 0

    def choose(self, batch_size: int, context: int = 0, temperature: float = 0.0) -> TreeConfig:
        self.chosen += 1
        return self.tree if self.chosen > self.start else PLAIN_DECODING


@pytest.mark.parametrize("case", ["another tree", "the same tree, probed first"])
def test_a_step_that_first_runs_a_trees_functions_is_told_as_built(trained_llama, case):
    """The session tells its choice which steps ran some compiled function at shapes
    it had not run at in the session (they were traced and built then, so their time
    is no cost): its first plain step, its first step of the tree, and the step that
    drafted the probe tree first; not any later step, nor a later probe. A probe of
    the step tree before its first step drafted only: that step is built too."""
    model, drafter, prompts = trained_llama
    if case == "another tree":
        choice: ProbingChoice = ProbingChoice(TreeConfig(2, 3), "ppt", TreeConfig(1, 3))
    else:
        choice = LateTreeChoice(TreeConfig(2, 3), 8, TreeConfig(2, 3))
    session = DecodingSession(model, drafter, tree=choice)
    list(session.run([Request(prompts[0], stop=StopConfig(24))]))
    trees = [tree for tree, _, _ in choice.recorded]
    first = {trees.index(PLAIN_DECODING), trees.index(TreeConfig(2, 3))}
    assert len(choice.probed_on) == 2 and choice.probed_on[0] not in first
    if case != "another tree":
        assert choice.probed_on[0] < trees.index(TreeConfig(2, 3))
    built = {step for step, flag in enumerate(choice.built) if flag}
    assert built == first | {choice.probed_on[0]}


def test_sessions_share_their_step_functions_while_the_model_lives(trained_llama):
    """A session per request (as `generate` makes) finds the step functions an
    earlier session of the same model and drafter built, and compiled, for a tree;
    other options get their own; a model keeps those without a drafter and of its
    latest drafter, and they go when the model goes."""
    import gc

    from tiny_models import tiny_model

    from mlx_redrafter import decode
    from mlx_redrafter.target import prepare_target

    _, drafter, _ = trained_llama
    model = prepare_target(tiny_model("llama"))
    tree = TreeConfig(2, 3)
    first = DecodingSession(model, drafter).step_functions(tree)
    assert DecodingSession(model, drafter).step_functions(tree) is first
    alone = DecodingSession(model, None).step_functions(tree)
    assert alone is not first
    # Decoding without the drafter (as `bench --also-no-drafter` alternates) keeps both.
    assert DecodingSession(model, drafter).step_functions(tree) is first
    assert DecodingSession(model, drafter, compiled=False).step_functions(tree) is not first
    identity = id(model)
    assert any(key[0] == identity for key in decode._SHARED)
    # Another drafter for the model: the first one's functions go (they hold it).
    other = Drafter(drafter.config)
    assert DecodingSession(model, other).step_functions(tree) is not first
    assert not any(key[0] == identity and key[2] == id(drafter) for key in decode._SHARED)
    assert DecodingSession(model, None).step_functions(tree) is alone
    del model, first, other, alone
    gc.collect()
    assert not any(key[0] == identity for key in decode._SHARED)
