"""Acceptance at temperature > 0: speculative sampling is lossless (the emitted tokens are distributed as
the target's own samples, a statistical test on a tiny model that fails for a broken rule), reproducible,
and reported beside the greedy rows by both backends."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import TargetReplayDraft

from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.errors import ConfigError
from eagle3build.evaluate.hf import greedy_generate, speculative_generate
from eagle3build.evaluate.sampling import Greedy, Sampled, probabilities, rule_for
from eagle3build.evaluate.settings import decode_seed, sampled_temperatures

torch.set_num_threads(1)  # 2 threads spin against the other jobs on a shared 2-core machine

V, K, H = 8, 6, 32  # target vocab, draft vocab (two target tokens the draft can never propose), hidden
PROMPT = [1, 4, 2, 7]
DRAFTED = [0, 1, 2, 4, 5, 7]  # target ids of the draft vocabulary: 3 and 6 come only from the residual


def tiny_target():
    """A random 2-layer Llama over 8 tokens with sharp, varied next-token distributions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)  # init std 0.02 gives near-uniform p: nothing to tell apart
    return model


def tiny_draft(seed: int = 1) -> Eagle3Draft:
    """An untrained EAGLE-3 head for the tiny target (a near-uniform q over its 6 tokens): it disagrees with
    the target's sharp p, so rejections are common, and a wrong rule's output leans visibly towards q."""
    config = DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                         vocab_size=V, draft_vocab_size=K, target_hidden_size=H, aux_layer_ids=[0, 1, 2])
    torch.manual_seed(seed)
    draft = Eagle3Draft(config).eval()
    with torch.no_grad():
        draft.embed_tokens.weight.normal_()
        drafted = torch.tensor(DRAFTED)
        draft.d2t.copy_(drafted - torch.arange(K))
        draft.t2d.zero_()
        draft.t2d[drafted] = True
    return draft


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def exact_marginals(model, prompt: list[int], n: int, temperature: float, top_p: float) -> torch.Tensor:
    """[n, V]: P(y_i = v) of the target's own sampling, by enumerating every prefix (V^(n-1) of them)."""
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=n - 1)), dtype=torch.long)
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 :]  # [P, n, V]: y_1 .. y_n given the prefix
    probs = probabilities(logits, temperature, top_p)
    # probability of each prefix: prod_i p(y_i | y_<i)
    weight = torch.ones(len(prefixes))
    marginals = torch.zeros(n, V)
    for i in range(n):
        # every prefix sharing the first i tokens has the same p(y_i+1 | ...): weight it by P(y_1..y_i),
        # counted once per distinct prefix of length i (the rows repeat V^(n-1-i) times)
        repeats = V ** (n - 1 - i)
        marginals[i] = (weight[:, None] * probs[:, i]).sum(0) / repeats
        if i < n - 1:
            weight = weight * probs[torch.arange(len(prefixes)), i, prefixes[:, i]]
    return marginals


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of observed counts against probabilities, cells with < 5 expected pooled;
    returns (statistic, p-value) from the chi-square survival function."""
    total = counts.sum()
    expected = expected_probs.double() * total
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    assert torch.all(counts[~keep] == 0), "a token the target never samples was emitted"
    counts, expected = counts[keep].double(), expected[keep]
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    if dof == 0:  # one possible token (top-p can leave one): every count is in it, as asserted above
        return 0.0, 1.0
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))
    return statistic, p_value


def sampled_outputs(target, draft, runs: int, n: int, k: int, temperature: float, top_p: float, method: str):
    """[runs, n] first n emitted tokens of seeded speculative-sampling decodes, and every round's accepts."""
    outputs, accepts = [], []
    for run in range(runs):
        rule = rule_for(temperature, top_p, decode_seed(7, run), method, torch.device("cpu"))
        tokens, accepted = speculative_generate(target, draft, PROMPT, k, n, set(), rule)
        outputs.append(tokens[:n])
        accepts += accepted
    return torch.tensor(outputs), accepts


