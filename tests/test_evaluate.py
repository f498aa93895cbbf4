import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import STORY_CHAT_TEMPLATE as TEMPLATE
from conftest import TargetReplayDraft

from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.draft.target import load_target_head
from eagle3build.evaluate.hf import (
    AcceptanceStats,
    evaluate_set,
    greedy_generate,
    plot,
    read_questions,
    speculative_generate,
)

torch.set_num_threads(1)  # 2 threads spin against the other jobs on a shared 2-core machine
SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = SHARED / "assets" / "models" / "stories260K"
EOS = 2

STORY_PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park. They saw a big",
    "The sun was hot. Ben wanted to",
]


# ---------------------------------------------------------------------------------------------------
# metrics math on hand-built accept sequences


def test_acceptance_stats_match_vllm_definitions():
    stats = AcceptanceStats(k=3)
    for accepted in [3, 0, 1, 2]:
        stats.add(accepted)
    summary = stats.summary()
    # accepted at position 1: rounds with >= 1 accepted (3, 1, 2); position 2: (3, 2); position 3: (3)
    assert stats.accepted_per_position == [3, 2, 1]
    assert summary["drafts"] == 4 and summary["draft_tokens"] == 12 and summary["accepted"] == 6
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert summary["acceptance_rate_per_position"] == pytest.approx([0.75, 0.5, 0.25])
    other = AcceptanceStats(k=3)
    other.add(3)
    stats.merge(other)
    assert stats.summary()["mean_acceptance_length"] == pytest.approx(1 + 9 / 5)
    with pytest.raises(ValueError):
        stats.add(4)
    assert AcceptanceStats(k=2).summary()["mean_acceptance_length"] == 1.0


def test_read_questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"question_id": 1, "category": "writing", "turns": ["a", "b"]}\n\n'
        '{"question_id": 2, "category": "math", "turns": ["c"]}\n'
    )
    assert read_questions(str(path)) == [
        {"id": 1, "category": "writing", "turns": ["a", "b"]},
        {"id": 2, "category": "math", "turns": ["c"]},
    ]
    assert len(read_questions(str(path), max_samples=1)) == 1
    path.write_text('{"question_id": 1, "turns": []}\n')
    from eagle3build.errors import UserError

    with pytest.raises(UserError, match=r"q.jsonl line 1"):
        read_questions(str(path))


# ---------------------------------------------------------------------------------------------------
# real target (stories260K)


@pytest.fixture(scope="module")
def stories():
    if not STORIES.is_dir():
        pytest.skip(f"shared assets not found at {STORIES}")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    if not STORIES.is_dir():
        pytest.skip(f"shared assets not found at {STORIES}")
    from eagle3build.data.chat import load_tokenizer

    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return load_tokenizer(str(STORIES), chat_template=str(template))


def random_draft(seed: int = 0, draft_vocab_size: int = 256) -> Eagle3Draft:
    """A draft head for stories260K: random layer, lm_head from the target's rows of a random vocab subset."""
    head = load_target_head(STORIES)
    generator = torch.Generator().manual_seed(seed)
    kept = torch.randperm(head.vocab_size, generator=generator)[:draft_vocab_size].sort().values
    kept[:3] = torch.tensor([0, 1, 2])  # keep the special tokens (eos) drafted
    kept = kept.unique().sort().values
    d2t = kept - torch.arange(len(kept))
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    config = DraftConfig.from_target(head, draft_vocab_size=len(kept))
    torch.manual_seed(seed)
    return Eagle3Draft.from_target(config, head, d2t, t2d).eval()


