"""The memory switches of a training step (eagle3build/ttt/recompute.py): `train.activation_checkpointing`
and `train.loss_chunk_tokens` give the gradients of the step without them (fp32, the same bits or fp32
rounding) and keep less memory live, measured by the profiler's CPU allocation events."""

from __future__ import annotations

import copy

import pytest
import torch
from test_model_ttt import random_samples, tiny_draft, tiny_mapping, tiny_target

from eagle3build.attention.factory import make_attention
from eagle3build.attention.merged import MathMergedAttention
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.errors import ConfigError
from eagle3build.ttt.batch import pack, pad_batch, with_greedy_in_draft, with_loss_rows, with_step_rows
from eagle3build.ttt.forward import ttt_forward
from eagle3build.ttt.loss import Objective, step_loss_weights, weighted_loss
from eagle3build.ttt.recompute import Recompute
from eagle3build.ttt.scorer import TargetScorer

torch.set_num_threads(2)
STEPS = 3
CHECKPOINTED, CHUNKED, BOTH = Recompute(STEPS, 0), Recompute(0, 6), Recompute(STEPS, 6)


def chat_batch(scorer, seed=6, step_rows=True):
    """Three packed samples with prompts (no loss), loss rows and step rows as training lays them out."""
    samples = random_samples([14, 6, 16], seed=seed)
    for _ids, mask, _ in samples:
        mask[:5] = False
    batch = pad_batch(pack(samples), 8)
    batch = with_loss_rows(with_greedy_in_draft(batch, scorer.greedy_in_draft(batch.final)), STEPS, 4)
    return with_step_rows(batch, 4) if step_rows else batch


def step(model, scorer, batch, attention, recompute=None, objective=None, compile=False):
    """One training step's forward and backward (weighted loss): the per-step sums and every gradient."""
    model.zero_grad(set_to_none=True)
    stats = ttt_forward(model, batch, scorer.draft_probs(batch.loss_final), STEPS, attention, compile, objective,
                        recompute)
    weighted_loss(stats, stats.count, step_loss_weights(STEPS, 0.8)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return stats.loss_sum.detach(), stats.correct, stats.count, grads


def assert_same(got, expected, exact: bool):
    """exact: the same bits; else equal to fp32 rounding of each tensor's size (sums in another order)."""
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])  # correct, count
    pairs = [("loss_sum", got[0], expected[0])] + [(n, got[3][n], g) for n, g in expected[3].items()]
    assert got[3].keys() == expected[3].keys()
    for name, a, b in pairs:
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()), msg=name)


@pytest.mark.parametrize("attention", ["merged", "sdpa", "flash"])
def test_activation_checkpointing_gives_the_same_gradients_bit_for_bit(attention):
    """Each TTT step's layer recomputed in backward: the very same losses, counts and gradients, with step
    rows (steps 1.. at the loss rows only) and without, and for the head that feeds back its normed output."""
    attend = MathMergedAttention() if attention == "merged" else make_attention(attention)
    model, _, scorer = tiny_draft()
    for step_rows in (True, False):
        batch = chat_batch(scorer, step_rows=step_rows)
        assert_same(step(model, scorer, batch, attend, CHECKPOINTED), step(model, scorer, batch, attend), exact=True)
    normed = copy.deepcopy(model)
    normed.config.norm_output = True
    batch = chat_batch(scorer)
    assert_same(step(normed, scorer, batch, attend, CHECKPOINTED), step(normed, scorer, batch, attend), exact=True)
    for first in range(1, STEPS):  # train.activation_checkpointing: N, the first N steps only
        assert_same(step(model, scorer, batch, attend, Recompute(first, 0)), step(model, scorer, batch, attend),
                    exact=True)