RUNS, N_TOKENS = 600, 3


def lossless_statistics(target, draft, k: int, temperature: float, top_p: float = 1.0,
                        method: str = "probabilistic") -> tuple[list, list]:
    """Per emitted position 1..N_TOKENS: (statistic, p-value) of its counts against the exact marginal."""
    outputs, accepts = sampled_outputs(target, draft, RUNS, N_TOKENS, k, temperature, top_p, method)
    marginals = exact_marginals(target, PROMPT, N_TOKENS, temperature, top_p)
    tests = [chi_square(torch.bincount(outputs[:, i], minlength=V), marginals[i]) for i in range(N_TOKENS)]
    return tests, accepts


@pytest.mark.parametrize("k, temperature, top_p, method, draft_seed", [
    (2, 1.0, 1.0, "probabilistic", 1),
    (1, 0.7, 0.9, "probabilistic", 1),
    (2, 1.0, 0.9, "greedy", 4),  # a head whose argmax is the target's likely token about half the time
])  # fmt: skip
def test_speculative_sampling_emits_the_targets_distribution(target, k, temperature, top_p, method, draft_seed):
    """Tokens 2 and 3 come from the rule (acceptance, residual resampling — tokens 3 and 6 are outside the
    draft vocabulary, so only the residual emits them — and the bonus token); their frequencies over 600
    seeded decodes match the target's exact marginals (pinned seeds: the statistic is deterministic), with
    proposals drawn from q or taken as its argmax (a point-mass q, vLLM's default)."""
    tests, accepts = lossless_statistics(target, tiny_draft(draft_seed), k, temperature, top_p, method)
    # the draft must be wrong often, or the test would not exercise the residual
    assert 0.15 < sum(a == 0 for a in accepts) / len(accepts) < 0.85
    for position, (statistic, p_value) in enumerate(tests, start=1):
        assert p_value > 1e-3, f"y{position}: chi-square {statistic:.1f} (p = {p_value:.2g})"


def test_the_test_fails_when_a_rejection_draws_from_p_instead_of_the_residual(target, monkeypatch):
    """The same statistic for a broken rule (a rejected position samples p, not normalize(max(0, p - q))):
    the output is then biased towards the draft, and the test must see it."""
    monkeypatch.setattr(Sampled, "residual", lambda self, p, q: p)
    tests, _ = lossless_statistics(target, tiny_draft(), 2, 1.0)
    assert tests[0][1] > 1e-3  # y1 is the prefill's own sample, untouched by the rule
    assert min(p_value for _, p_value in tests[1:]) < 1e-8, tests


def test_the_test_fails_when_every_proposal_is_accepted(target, monkeypatch):
    """Accepting drafts unconditionally (acceptance without the min(1, p/q) coin) is caught too."""
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.zeros(()))
    tests, _ = lossless_statistics(target, tiny_draft(), 2, 1.0)
    assert min(p_value for _, p_value in tests[1:]) < 1e-8, tests