def prompt_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_greedy_generate_equals_hf_generate(stories, tokenizer):
    for text in STORY_PROMPTS:
        ids = prompt_ids(tokenizer, text)
        ours = greedy_generate(stories, ids, 40, {EOS})
        ref = stories.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=EOS)
        ref = ref[0, len(ids) :].tolist()
        assert ours == ref[: len(ours)] and (len(ours) == 40 or ours[-1] == EOS)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_lossless_with_a_real_draft_head(stories, tokenizer, k):
    draft = random_draft(seed=k)
    total_rounds = 0
    for text in STORY_PROMPTS:
        ids = prompt_ids(tokenizer, text)
        reference = greedy_generate(stories, ids, 48, {EOS})
        tokens, accepts = speculative_generate(stories, draft, ids, k, 48, {EOS})
        assert tokens == reference
        assert all(0 <= a <= k for a in accepts)
        # every round emits accepted + 1 tokens; only the last one may be cut by max_new_tokens / eos
        assert sum(a + 1 for a in accepts[:-1]) < len(tokens) <= 1 + sum(a + 1 for a in accepts)
        total_rounds += len(accepts)
    assert total_rounds > 0


class OracleDraft(TargetReplayDraft):
    """Proposes the target's greedy next token, from the token history it keeps in its "KV cache" (conftest).
    Wrong (on purpose) where `wrong_at(position)` is true for the position of the token it predicts."""

    def __init__(self, target, first_token: int, wrong_at=lambda position: False):
        super().__init__(target, first_token)
        self.wrong_at = wrong_at
        vocab = target.config.vocab_size
        self.config = SimpleNamespace(aux_layer_ids=[1, 2, 3], vocab_size=vocab, draft_vocab_size=vocab)

    def project_aux(self, aux):
        assert aux.shape[-1] == 3 * self.target.config.hidden_size
        return aux

    def layer(self, input_ids, hidden, position_ids, kv_cache=None):
        start, logits, cache = self.replay(input_ids, position_ids, kv_cache)
        greedy = logits.argmax(-1)  # greedy[i] follows x[i]
        out = []
        for j in range(start, len(greedy) - 1):
            token = int(greedy[j + 1])  # the token at position j + 2
            if self.wrong_at(j + 2):
                token = (token + 1) % self.config.vocab_size
            out.append(torch.nn.functional.one_hot(torch.tensor(token), self.config.vocab_size).float())
        return torch.stack(out)[None], cache


@pytest.mark.parametrize("k", [1, 4, 7])
def test_oracle_draft_reaches_k_plus_one(stories, tokenizer, k):
    ids = prompt_ids(tokenizer, STORY_PROMPTS[1])
    reference = greedy_generate(stories, ids, 40, set())
    tokens, accepts = speculative_generate(stories, OracleDraft(stories, ids[0]), ids, k, 40, set())
    assert tokens == reference
    assert accepts == [k] * len(accepts)
    stats = AcceptanceStats(k)
    for a in accepts:
        stats.add(a)
    assert stats.summary()["mean_acceptance_length"] == k + 1
    assert stats.summary()["acceptance_rate_per_position"] == [1.0] * k


def test_partially_wrong_oracle_gives_the_expected_accept_sequence(stories, tokenizer):
    k, max_new = 5, 50
    ids = prompt_ids(tokenizer, STORY_PROMPTS[2])

    def wrong_at(position):
        return position % 7 == 0 or position % 11 == 3

    draft = OracleDraft(stories, ids[0], wrong_at)
    tokens, accepts = speculative_generate(stories, draft, ids, k, max_new, set())
    assert tokens == greedy_generate(stories, ids, max_new, set())
    # Simulate: a round starts with x[p] emitted; proposal i predicts position p + i.
    expected, p = [], len(ids)
    while p - len(ids) + 1 < max_new:
        accepted = next((i - 1 for i in range(1, k + 1) if wrong_at(p + i)), k)
        expected.append(accepted)
        p += accepted + 1
    assert accepts == expected
    assert 0 < sum(expected) < k * len(expected)