@pytest.mark.parametrize("loss", ["forward_kl", "lk_hybrid"])
def test_chunked_loss_gives_the_same_gradients(loss):
    """The loss over chunks of loss rows (a chunk of one row, chunks of 6 that leave a shorter last one, one
    chunk for all rows), alone and with checkpointing: the gradients of the whole-batch loss."""
    objective = Objective.from_params({"loss": loss, "lk_eta": 3.0})
    model, _, scorer = tiny_draft()
    batch = chat_batch(scorer)
    rows = len(batch.loss_rows)
    assert rows % 6 and rows > 6  # 6 leaves a shorter last chunk
    plain = step(model, scorer, batch, MathMergedAttention(), objective=objective)
    for recompute in (Recompute(0, 1), CHUNKED, BOTH):
        got = step(model, scorer, batch, MathMergedAttention(), recompute, objective)
        assert_same(got, plain, exact=False)
    one_chunk = step(model, scorer, batch, MathMergedAttention(), Recompute(0, rows), objective)
    assert_same(one_chunk, plain, exact=True)  # one chunk: the same operations, recomputed


def test_validation_without_gradients_runs_the_switches_as_plain_calls():
    model, _, scorer = tiny_draft()
    batch = chat_batch(scorer)
    with torch.no_grad():
        plain = ttt_forward(model, batch, scorer.draft_probs(batch.loss_final), STEPS, MathMergedAttention())
        both = ttt_forward(model, batch, scorer.draft_probs(batch.loss_final), STEPS, MathMergedAttention(),
                           recompute=BOTH)
    torch.testing.assert_close(both.loss_sum, plain.loss_sum, rtol=1e-6, atol=0)
    assert torch.equal(both.count, plain.count)


# ------------------------------------------------------------------ memory
def wide_draft(hidden=64, vocab=2048, draft_vocab=1536, intermediate=768):
    """A draft whose activations and logits dwarf its weights, as at a real shape with long sequences."""
    target = tiny_target(vocab=vocab, hidden=hidden)
    d2t, t2d = tiny_mapping(vocab=vocab, k=draft_vocab)
    torch.manual_seed(0)
    config = DraftConfig.from_target(target, draft_vocab, overrides={"intermediate_size": intermediate})
    return Eagle3Draft.from_target(config, target, d2t, t2d), TargetScorer(target, d2t, t2d)


def peak_step_bytes(model, scorer, batch, recompute) -> int:
    """Peak bytes the step allocates on the CPU above what was live before it (the profiler's memory
    events in time order), forward through backward."""
    from torch.profiler import ProfilerActivity, profile

    probs = scorer.draft_probs(batch.loss_final)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        stats = ttt_forward(model, batch, probs, STEPS, make_attention("sdpa"), recompute=recompute)
        weighted_loss(stats, stats.count, step_loss_weights(STEPS, 0.8)).backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def test_each_switch_lowers_the_peak_memory_of_a_step():
    """At 512 tokens, 3 steps: the [rows, steps, K] logits and each step's layer activations are the
    peak's bulk; chunking the loss and checkpointing the steps each take a share of them off it."""
    model, scorer = wide_draft()
    g = torch.Generator().manual_seed(0)
    n = 512
    samples = [(torch.randint(0, 2048, (n,), generator=g), torch.ones(n, dtype=torch.bool),
                torch.randn(n, 4, 64, generator=g))]
    batch = with_loss_rows(with_greedy_in_draft(pack(samples), torch.ones(n, dtype=torch.bool)), STEPS, 1)
    peaks = {name: peak_step_bytes(model, scorer, batch, r)
             for name, r in (("plain", None), ("chunked", Recompute(0, 64)), ("checkpointed", CHECKPOINTED),
                             ("first_step", Recompute(1, 0)), ("both", Recompute(STEPS, 64)))}
    logits = n * STEPS * 1536 * 4  # one fp32 copy of the step's logits
    assert peaks["chunked"] < peaks["plain"] - 2 * logits, peaks
    assert peaks["checkpointed"] < peaks["plain"] - 2 * logits, peaks
    assert peaks["both"] < min(peaks["chunked"], peaks["checkpointed"]), peaks
    # the first step alone: part of the saving (its layer), the later steps' activations kept
    assert peaks["checkpointed"] < peaks["first_step"] < peaks["plain"], peaks