def test_first_proposals_are_accepted_at_the_rate_their_distributions_give(target, monkeypatch):
    """The share of rounds whose first proposal is accepted equals the mean over those rounds of
    sum_x min(p(x), q(x)) (= 1 - TV(p, q)), computed from the very p and q each round verifies with: the
    reported tau at T > 0 is what the draft's distributions are worth, not an artefact of the coin. (On the
    SmolLM2 head trained on the GPU: 0.431 measured against 0.434 expected over 1,567 rounds.)"""
    expected, accepted = [], []
    verify = Sampled.verify

    def recording(self, proposals, drafted, logits):
        expected.append(float(torch.minimum(self.probs(logits)[0], drafted[0]).sum()))
        result = verify(self, proposals, drafted, logits)
        accepted.append(result[0] >= 1)
        return result

    monkeypatch.setattr(Sampled, "verify", recording)
    sampled_outputs(target, tiny_draft(), 400, 12, 2, 1.0, 1.0, "probabilistic")
    rounds, mean = len(expected), sum(expected) / len(expected)
    assert 0.2 < mean < 0.8 and rounds > 1000  # the coin decides often
    stderr = (mean * (1 - mean) / rounds) ** 0.5
    assert abs(sum(accepted) / rounds - mean) < 4 * stderr, (sum(accepted) / rounds, mean, rounds)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_batched_samples_are_the_targets_own_sampling(target, temperature, top_p):
    """The samples τ at T > 0 is read off (reference.decode_batch) follow the target's distribution at T and
    top-p, the very p the acceptance probabilities divide by: no top-k or other default of `generate`."""
    from eagle3build.evaluate.reference import decode_batch

    rows = decode_batch(target, [PROMPT] * RUNS, N_TOKENS, set(), 0, 200,
                        {"temperature": temperature, "top_p": top_p, "seed": 5})
    outputs = torch.tensor(rows)
    marginals = exact_marginals(target, PROMPT, N_TOKENS, temperature, top_p)
    for i in range(N_TOKENS):
        statistic, p_value = chi_square(torch.bincount(outputs[:, i], minlength=V), marginals[i])
        assert p_value > 1e-3, (i, statistic)


def first_round_distribution(target, draft, k: int, temperature: float, top_p: float, method: str) -> torch.Tensor:
    """[k+1]: P(the first round after PROMPT accepts a tokens) as the teacher-forced estimator gives it
    (hf.acceptance_probabilities over the target's samples), exactly: every sample x_1 .. x_k+1 enumerated
    with its probability under the target's sampling."""
    from eagle3build.evaluate.hf import acceptance_probabilities

    samples = torch.tensor(list(itertools.product(range(V), repeat=k + 1)), dtype=torch.long)  # [V^(k+1), k+1]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(samples), -1), samples], dim=1)
    with torch.no_grad():
        p = probabilities(target(input_ids=ids).logits[:, len(PROMPT) - 1 : -1], temperature, top_p)
    weight = p.gather(-1, samples[:, :, None])[..., 0].prod(-1)  # P(x_1 .. x_k+1)
    column = len(PROMPT) - 1  # the round starts from the verified prefix PROMPT + x_1
    dist = torch.zeros(k + 1, dtype=torch.float64)
    for row, w in zip(ids.tolist(), weight.tolist(), strict=True):
        if w == 0:
            continue
        r = acceptance_probabilities(target, draft, row, k, temperature, top_p, method)[:, column].double()
        reach = torch.cat([torch.ones(1, dtype=torch.float64), r.cumprod(0)])  # P(accept >= a | x)
        dist += w * (reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)]))
    return dist


@pytest.mark.parametrize("k, temperature, top_p, method, draft_seed, exact", [
    (2, 1.0, 1.0, "probabilistic", 1, True),
    (2, 1.0, 0.9, "greedy", 4, True),
    (2, 1.0, 1.0, "probabilistic", 1, False),  # the sampled rounds read with the greedy rule: must be caught
])  # fmt: skip
def test_rounds_read_off_the_targets_samples_are_the_loops_rounds(target, k, temperature, top_p, method, draft_seed,
                                                                  exact):
    """τ at T > 0 over every question comes from the target's own samples and one teacher-forced pass
    (acceptance.sampled_acceptance): the first round's accepted count, exactly as that estimator gives it,
    matches 600 seeded step-by-step speculative-sampling decodes (chi-square); read with the wrong rule
    (a proposal accepted when the sample equals the draft's argmax), it does not."""
    draft = tiny_draft(draft_seed)
    first = []
    for run in range(RUNS):
        rule = rule_for(temperature, top_p, decode_seed(11, run), method, torch.device("cpu"))
        _, accepted = speculative_generate(target, draft, PROMPT, k, k + 2, set(), rule)
        first.append(accepted[0])
    counts = torch.bincount(torch.tensor(first), minlength=k + 1)
    expected = first_round_distribution(target, draft, k, temperature, top_p, method if exact else "greedy")
    assert abs(float(expected.sum()) - 1) < 1e-6
    statistic, p_value = chi_square(counts, expected)
    if exact:
        assert 0.1 < counts[0] / RUNS < 0.9  # rejections and acceptances both common
        assert p_value > 1e-3, (counts.tolist(), (expected * RUNS).tolist(), statistic)
    else:
        assert p_value < 1e-8, (counts.tolist(), (expected * RUNS).tolist(), statistic)