def test_evaluate_set_aggregates_categories_and_multi_turn(stories, tokenizer, tmp_path):
    questions = [
        {"id": 1, "category": "story", "turns": [STORY_PROMPTS[0], "What happened next?"]},
        {"id": 2, "category": "story", "turns": [STORY_PROMPTS[1]]},
        {"id": 3, "category": "short", "turns": [STORY_PROMPTS[2]]},
    ]
    draft = random_draft(seed=1, draft_vocab_size=512)
    result = evaluate_set(stories, draft, tokenizer, questions, [1, 3], 24)
    assert result["turns"] == 4 and result["turns_skipped_too_long"] == 0
    assert result["baseline"]["tokens"] > 0 and result["baseline"]["tokens_per_s"] > 0
    for k in ("1", "3"):
        metrics = result["k"][k]
        assert metrics["mismatches"] == 0
        assert metrics["tokens"] == result["baseline"]["tokens"]
        per_category = metrics["per_category"]
        assert set(per_category) == {"story", "short"}
        assert sum(c["drafts"] for c in per_category.values()) == metrics["drafts"]
        assert sum(c["accepted"] for c in per_category.values()) == metrics["accepted"]
        assert metrics["mean_acceptance_length"] == pytest.approx(1 + metrics["accepted"] / metrics["drafts"])
        assert len(metrics["acceptance_rate_per_position"]) == int(k)
    results = {"sets": {"stories": result}}
    out_png = tmp_path / "eval.png"
    plot(results, str(out_png))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(results)  # serialisable as is


def test_too_long_prompts_are_skipped_with_their_later_turns(stories, tokenizer):
    long_turn = " ".join(["Lily saw a big red ball in the park."] * 60)
    questions = [{"id": 1, "category": "c", "turns": [long_turn, "and then?"]}]
    result = evaluate_set(stories, random_draft(), tokenizer, questions, [2], 16)
    assert result["turns"] == 0 and result["turns_skipped_too_long"] == 2
    assert result["k"]["2"]["drafts"] == 0 and result["k"]["2"]["mean_acceptance_length"] == 1.0
    assert result["k"]["2"]["per_category"] == {}  # no row of τ 1.0 for a category nothing was measured in


# ---------------------------------------------------------------------------------------------------
# a draft head briefly trained with the project's TTT on the target's own greedy outputs


@pytest.fixture(scope="module")
def trained_draft(stories, tokenizer):
    """40 TTT steps on 6 greedy continuations (K = V). Returns the draft and TTT's simulated tau."""
    from eagle3build.attention.dense import sdpa_attention
    from eagle3build.ttt.batch import pack
    from eagle3build.ttt.forward import ttt_forward
    from eagle3build.ttt.loss import step_loss_weights, summarize, weighted_loss

    head = load_target_head(STORIES)
    vocab = head.vocab_size
    d2t, t2d = torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    config = DraftConfig.from_target(head, vocab)
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(config, head, d2t, t2d)
    samples, probs = [], []
    with torch.no_grad():
        for text in TRAIN_PROMPTS:
            ids = prompt_ids(tokenizer, text)
            sequence = ids + greedy_generate(stories, ids, 64, {EOS})
            out = stories(torch.tensor([sequence]), output_hidden_states=True)
            streams = [out.hidden_states[layer][0] for layer in config.aux_layer_ids]
            hidden = torch.stack(streams + [out.hidden_states[-1][0]], dim=1)  # slot 3 unused here
            loss_mask = torch.tensor([0] * len(ids) + [1] * (len(sequence) - len(ids)))
            samples.append((torch.tensor(sequence), loss_mask, hidden))
            probs.append(torch.softmax(out.logits[0], dim=-1))  # the target's distribution, K = V
    batch, probs = pack(samples), torch.cat(probs)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    weights = step_loss_weights(3, 0.8)
    for _ in range(40):
        stats = ttt_forward(draft, batch, probs, 3, sdpa_attention)
        optimizer.zero_grad()
        weighted_loss(stats, stats.count, weights).backward()
        optimizer.step()
    with torch.no_grad():
        stats = ttt_forward(draft.eval(), batch, probs, 3, sdpa_attention)
    simulated = summarize(stats.loss_sum, stats.correct, stats.count, weights)["acceptance_length"]
    return draft, simulated


TRAIN_PROMPTS = STORY_PROMPTS + [
    "Anna found a small cat.",
    "The boy liked to play with his ball.",
    "One day, a bird flew",
]