def test_the_switches_from_the_config_and_the_runs_identity():
    """Off by default (None: the step as without them); on, a run keeps its identity (it resumes across
    them) and the train rule carries them only away from their defaults."""
    from eagle3build.config import section_defaults, train_rule_params
    from eagle3build.train.loop import hashed_params, resolve_params

    assert Recompute.from_params(resolve_params({})) is None
    every = resolve_params({"activation_checkpointing": True})
    assert Recompute.from_params(every) == Recompute(every["ttt_steps"], 0)  # true: every TTT step
    assert Recompute.from_params(resolve_params({"activation_checkpointing": 2})) == Recompute(2, 0)
    assert Recompute.from_params(resolve_params({"activation_checkpointing": 0})) is None
    assert Recompute.from_params(resolve_params({"loss_chunk_tokens": 2048})) == Recompute(0, 2048)
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing.*8 steps of train.ttt_steps 7"):
        Recompute.from_params(resolve_params({"activation_checkpointing": 8, "ttt_steps": 7}))
    on = {"epochs": 1, "activation_checkpointing": True, "loss_chunk_tokens": 2048}
    assert hashed_params(resolve_params(on), False) == hashed_params(resolve_params({"epochs": 1}), False)
    defaults = section_defaults("train")
    at_defaults = {"epochs": 1, "activation_checkpointing": False, "loss_chunk_tokens": 0}
    assert train_rule_params(at_defaults, defaults) == {"epochs": 1}
    assert train_rule_params(on, defaults) == on


@pytest.mark.slow
def test_compiled_step_with_both_switches_gives_the_eager_gradients(monkeypatch):
    """What the GPU runs (Inductor, here its CPU backend): the compiled layer halves and merge inside the
    checkpointed steps and the compiled loss inside the checkpointed chunks (dynamic in their rows)."""
    from eagle3build import compilation

    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "0")
    monkeypatch.setattr(compilation, "COMPILED", {})
    model, _, scorer = tiny_draft()
    batch = chat_batch(scorer)
    eager = step(model, scorer, batch, MathMergedAttention())
    compiled = step(model, scorer, batch, MathMergedAttention(compile=True), BOTH, compile=True)
    assert_same(compiled, eager, exact=False)
    again = step(model, scorer, batch, MathMergedAttention(compile=True), BOTH, compile=True)  # cached kernels
    assert_same(again, compiled, exact=True)


def test_the_compiled_merge_is_specialised_to_each_number_of_diagonals(monkeypatch):
    """A checkpointed step runs the diagonal merge again in backward and must meet the graph its forward
    ran. With the number of diagonals s a dynamic dimension, a graph compiled for a later step also served
    the earlier steps' s: on the GPU at 65,536 Kimi-shaped tokens Inductor's 32-bit indexing guard fails from
    s = 5 on, and the recomputation of steps 2..4 stopped with a CheckpointError. Each s has its own graph,
    and a second pass over the steps compiles nothing; other batch lengths compile each s once more (its rows
    turn dynamic), then no more: compilation.RECOMPILE_LIMIT counts on that."""
    from torch._dynamo.utils import counters

    from eagle3build import compilation
    from eagle3build.attention.merge import merge_diagonal

    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "0")
    monkeypatch.setattr(compilation, "COMPILED", {})
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(3)
    graphs = []
    for rows in (16, 16, 24, 32):
        q, out = torch.randn(1, 4, rows, 8, generator=g), torch.randn(1, 4, rows, 8, generator=g)
        lse = torch.randn(1, 4, rows, generator=g)
        keys, values = ([torch.randn(1, 2, rows, 8, generator=g) for _ in range(4)] for _ in range(2))
        for s in range(1, 5):
            merge_diagonal(q, out, lse, keys[:s], values[:s], 0.35, compile=True)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 2, 3, 4] + [4] * 4 + [5, 6, 7, 8] + [8] * 4