# ---------------------------------------------------------------------------------------------------
# the rule's pieces


def test_probabilities_scale_by_temperature_and_keep_the_top_p_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    assert torch.allclose(probabilities(logits, 0.5), torch.softmax(logits / 0.5, -1))
    full = torch.softmax(logits, -1)  # [0.64, 0.24, 0.09, 0.03]
    nucleus = probabilities(logits, 1.0, top_p=0.8)  # 0.64 < 0.8 <= 0.64 + 0.24: the first two
    assert torch.allclose(nucleus, torch.tensor([*(full[:2] / full[:2].sum()), 0.0, 0.0]))
    assert torch.equal(probabilities(logits, 1.0, top_p=0.5), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert isinstance(rule_for(0.0, 1.0, 0, "probabilistic", torch.device("cpu")), Greedy)


class LogitOracle(TargetReplayDraft):
    """Drafts with the target's own next-token logits (q = p), from the token history it keeps in its "KV
    cache" (conftest): a misaligned position, input token or cache crop in the decoding loop makes q differ
    from p, and then proposals get rejected."""

    def __init__(self, target, first_token: int):
        super().__init__(target, first_token)
        self.config = type("Config", (), {"aux_layer_ids": [0, 1, 2], "vocab_size": V})()

    def layer(self, input_ids, hidden, position_ids, kv_cache=None):
        start, logits, cache = self.replay(input_ids, position_ids, kv_cache)
        return logits[start + 1 :][None], cache  # position j predicts x[j + 2]

    def draft_ids(self):
        return torch.arange(V)


def test_a_draft_that_samples_the_targets_distribution_is_always_accepted(target):
    """q = p accepts every proposal (min(1, p/q) = 1), in every round and at every k: the loop feeds the
    draft and the verifier the same positions at temperature > 0 too."""
    for k in (1, 3):
        for seed in range(4):
            rule = rule_for(1.0, 1.0, seed, "probabilistic", torch.device("cpu"))
            tokens, accepts = speculative_generate(target, LogitOracle(target, PROMPT[0]), PROMPT, k, 20, set(), rule)
            assert len(tokens) == 20 and accepts == [k] * len(accepts), (k, seed, accepts)


def test_a_temperature_near_zero_decodes_greedily(target):
    """The sampled rule's limit T -> 0 is the greedy rule: plain and speculative decodes both give the
    target's greedy output."""
    reference = greedy_generate(target, PROMPT, 16, set())
    for seed in range(3):
        cold = rule_for(1e-4, 1.0, seed, "probabilistic", torch.device("cpu"))
        assert greedy_generate(target, PROMPT, 16, set(), cold) == reference
        assert speculative_generate(target, tiny_draft(), PROMPT, 2, 16, set(), cold)[0] == reference


def test_sampled_decodes_are_reproducible_from_their_seed(target):
    draft = tiny_draft()

    def decode(seed):
        rule = rule_for(1.0, 1.0, seed, "probabilistic", torch.device("cpu"))
        return speculative_generate(target, draft, PROMPT, 3, 16, set(), rule)

    assert decode(5) == decode(5)
    assert len({str(decode(seed)) for seed in range(4)}) > 1
    assert decode_seed(0, 3, 1, "target") == decode_seed(0, 3, 1, "target") != decode_seed(1, 3, 1, "target")


def test_temperatures_must_include_zero_and_be_valid():
    from eagle3build.config import resolve_section

    assert sampled_temperatures(resolve_section("evaluate", {})) == []
    assert sampled_temperatures(resolve_section("evaluate", {"temperatures": [1, 0, 0.7]})) == [1.0, 0.7]
    with pytest.raises(ConfigError, match=r"evaluate\.temperatures.*lacks 0"):
        sampled_temperatures(resolve_section("evaluate", {"temperatures": [1.0]}))
    for bad in ([-0.5, 0], [0, 0], []):
        with pytest.raises(ConfigError, match=r"evaluate\.temperatures"):
            resolve_section("evaluate", {"temperatures": bad})
    with pytest.raises(ConfigError, match=r"evaluate\.top_p"):
        resolve_section("evaluate", {"top_p": 0})


# ---------------------------------------------------------------------------------------------------
# the hf report (stories260K)


def exported_random_draft(tmp_path) -> str:
    from test_evaluate import STORIES, random_draft

    from eagle3build.atomic import save_safetensors_atomic
    from eagle3build.draft.export import export

    draft = random_draft(seed=3, draft_vocab_size=256)
    weights = {n: p.detach() for n, p in draft.named_parameters() if p.requires_grad}
    weights |= {"d2t": draft.d2t, "t2d": draft.t2d}
    save_safetensors_atomic(tmp_path / "draft.safetensors", weights, {"draft_config": draft.config.to_dict()})
    save_safetensors_atomic(tmp_path / "mapping.safetensors", {"d2t": draft.d2t, "t2d": draft.t2d})
    export(str(tmp_path / "draft.safetensors"), str(tmp_path / "mapping.safetensors"), str(STORIES),
           str(tmp_path / "export"), {"dtype": "float32"})
    return str(tmp_path / "export")


def test_hf_report_has_the_sampled_rows_beside_the_greedy_ones(tmp_path):
    from conftest import STORY_CHAT_TEMPLATE, need_shared
    from test_evaluate import STORIES, STORY_PROMPTS

    from eagle3build.evaluate.hf import evaluate

    need_shared()
    questions = tmp_path / "questions.jsonl"
    lines = [{"question_id": 1, "category": "story", "turns": [STORY_PROMPTS[0], "And then?"]},
             {"question_id": 2, "category": "short", "turns": [STORY_PROMPTS[2]]}]
    questions.write_text("".join(json.dumps(q) + "\n" for q in lines))
    (tmp_path / "chat.jinja").write_text(STORY_CHAT_TEMPLATE)
    target = {"path": str(STORIES), "revision": None, "trust_remote_code": False,
              "chat_template": str(tmp_path / "chat.jinja")}
    draft = exported_random_draft(tmp_path)
    sets = [{"name": "stories", "path": str(questions)}]
    greedy = {"k": [1, 2], "max_new_tokens": 12, "device": "cpu", "sequential_k": [2]}
    sampling = {**greedy, "temperatures": [0, 1.0], "top_p": 0.95, "seed": 4}

    def run(params, name):
        return evaluate(draft, target, sets, str(tmp_path / f"{name}.json"), str(tmp_path / f"{name}.png"), params)

    plain, first, again = run(greedy, "plain"), run(sampling, "first"), run(sampling, "again")
    # greedy-only configs write what they always wrote; the sampled report adds keys and changes none
    assert "temperatures" not in plain and "at_temperature" not in plain["sets"]["stories"]
    assert first["temperatures"] == [0.0, 1.0] and first["top_p"] == 0.95 and first["seed"] == 4
    assert first["draft_sample_method"] == "probabilistic"
    untimed = ("seconds", "tokens_per_s", "speedup")

    def strip(report):
        if isinstance(report, dict):
            return {k: strip(v) for k, v in report.items() if k not in untimed and k != "baseline"}
        return report

    assert strip(first["sets"]["stories"]["k"]) == strip(plain["sets"]["stories"]["k"])
    sampled = first["sets"]["stories"]["at_temperature"]["1.0"]
    assert strip(sampled) == strip(again["sets"]["stories"]["at_temperature"]["1.0"])  # seeded
    # every k over every turn, from the target's batched samples
    assert sampled["temperature"] == 1.0 and sampled["turns"] == 3 and list(sampled["k"]) == ["1", "2"]
    for k, row in sampled["k"].items():
        assert row["drafts"] > 0 and 1.0 <= row["mean_acceptance_length"] <= 1 + int(k)
        assert sum(c["drafts"] for c in row["per_category"].values()) == row["drafts"]
    # the sequential questions (both here) decoded step by step for the sequential k: timing and the loop's τ
    loop = sampled["sequential"]
    assert loop["turns"] == 3 and list(loop["k"]) == ["2"]
    row = loop["k"]["2"]
    assert row["drafts"] > 0 and 1.0 <= row["mean_acceptance_length"] <= 3.0
    assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and "mismatches" not in row
    assert loop["baseline"]["tokens"] > 0


# ---------------------------------------------------------------------------------------------------
# the vllm backend (tests/fake_vllm_spec_server.py)


def test_vllm_sends_the_temperature_and_reports_tau_per_temperature(tmp_path):
    """Each temperature runs on its own, so its counter differences are its own: the fake engine accepts
    `accept:` digits greedily and `sampled:` digits at T > 0; every sampled request (and its baseline
    replay) carries the temperature, top_p and a seed of its own."""
    from test_evaluate_vllm import TARGET, fake_export, params, write_questions

    from eagle3build.evaluate.vllm import evaluate

    questions = write_questions(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["a poem accept:33 sampled:10", "again accept:2"]},
        {"question_id": 2, "category": "math", "turns": ["two plus two accept:31 sampled:0"]},
    ])  # fmt: skip
    settings = {**params(tmp_path, env={"FAKE_VLLM_REQUESTS": str(tmp_path / "requests.jsonl")}),
                "temperatures": [0.0, 1.0], "top_p": 0.95, "seed": 3}
    result = evaluate(fake_export(tmp_path), TARGET, [{"name": "set", "path": questions}],
                      str(tmp_path / "set.json"), str(tmp_path / "set.png"), settings)

    assert result["temperatures"] == [0.0, 1.0] and result["top_p"] == 0.95 and result["seed"] == 3
    argv = json.loads((tmp_path / "argv.jsonl").read_text().splitlines()[0])["argv"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["draft_sample_method"] == "probabilistic"  # the schema's default, as the hf evaluator
    report = result["sets"]["set"]
    greedy_rounds, sampled_rounds = [3, 3, 2, 3, 1], [1, 0, 2, 0]  # a turn without sampled: uses accept:
    assert report["k"]["3"]["mean_acceptance_length"] == pytest.approx(1 + sum(greedy_rounds) / 5)
    assert report["k"]["3"]["mismatches"] == 0
    sampled = report["at_temperature"]["1.0"]
    assert sampled["temperature"] == 1.0 and sampled["top_p"] == 0.95 and sampled["turns"] == 3
    for j in (1, 2, 3):
        assert sampled["k"][str(j)]["mean_acceptance_length"] == pytest.approx(
            1 + sum(min(a, j) for a in sampled_rounds) / len(sampled_rounds))
    assert sampled["k"]["3"]["per_category"]["math"]["mean_acceptance_length"] == pytest.approx(1.0)
    assert "mismatches" not in sampled["k"]["3"] and sampled["baseline"]["tokens"] > 0
    assert sampled["engine_counters"]["drafts"] == len(sampled_rounds)

    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    greedy = [r for r in requests if r["temperature"] == 0.0]
    assert all(r["top_p"] is None and r["seed"] is None for r in greedy)
    hot = [r for r in requests if r["temperature"] == 1.0]
    assert len(hot) == 6  # 3 turns, served with and without the draft
    first_turn = [r for r in hot if r["content"].startswith("a poem")]
    assert [r["seed"] for r in first_turn] == [decode_seed(3, 1, 0)] * 2  # the baseline replays the draws
    assert all(r["top_p"] == 0.95 for r in hot)


def test_the_fake_engine_checks_sampling_fields_as_vllm_does():
    from fake_vllm_spec_server import sampling_error

    assert sampling_error({"temperature": 1.0, "top_p": 0.9, "seed": 12}) is None
    assert sampling_error({"temperature": 0.0}) is None and sampling_error({}) is None
    assert "temperature must be non-negative" in sampling_error({"temperature": -0.1})
    assert "top_p must be in (0, 1]" in sampling_error({"temperature": 1.0, "top_p": 0.0})
    assert "seed" in sampling_error({"seed": 1.5})


def test_the_rule_passes_the_sampling_keys_when_a_temperature_is_above_zero(tmp_path):
    """Asking for T > 0 adds temperatures, top_p and seed to the evaluate rule's params (they change the
    result); greedy-only configs keep the params they had (tests/test_rule_params.py)."""
    from conftest import STORIES
    from test_chain import chain_config
    from workflow_util import copy_workflow, planned_params, write_config

    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path)
    config = chain_config()
    config["evaluate"] |= {"temperatures": [0.0, 1.0], "top_p": 0.5, "seed": 9, "draft_sample_method": "greedy"}
    write_config(wd, config)
    (planned,) = planned_params(wd)["evaluate"]
    sampling = "'temperatures': [0.0, 1.0], 'top_p': 0.5, 'seed': 9, 'draft_sample_method': 'greedy'"
    assert f"'sequential_k': [3], {sampling}" in planned