def test_trained_draft_is_lossless_and_matches_the_ttt_estimate(stories, tokenizer, trained_draft):
    """Inference feeds the draft what training did: the measured tau at k = 3 agrees with the
    acceptance length TTT simulates on the same text (an off-by-one in the input token, the aux
    position or the RoPE position would drop acceptance to ~1)."""
    draft, simulated = trained_draft
    stats = AcceptanceStats(3)
    for text in TRAIN_PROMPTS:
        ids = prompt_ids(tokenizer, text)
        tokens, accepts = speculative_generate(stories, draft, ids, 3, 64, {EOS})
        assert tokens == greedy_generate(stories, ids, 64, {EOS})
        for accepted in accepts:
            stats.add(accepted)
    tau = stats.summary()["mean_acceptance_length"]
    assert simulated > 1.6
    assert tau == pytest.approx(simulated, abs=0.4)
    # k = 7 runs past the 3 trained steps: still lossless
    ids = prompt_ids(tokenizer, TRAIN_PROMPTS[0])
    assert speculative_generate(stories, draft, ids, 7, 64, {EOS})[0] == greedy_generate(
        stories, ids, 64, {EOS}
    )


@pytest.mark.parametrize("k", [1, 3, 7])
def test_one_teacher_forced_pass_predicts_every_round_of_the_loop(stories, tokenizer, trained_draft, k):
    """acceptance.py reads each round's acceptance off the greedy decode; it must equal the real loop."""
    from eagle3build.evaluate.acceptance import acceptance_for_sequence

    draft, _ = trained_draft
    total = 0
    for text in TRAIN_PROMPTS + STORY_PROMPTS:
        ids = prompt_ids(tokenizer, text)
        tokens, accepts = speculative_generate(stories, draft, ids, k, 48, {EOS})
        extended = greedy_generate(stories, ids, 48 + k + 1, {EOS})
        with torch.no_grad():
            out = stories(torch.tensor([ids + extended]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in draft.config.aux_layer_ids], dim=-1)
        simulated = acceptance_for_sequence(draft, torch.tensor(ids + extended), aux, len(ids), [k],
                                            len(ids) + len(tokens))[k]
        assert simulated == accepts, text
        total += sum(accepts)
    assert total > 10  # the draft accepts often enough for the comparison to mean something


def test_evaluate_end_to_end_from_an_exported_checkpoint(tmp_path, stories, tokenizer, trained_draft):
    from eagle3build.atomic import save_safetensors_atomic
    from eagle3build.draft.export import export
    from eagle3build.evaluate.hf import evaluate

    draft, _ = trained_draft
    weights = {n: p.detach() for n, p in draft.named_parameters() if p.requires_grad}
    weights |= {"d2t": draft.d2t, "t2d": draft.t2d}
    save_safetensors_atomic(tmp_path / "draft.safetensors", weights, {"draft_config": draft.config.to_dict()})
    save_safetensors_atomic(tmp_path / "mapping.safetensors", {"d2t": draft.d2t, "t2d": draft.t2d})
    export(
        str(tmp_path / "draft.safetensors"),
        str(tmp_path / "mapping.safetensors"),
        str(STORIES),
        str(tmp_path / "export"),
        {"dtype": "float32"},
    )

    questions = tmp_path / "questions.jsonl"
    lines = [
        {"question_id": 1, "category": "animals", "turns": [TRAIN_PROMPTS[3], "What did Anna do next?"]},
        {"question_id": 2, "category": "play", "turns": [TRAIN_PROMPTS[4]]},
        {"question_id": 3, "category": "play", "turns": [TRAIN_PROMPTS[1]]},
        {"question_id": 4, "category": "never", "turns": ["left out by max_samples"]},
    ]
    questions.write_text("".join(json.dumps(q) + "\n" for q in lines))
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    target = {
        "path": str(STORIES),
        "revision": None,
        "trust_remote_code": False,
        "chat_template": str(template),
    }
    out_json, out_png = tmp_path / "eval" / "stories.json", tmp_path / "eval" / "stories.png"
    params = {"k": [1, 3], "max_new_tokens": 32, "max_samples": 3, "device": "cpu"}
    result = evaluate(
        str(tmp_path / "export"),
        target,
        [{"name": "stories", "path": str(questions)}],
        str(out_json),
        str(out_png),
        params,
    )

    assert json.loads(out_json.read_text()) == result
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    stories_result = result["sets"]["stories"]
    assert stories_result["questions"] == 3 and stories_result["turns"] == 4
    for k in ("1", "3"):
        metrics = stories_result["k"][k]
        assert metrics["mismatches"] == 0
        assert set(metrics["per_category"]) == {"animals", "play"}
        assert metrics["tokens_per_s"] > 0 and metrics["speedup"] > 0
    assert stories_result["k"]["3"]["mean_acceptance_length"] > 1.5
    assert (
        stories_result["k"]["3"]["mean_acceptance_length"]
        > stories_result["k"]["1"]["mean_acceptance_length"]
    )