@pytest.mark.parametrize("sequential_samples, stepwise", [(2, [[0, 2]]), (0, [])])
def test_sampled_rows_cover_every_question_and_step_by_step_only_the_sequential_ones(tmp_path, monkeypatch,
                                                                                      sequential_samples, stepwise):
    """At T > 0 τ comes from every question (batched samples); evaluate.sequential_samples bounds the
    step-by-step decodes to N questions spread over the set (0: none), as it does at T = 0."""
    from types import SimpleNamespace

    import eagle3build.evaluate.hf as hf

    sampled, greedy, batched = [], [], []
    model = SimpleNamespace(dtype=torch.float32, config=SimpleNamespace(vocab_size=8))
    monkeypatch.setattr(hf, "load_target_tokenizer", lambda target: lambda text, **kw: {"input_ids": [1]})
    monkeypatch.setattr(hf, "load_target_model", lambda target, device: model)
    monkeypatch.setattr(hf, "load_draft", lambda *a: SimpleNamespace(config=model.config))
    monkeypatch.setattr(hf, "greedy_generate", lambda *a, **k: [])
    monkeypatch.setattr(hf, "speculative_generate", lambda *a, **k: ([], []))
    monkeypatch.setattr(hf, "batched_references", lambda target, tok, questions, *a: {"n": len(questions)})
    monkeypatch.setattr(hf, "evaluate_set", lambda *a: greedy.append(len(a[3])) or {"k": {}, "turns": len(a[3])})
    monkeypatch.setattr(hf, "evaluate_sampled_set", lambda *a: sampled.append([q["id"] for q in a[3]]) or {})
    monkeypatch.setattr(hf, "sampled_acceptance_set", lambda *a: batched.append(len(a[3])) or {"turns": len(a[3])})
    monkeypatch.setattr(hf, "plot", lambda *a: None)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(f'{{"question_id": {i}, "category": "c", "turns": ["hi {i}"]}}\n' for i in range(5)))
    report = hf.evaluate("unused", {"path": "unused"}, [{"name": "s", "path": str(questions)}],
                         str(tmp_path / "e.json"), str(tmp_path / "e.png"),
                         {"temperatures": [0.0, 1.0], "sequential_samples": sequential_samples, "k": [1]})
    assert greedy == [5] and batched == [5] and sampled == stepwise
    assert ("sequential" in report["sets"]["s"]["at_temperature"]["1.0"]) == bool(stepwise)