def test_batched_reference_decodes_give_the_same_acceptance_as_batch_one(stories, tokenizer):
    """evaluate.sequential_samples: the questions not run at batch 1 are decoded in left-padded batches
    (reference.py) — in fp32 the same decodes and so the same acceptance as one question at a time, with
    later turns asked after each question's own answer, and too-long turns skipped the same way."""
    from eagle3build.evaluate.hf import batched_references

    long_turn = " ".join(["Lily saw a big red ball in the park."] * 60)
    questions = [
        {"id": 1, "category": "story", "turns": [STORY_PROMPTS[0], "What happened next?"]},
        {"id": 2, "category": "story", "turns": [STORY_PROMPTS[1], "And then?", "The end?"]},
        {"id": 3, "category": "short", "turns": [STORY_PROMPTS[2]]},
        {"id": 4, "category": "short", "turns": [long_turn, "and then?"]},
    ]
    draft = random_draft(seed=1, draft_vocab_size=512)
    one_by_one = evaluate_set(stories, draft, tokenizer, questions, [1, 3], 24, [])
    references = batched_references(stories, tokenizer, questions, [1, 3], 24, sequential=[0], batch_size=2)
    assert sorted(references) == [(1, 0), (1, 1), (1, 2), (2, 0)]  # question 0 runs at batch 1; 3 is too long
    batched = evaluate_set(stories, draft, tokenizer, questions, [1, 3], 24, [3], references)
    assert batched["turns"] == one_by_one["turns"] == 6
    assert batched["turns_skipped_too_long"] == one_by_one["turns_skipped_too_long"] == 2
    for k in ("1", "3"):
        for key in ("drafts", "accepted", "mean_acceptance_length"):
            assert batched["k"][k][key] == one_by_one["k"][k][key]
    assert batched["k"]["3"]["mismatches"] == 0 and batched["k"]["3"]["simulation_agrees"] == 2  # question 0 only
    assert batched["baseline"]["tokens"] < one_by_one["baseline"]["tokens"]  # only batch-1 turns are timed


def test_sequential_questions_are_spread_over_the_set():
    """A set ordered by category (MT-Bench: 10 writing questions first) gives every category a share of the
    step-by-step decodes, not just the first category."""
    from eagle3build.evaluate.hf import sequential_indices

    assert sequential_indices(80, 10) == [0, 8, 16, 24, 32, 40, 48, 56, 64, 72]
    assert sequential_indices(5, 2) == [0, 2]
    assert sequential_indices(3, 5) == sequential_indices(3, None) == [0, 1, 2]
    assert sequential_indices(4, 0) == []
    categories = [f"c{i // 10}" for i in range(80)]
    assert {categories[i] for i in sequential_indices(80, 8)} == set(categories)


def test_float32_restores_every_weight_exactly(stories):
    """The recheck's float32 block leaves target and draft as they were: same dtypes, same bits, ties kept."""
    import copy

    from eagle3build.evaluate.hf import float32

    target = copy.deepcopy(stories).to(torch.bfloat16)
    draft = random_draft().to(torch.bfloat16)
    before = {name: t.clone() for m in (target, draft) for name, t in m.state_dict().items()}
    tied = target.get_output_embeddings().weight is target.get_input_embeddings().weight
    with float32(target, draft):
        assert {p.dtype for m in (target, draft) for p in m.parameters()} == {torch.float32}
    after = {name: t for m in (target, draft) for name, t in m.state_dict().items()}
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert (target.get_output_embeddings().weight is target.get_input_embeddings().weight) == tied


def _corrupt_below_float32(monkeypatch, always: bool = False):
    """speculative_generate whose output parts from the reference at its last token whenever the weights are
    not float32 (as bf16 rounding does at a near-tie), or always (a fault of the loop)."""
    import eagle3build.evaluate.hf as hf

    real = hf.speculative_generate

    def parting(target, *args, **kwargs):
        tokens, accepts = real(target, *args, **kwargs)
        if always or next(target.parameters()).dtype != torch.float32:
            tokens = tokens[:-1] + [(tokens[-1] + 1) % 512]
        return tokens, accepts

    monkeypatch.setattr(hf, "speculative_generate", parting)


def test_bf16_mismatches_are_decoded_again_in_float32(stories, tokenizer, monkeypatch):
    """A turn whose bf16 loop parts from the reference is decoded again in float32, where a lossless loop
    matches: the report says both, for each k (a turn that parted at two k is counted at both, its
    reference decoded once), and the weights are bf16 again afterwards."""
    import copy

    target = copy.deepcopy(stories).to(torch.bfloat16)
    draft = random_draft(seed=1, draft_vocab_size=512).to(torch.bfloat16)
    questions = [{"id": i, "category": "story", "turns": [text]} for i, text in enumerate(STORY_PROMPTS[:2])]
    _corrupt_below_float32(monkeypatch)
    rows = evaluate_set(target, draft, tokenizer, questions, [1, 3], 16, [1, 3])["k"]
    for row in rows.values():
        assert row["mismatches"] == 2
        assert row["float32_recheck"] == {"turns": 2, "mismatches": 0, "simulation_agrees": 2}
    assert {p.dtype for m in (target, draft) for p in m.parameters()} == {torch.bfloat16}


def test_a_mismatch_that_stays_in_float32_is_reported(stories, tokenizer, monkeypatch):
    import copy

    target = copy.deepcopy(stories).to(torch.bfloat16)
    draft = random_draft(seed=1, draft_vocab_size=512).to(torch.bfloat16)
    questions = [{"id": 0, "category": "story", "turns": [STORY_PROMPTS[0]]}]
    _corrupt_below_float32(monkeypatch, always=True)
    row = evaluate_set(target, draft, tokenizer, questions, [3], 16, [3])["k"]["3"]
    assert row["mismatches"] == 1 and row["float32_recheck"]["mismatches"] == 1


def test_float32_targets_are_not_rechecked(stories, tokenizer, monkeypatch):
    _corrupt_below_float32(monkeypatch, always=True)
    questions = [{"id": 0, "category": "story", "turns": [STORY_PROMPTS[0]]}]
    row = evaluate_set(stories, random_draft(), tokenizer, questions, [3], 16, [3])["k"]["3"]
    assert row["mismatches"] == 1 and "float32_recheck" not in row


def test_a_target_too_big_for_float32_is_reported_not_rechecked(stories, tokenizer, monkeypatch):
    """Out of memory in float32: the report says the recheck was skipped, and the weights are bf16 again."""
    import copy

    import eagle3build.evaluate.hf as hf

    target = copy.deepcopy(stories).to(torch.bfloat16)
    draft = random_draft(seed=1, draft_vocab_size=512).to(torch.bfloat16)
    _corrupt_below_float32(monkeypatch)
    real = hf.greedy_generate

    def no_room_in_float32(model, *args, **kwargs):
        if next(model.parameters()).dtype == torch.float32:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(hf, "greedy_generate", no_room_in_float32)
    questions = [{"id": 0, "category": "story", "turns": [STORY_PROMPTS[0]]}]
    row = evaluate_set(target, draft, tokenizer, questions, [3], 16, [3])["k"]["3"]
    assert row["mismatches"] == 1
    assert row["float32_recheck"] == {"turns": 1, "skipped": "out of memory in float32"}
    assert {p.dtype for m in (target, draft) for p in m.parameters()} == {torch.bfloat16}
