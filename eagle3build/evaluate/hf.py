"""Acceptance length of an exported EAGLE-3 draft: chain speculative decoding with the HF target.

One decoding round (greedy, batch 1, k draft tokens):

1. The draft consumes the positions the target has verified since the last round: at position t its
   input is (token x[t+1], fc(aux states of the target at t)). Its output at the last such position
   proposes the first draft token.
2. It drafts k tokens autoregressively: each step feeds its own output as the hidden state (pre-norm;
   normed for a norm_output head, Eagle3Draft.feedback) and the token it just proposed, one RoPE
   position further.
3. The target verifies [last emitted token, d1..dk] in one forward (KV cache, hidden states on) and
   accepts the longest prefix of drafts equal to its own greedy tokens, then emits its own next token
   (the "bonus"). The target's cache is cropped to the accepted positions; the draft's cache keeps
   only positions computed from target states (drafted positions are recomputed from the target's
   states in the next round's step 1, as vLLM does).

The output is therefore exactly the target's greedy decode ("lossless"): `evaluate` checks that on
every turn and reports mismatches (in bf16 a verify forward over k+1 tokens can round differently
from a 1-token decode step, so a rare mismatch there is numerics, not a bug).

At a temperature > 0 (evaluate.temperatures) the same loop samples: the draft samples its proposals and
the verifier applies the speculative-sampling rule (sampling.Sampled), whose output is distributed as the
target's own samples. τ at T comes, like the greedy τ, from one teacher-forced pass per turn over the
target's own batched sample of it (`sampled_acceptance_set`; acceptance.py says why that is exact), for
every question and k; the sequential questions are also decoded step by step at T for each sequential k
(`evaluate_sampled_set`: timing and the loop's own τ).

Metrics follow vLLM's definitions: a draft = one verification of k proposed tokens; mean acceptance
length tau = 1 + accepted / drafts (the 1 is the bonus token); acceptance rate at position i =
(drafts whose first i proposals were all accepted) / drafts. Counts are the verifier's decisions, also
in a last round cut by max_new_tokens or an end-of-sequence token (vLLM counts them the same way).
"""

from __future__ import annotations

import inspect
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3build import FORMAT_VERSIONS
from eagle3build.atomic import atomic_path, write_json_atomic
from eagle3build.config import resolve_section
from eagle3build.data.chat import load_target_tokenizer
from eagle3build.data.formats import iter_jsonl
from eagle3build.errors import ConfigError, UserError
from eagle3build.evaluate.acceptance import acceptance_for_sequence, sample_rounds, sampled_acceptance
from eagle3build.evaluate.reference import reference_decodes
from eagle3build.evaluate.sampling import Greedy, Sampled, probabilities, rule_for
from eagle3build.evaluate.settings import decode_seed, sampled_temperatures, temperature_key
from eagle3build.hf_target import eos_token_ids, load_target_model, resolve_device, target_path

# ---------------------------------------------------------------------------------------------------
# Metrics


@dataclass
class AcceptanceStats:
    """vLLM's spec-decode counters for one draft length k."""

    k: int
    drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.k

    def add(self, accepted: int) -> None:
        """One verification that accepted the first `accepted` of k proposals."""
        if not 0 <= accepted <= self.k:
            raise ValueError(f"accepted {accepted} not in [0, {self.k}]")
        self.drafts += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.drafts += other.drafts
        self.accepted_per_position = [
            a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position, strict=True)
        ]

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_position)

    def summary(self) -> dict:
        drafts = max(self.drafts, 1)  # no drafts: every rate 0, tau 1
        return {
            "mean_acceptance_length": 1 + self.accepted / drafts,
            "acceptance_rate_per_position": [a / drafts for a in self.accepted_per_position],
            "drafts": self.drafts,
            "draft_tokens": self.drafts * self.k,
            "accepted": self.accepted,
        }


class Tally:
    """The counters of one evaluation: AcceptanceStats for each k, overall and per question category."""

    def __init__(self, ks: list[int]):
        self.ks = list(ks)
        self.overall = {k: AcceptanceStats(k) for k in self.ks}
        self.by_category: dict[str, dict[int, AcceptanceStats]] = {}

    def add(self, category: str, k: int, accepts: list[int]) -> None:
        """One decode's accepted-per-round at draft length k."""
        stats = self.by_category.setdefault(category, {j: AcceptanceStats(j) for j in self.ks})
        for accepted in accepts:
            self.overall[k].add(accepted)
            stats[k].add(accepted)

    def row(self, k: int) -> dict:
        return {**self.overall[k].summary(),
                "per_category": {name: stats[k].summary() for name, stats in sorted(self.by_category.items())}}


# ---------------------------------------------------------------------------------------------------
# Decoding loops


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers Cache (whichever crop() convention it has)."""
    remove = cache.get_seq_length() - length
    if remove <= 0:
        return
    # transformers >= 5.2x: crop(-n) removes n tokens; older releases: crop(max_length)
    first_param = next(iter(inspect.signature(cache.crop).parameters))
    cache.crop(-remove if first_param == "tokens_to_remove" else length)


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Cut at max_new_tokens and after the first end-of-sequence token."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, eos: set[int],
                    rule: Greedy | Sampled | None = None) -> list[int]:
    """Plain decoding with a KV cache, greedy (or sampled by `rule`): the reference output and the speed
    baseline."""
    rule = rule or Greedy()
    device = next(target.parameters()).device
    out = target(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
    cache, token = out.past_key_values, rule.next_token(out.logits[0, -1])
    tokens = [token]
    while len(tokens) < max_new_tokens and token not in eos:
        out = target(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
        token = rule.next_token(out.logits[0, -1])
        tokens.append(token)
    return tokens


def _aux_states(draft, hidden_states: tuple, positions: slice) -> torch.Tensor:
    """Concatenated aux states [1, T, 3*Ht]; hidden_states[L] is the stream entering layer L."""
    return torch.cat([hidden_states[layer][:, positions] for layer in draft.config.aux_layer_ids], dim=-1)


@torch.inference_mode()
def speculative_generate(
    target, draft, prompt_ids: list[int], k: int, max_new_tokens: int, eos: set[int],
    rule: Greedy | Sampled | None = None,
) -> tuple[list[int], list[int]]:
    """Chain speculative decoding, greedy (or speculative sampling: `rule`, sampling.py). Returns (tokens,
    accepted count of every verification)."""
    rule = rule or Greedy()
    device = next(target.parameters()).device
    out = target(
        input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, output_hidden_states=True
    )
    target_cache = out.past_key_values
    sequence = list(prompt_ids) + [rule.next_token(out.logits[0, -1])]  # positions 0 .. pos
    pos = len(prompt_ids)  # position of the newest token, not yet in the target's cache
    # target aux states of the positions the draft has not consumed yet (consumed_to .. pos-1)
    new_aux = _aux_states(draft, out.hidden_states, slice(None))
    draft_cache, consumed_to = None, 0  # the draft's cache holds positions [0, consumed_to)
    accepts: list[int] = []

    def emitted() -> list[int]:
        return sequence[len(prompt_ids) :]

    while len(emitted()) < max_new_tokens and sequence[-1] not in eos:
        # 1. Consume the verified positions: input at t is (x[t+1], fc(aux[t])).
        tokens = torch.tensor([sequence[consumed_to + 1 : pos + 1]], device=device)
        positions = torch.arange(consumed_to, pos, device=device).unsqueeze(0)
        hidden, draft_cache = draft.layer(tokens, draft.project_aux(new_aux), positions, draft_cache)
        consumed_to = pos
        # 2. Draft k tokens. Drafted positions go into a scratch cache that is dropped after this round
        #    (= cropping the draft's cache back to `consumed_to`).
        hidden, scratch_cache = hidden[:, -1:], draft_cache
        proposals, drafted = [], []
        for i in range(k):
            token, proposal = rule.propose(draft, draft.logits(hidden))  # [1, 1] target ids
            proposals.append(int(token))
            drafted.append(proposal)
            if i + 1 < k:
                position = torch.tensor([[pos + i]], device=device)
                hidden, scratch_cache = draft.layer(token, draft.feedback(hidden), position, scratch_cache)
        # 3. Verify [x[pos], d1..dk] at positions pos..pos+k; logits[i] follow verify token i.
        verify = torch.tensor([[sequence[pos]] + proposals], device=device)
        out = target(
            input_ids=verify, past_key_values=target_cache, use_cache=True, output_hidden_states=True
        )
        accepted, next_token = rule.verify(proposals, drafted, out.logits[0])
        accepts.append(accepted)
        crop_cache(target_cache, pos + accepted + 1)  # keep x[pos] and the accepted drafts
        new_aux = _aux_states(draft, out.hidden_states, slice(0, accepted + 1))
        new_tokens = proposals[:accepted] + [next_token]
        sequence += new_tokens
        pos += accepted + 1
        if eos.intersection(new_tokens):
            break
    return _finish(emitted(), max_new_tokens, eos), accepts


# ---------------------------------------------------------------------------------------------------
# Stage entry point


def read_questions(path: str, max_samples: int | None = None) -> list[dict]:
    """Question file lines {question_id, category, turns: [str, ...]}."""
    questions = []
    for record in iter_jsonl(path):
        q, turns = record.data, record.data.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise UserError(
                f"{record.where}: expected a question {{question_id, category, turns: [str, ...]}} "
                "with at least one turn"
            )
        line_no = int(record.where.rsplit(" ", 1)[-1])
        questions.append(
            {"id": q.get("question_id", line_no), "category": str(q.get("category", "all")), "turns": turns}
        )
        if max_samples is not None and len(questions) >= max_samples:
            break
    return questions


def read_eval_set(eval_set: dict, max_samples: int | None) -> list[dict]:
    """The questions of one `evaluate.sets` entry: the first `max_samples` of them, where the set's own
    max_samples overrides `max_samples` (evaluate.max_samples). A set without questions is an error:
    an acceptance length over no question measures nothing. `eval_set["index"]`, when given, is the entry's
    place in evaluate.sets, for the error's key."""
    own = eval_set.get("max_samples")
    limit = own if own is not None else max_samples
    questions = read_questions(eval_set["path"], None if limit is None else int(limit))
    if not questions:
        key = f"evaluate.sets[{eval_set['index']}]" if "index" in eval_set else "evaluate.sets"
        raise ConfigError(key, f"the set '{eval_set['name']}' ({eval_set['path']}) has no question; give a "
                               "JSONL file of {question_id, category, turns: [str, ...]} lines or remove the set")
    return questions


def _timed(device: torch.device, fn, *args):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def log(msg: str) -> None:
    """A line of the job's log (the progress bars are off when stderr is not a terminal)."""
    print(f"[evaluate] {msg}", file=sys.stderr, flush=True)


@contextmanager
def float32(*modules):
    """The modules' bf16/fp16 parameters and buffers in float32 inside the block, each back in its own dtype
    after it (bf16 -> fp32 -> bf16 is exact, so nothing is lost). Shared tensors are converted once."""
    saved = []
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.dtype in (torch.bfloat16, torch.float16):
                saved.append((tensor, tensor.dtype))
                tensor.data = tensor.data.float()
    try:
        yield
    finally:
        for tensor, dtype in saved:
            tensor.data = tensor.data.to(dtype)


def sequential_indices(count: int, n: int | None) -> list[int]:
    """Which of a set's `count` questions run at batch 1 (evaluate.sequential_samples = n): n of them spread
    evenly over the file, so that a set ordered by category (MT-Bench, Spec-Bench) gives each category its
    share of the timing, the lossless check and the sampled rows. None: every question."""
    if n is None or n >= count:
        return list(range(count))
    return [i * count // n for i in range(n)]


def _simulated_accepts(target, draft, prompt: list[int], extended: list[int], stop_len: int,
                       ks: list[int]) -> dict[int, list[int]]:
    """Every k's accepted-per-round from one target forward + one unrolled draft pass (acceptance.py)."""
    device = next(target.parameters()).device
    tokens = torch.tensor(prompt + extended, device=device)
    with torch.inference_mode():
        out = target(input_ids=tokens[None], output_hidden_states=True, use_cache=False)
    aux = _aux_states(draft, out.hidden_states, slice(None))[0]
    return acceptance_for_sequence(draft, tokens, aux, len(prompt), ks, stop_len)


def acceptance_probabilities(target, draft, tokens: list[int], k: int, temperature: float, top_p: float,
                             draft_sample_method: str) -> torch.Tensor:
    """acceptance.sampled_acceptance for a target sample `tokens` (prompt + answer): one target forward
    gives p of every emitted token and the aux states. [k, T] on the CPU."""
    device = next(target.parameters()).device
    ids = torch.tensor(tokens, device=device)
    with torch.inference_mode():
        out = target(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        p = probabilities(out.logits[0, :-1], temperature, top_p)  # [T-1, V]: the sampler's distribution
        p_emitted = torch.cat([p.gather(-1, ids[1:, None])[:, 0], p.new_zeros(1)])  # [T]: p(x[j+1]) at j
        del p
        aux = _aux_states(draft, out.hidden_states, slice(None))[0]
        return sampled_acceptance(draft, ids, aux, k, p_emitted, temperature, draft_sample_method).cpu()


def sampled_acceptance_set(target, draft, tokenizer, questions: list[dict], ks: list[int], max_new_tokens: int,
                           temperature: float, sampling: dict, batch_size: int) -> dict:
    """τ at temperature > 0 for every question and every k, without a decode per k: the target samples every
    turn in batches (reference.py), and each turn's rounds are drawn from the acceptance probabilities of
    one teacher-forced pass over its sample (acceptance.py). Seeded by evaluate.seed (per batch, and per
    question, turn and k for the rounds), so a report is reproducible on one device.
    `sampling`: evaluate.top_p, seed and draft_sample_method."""
    samples = batched_references(target, tokenizer, questions, ks, max_new_tokens, [], batch_size, sampling={
        "temperature": temperature, "top_p": sampling["top_p"],
        "seed": decode_seed(sampling["seed"], "samples", temperature)})
    conversations = Conversations(target, tokenizer, questions, ks, max_new_tokens, f"acceptance T={temperature}")
    tally = Tally(ks)
    for turn in conversations:
        extended = samples[(turn.question, turn.number)]
        turn.answer = _finish(extended, max_new_tokens, conversations.eos)
        r = acceptance_probabilities(target, draft, turn.prompt + extended, max(ks), temperature, sampling["top_p"],
                                     sampling["draft_sample_method"])
        start, stop = len(turn.prompt), len(turn.prompt) + len(turn.answer)
        for k in ks:
            generator = torch.Generator().manual_seed(
                decode_seed(sampling["seed"], turn.question, turn.number, k, "rounds"))
            tally.add(turn.category, k, sample_rounds(r, start, stop, k, generator))
    return {"temperature": temperature, **sampling, "questions": len(questions), "turns": conversations.done,
            "turns_skipped_too_long": conversations.skipped, "k": {str(k): tally.row(k) for k in ks}}


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation so far, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def ask(tokenizer, messages: list[dict], user_turn: str, room: int, max_positions: int) -> list[int] | None:
    """Append the user's turn to `messages`; the prompt it makes, or None when that leaves fewer than
    `room` of the target's `max_positions` (the answer and the drafts must fit after it)."""
    messages.append({"role": "user", "content": user_turn})
    prompt = chat_prompt(tokenizer, messages)
    return None if len(prompt) + room > max_positions else prompt


def turn_room(max_new_tokens: int, ks: list[int]) -> int:
    """Positions a turn needs after its prompt: the answer, a last round's drafts and the verifier's run on."""
    return max_new_tokens + 2 * max(ks) + 2


def max_positions(target) -> int:
    return getattr(target.config, "max_position_embeddings", None) or 1 << 62


@dataclass
class Turn:
    question: int  # index of the question in its set
    number: int  # the turn's number in the question
    category: str
    prompt: list[int]  # the conversation so far, ready for the assistant's answer
    answer: list[int] | None = None  # set by the evaluator: the next turn is asked after it


class Conversations:
    """An eval set's turns as the HF evaluators ask them: turn n after the answer the evaluator gave turn n-1
    (it sets `Turn.answer` before asking for the next). A turn whose prompt leaves less than turn_room of
    the target's positions ends its question, since later turns need its answer (counted in `skipped`)."""

    def __init__(self, target, tokenizer, questions: list[dict], ks: list[int], max_new_tokens: int, desc: str):
        self.tokenizer, self.questions, self.desc = tokenizer, questions, desc
        self.eos = set(eos_token_ids(target, tokenizer))
        self.room, self.max_positions = turn_room(max_new_tokens, ks), max_positions(target)
        self.done = self.skipped = 0

    def __iter__(self):
        for qi, question in enumerate(tqdm(self.questions, desc=self.desc, unit="question", disable=None)):
            messages: list[dict] = []
            for number, user_turn in enumerate(question["turns"]):
                prompt = ask(self.tokenizer, messages, user_turn, self.room, self.max_positions)
                if prompt is None:
                    self.skipped += len(question["turns"]) - number
                    break
                turn = Turn(qi, number, question["category"], prompt)
                yield turn
                if turn.answer is None:
                    raise RuntimeError("Conversations: set Turn.answer before asking for the next turn")
                messages.append({"role": "assistant", "content": answer_text(self.tokenizer, turn.answer, self.eos)})
                self.done += 1


def batched_references(target, tokenizer, questions: list[dict], ks: list[int], max_new_tokens: int,
                       sequential: list[int], batch_size: int,
                       sampling: dict | None = None) -> dict[tuple[int, int], list[int]]:
    """The greedy decodes of the questions whose indices are not in `sequential` (reference.py), or with
    `sampling` ({temperature, top_p, seed}) the target's samples of them, keyed by (index in `questions`,
    turn)."""
    skip = set(sequential)
    others = [qi for qi in range(len(questions)) if qi not in skip]
    eos = set(eos_token_ids(target, tokenizer))
    room, positions = turn_room(max_new_tokens, ks), max_positions(target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    decodes = reference_decodes(
        target, [questions[qi] for qi in others],
        chat_prompt=lambda messages: chat_prompt(tokenizer, messages),
        answer_text=lambda extended: answer_text(tokenizer, _finish(extended, max_new_tokens, eos), eos),
        fits=lambda prompt: len(prompt) + room <= positions,
        max_new_tokens=max_new_tokens + max(ks) + 1, eos=eos, pad_id=pad, batch_size=batch_size, sampling=sampling,
    )
    return {(others[qi], turn): decode for (qi, turn), decode in decodes.items()}


def answer_text(tokenizer, reference: list[int], eos: set[int]) -> str:
    """The answer a turn's decode gives the conversation (the next turn is asked after it)."""
    return tokenizer.decode([t for t in reference if t not in eos], skip_special_tokens=True)


def evaluate_set(target, draft, tokenizer, questions: list[dict], ks: list[int], max_new_tokens: int,
                 sequential_ks: list[int] | None = None, references: dict | None = None) -> dict:
    """Run every question's turns (turn n asked after the target's own answer to turn n-1).

    Acceptance for every k comes from one teacher-forced pass over the target's greedy decode
    (exact for greedy chain decoding, see acceptance.py); the sequential speculative loop runs for
    `sequential_ks` (default: all) to time it, to check it is lossless and that it accepts exactly
    what the pass predicted (`simulation_agrees`). `references`: {(question index, turn index): greedy
    decode} made beforehand in batches (reference.py); those turns are neither timed nor decoded sequentially.

    In bf16 or fp16 the loop's verify forward (k+1 tokens) and the reference's one-token steps round
    differently, and at a near-tie of the target's logits the two decodes part (on a 135M target most
    256-token turns have one). So every turn that mismatches is decoded again, reference and loop, with
    the weights in float32 (`float32_recheck`): a mismatch that remains there is the loop's, not rounding's.
    """
    device = next(target.parameters()).device
    sequential_ks = list(ks) if sequential_ks is None else [k for k in sequential_ks if k in ks]
    conversations = Conversations(target, tokenizer, questions, ks, max_new_tokens, "evaluate")
    eos, tally = conversations.eos, Tally(ks)
    spec_tokens = dict.fromkeys(sequential_ks, 0)
    spec_seconds = dict.fromkeys(sequential_ks, 0.0)
    mismatches = dict.fromkeys(sequential_ks, 0)
    agrees = dict.fromkeys(sequential_ks, 0)
    base_tokens, base_generated, base_seconds = 0, 0, 0.0
    mismatched: dict[int, list[list[int]]] = {k: [] for k in sequential_ks}  # k -> prompts of mismatching turns

    for turn in conversations:
        prompt = turn.prompt
        batched = references is not None and (turn.question, turn.number) in references
        if batched:
            extended = references[(turn.question, turn.number)]
            reference = _finish(extended, max_new_tokens, eos)
        else:  # the reference decode runs max(k) tokens further: a last round's verifier sees them too
            extended, seconds = _timed(device, greedy_generate, target, prompt, max_new_tokens + max(ks) + 1, eos)
            reference = _finish(extended, max_new_tokens, eos)
            base_tokens, base_generated = base_tokens + len(reference), base_generated + len(extended)
            base_seconds += seconds
        simulated = _simulated_accepts(target, draft, prompt, extended, len(prompt) + len(reference), ks)
        for k in ks:
            accepts = simulated[k]
            if k in sequential_ks and not batched:
                (tokens, accepts), seconds = _timed(
                    device, speculative_generate, target, draft, prompt, k, max_new_tokens, eos
                )
                spec_tokens[k] += len(tokens)
                spec_seconds[k] += seconds
                mismatches[k] += tokens != reference
                agrees[k] += accepts == simulated[k]
                if tokens != reference:
                    mismatched[k].append(prompt)
            tally.add(turn.category, k, accepts)
        turn.answer = reference

    recheck = recheck_in_float32(target, draft, mismatched, ks, max_new_tokens, eos)
    baseline_tps = base_generated / base_seconds if base_seconds else 0.0
    per_k = {}
    for k in ks:
        row = tally.row(k)
        if k in sequential_ks:
            tps = spec_tokens[k] / spec_seconds[k] if spec_seconds[k] else 0.0
            row.update(tokens=spec_tokens[k], seconds=spec_seconds[k], tokens_per_s=tps,
                       speedup=tps / baseline_tps if baseline_tps else 0.0, mismatches=mismatches[k],
                       simulation_agrees=agrees[k])
            if k in recheck:
                row["float32_recheck"] = recheck[k]
        per_k[str(k)] = row
    return {
        "questions": len(questions),
        "turns": conversations.done,
        "turns_skipped_too_long": conversations.skipped,
        "sequential_k": sequential_ks,
        "baseline": {"tokens": base_tokens, "seconds": base_seconds, "tokens_per_s": baseline_tps},
        "k": per_k,
    }


def recheck_in_float32(target, draft, mismatched: dict[int, list[list[int]]], ks: list[int], max_new_tokens: int,
                       eos: set[int]) -> dict[int, dict]:
    """Decode each mismatching turn again with target and draft in float32: the reference, the teacher-forced
    pass and the loop at that turn's k. {k: {turns, mismatches, simulation_agrees}} for every k that had a
    mismatch; {} when there was none or the weights are float32 already (then a mismatch is the loop's)."""
    if not any(mismatched.values()) or next(target.parameters()).dtype == torch.float32:
        return {}
    start = time.perf_counter()
    out = {k: {"turns": len(prompts), "mismatches": 0, "simulation_agrees": 0}
           for k, prompts in mismatched.items() if prompts}
    turns: dict[tuple[int, ...], list[int]] = {}  # prompt -> the k at which its turn parted
    for k, prompts in mismatched.items():
        for prompt in prompts:
            turns.setdefault(tuple(prompt), []).append(k)
    try:
        with float32(target, draft):
            for prompt, parted_at in turns.items():  # one reference and one pass per turn, whatever its k
                prompt = list(prompt)
                extended = greedy_generate(target, prompt, max_new_tokens + max(ks) + 1, eos)
                reference = _finish(extended, max_new_tokens, eos)
                simulated = _simulated_accepts(target, draft, prompt, extended, len(prompt) + len(reference),
                                               parted_at)
                for k in parted_at:
                    tokens, accepts = speculative_generate(target, draft, prompt, k, max_new_tokens, eos)
                    out[k]["mismatches"] += tokens != reference
                    out[k]["simulation_agrees"] += accepts == simulated[k]
    except torch.OutOfMemoryError:  # a float32 copy is twice the weights: the report says it was not done
        log("float32 recheck skipped: the target does not fit the device in float32")
        return {k: {"turns": row["turns"], "skipped": "out of memory in float32"} for k, row in out.items()}
    for k, row in out.items():
        log(f"k={k}: {row['turns']} turn(s) that parted from the reference, again in float32: "
            f"{row['mismatches']} mismatch(es)" + ("" if row["mismatches"] == 0 else
                                                   " -- the speculative loop is not lossless; please report it"))
    log(f"float32 recheck: {time.perf_counter() - start:.0f} s")
    return out


def evaluate_sampled_set(target, draft, tokenizer, questions: list[dict], ks: list[int], max_new_tokens: int,
                         temperature: float, sampling: dict) -> dict:
    """Acceptance at temperature > 0 on the sequential questions: every turn decoded step by step with
    speculative sampling for each k (sampling.Sampled): its timing against the target alone, and the loop's
    own τ beside the one `sampled_acceptance_set` reads off the target's samples of every question.

    The target alone samples each turn first (the baseline, and the answer the next turn is asked after,
    so every k sees the same prompts); each decode draws from a generator seeded by decode_seed(seed,
    question, turn, k), so the report is reproducible and one k's draws do not depend on the others.
    Outputs are sampled, so they are not compared (no `mismatches`): losslessness is the rule's, by test.
    `sampling`: evaluate.top_p, seed and draft_sample_method.
    """
    device = next(target.parameters()).device
    conversations = Conversations(target, tokenizer, questions, ks, max_new_tokens, f"evaluate T={temperature}")
    eos, tally = conversations.eos, Tally(ks)
    spec_tokens, spec_seconds = dict.fromkeys(ks, 0), dict.fromkeys(ks, 0.0)
    base_tokens, base_seconds = 0, 0.0

    def rule(*parts):
        seed = decode_seed(sampling["seed"], *parts)
        return rule_for(temperature, sampling["top_p"], seed, sampling["draft_sample_method"], device)

    for turn in conversations:
        n, number, prompt = turn.question, turn.number, turn.prompt
        answer, seconds = _timed(device, greedy_generate, target, prompt, max_new_tokens, eos, rule(n, number, "target"))
        base_tokens, base_seconds = base_tokens + len(answer), base_seconds + seconds
        for k in ks:
            (tokens, accepts), seconds = _timed(device, speculative_generate, target, draft, prompt, k,
                                                max_new_tokens, eos, rule(n, number, k))
            spec_tokens[k] += len(tokens)
            spec_seconds[k] += seconds
            tally.add(turn.category, k, accepts)
        turn.answer = answer

    baseline_tps = base_tokens / base_seconds if base_seconds else 0.0
    per_k = {}
    for k in ks:
        tps = spec_tokens[k] / spec_seconds[k] if spec_seconds[k] else 0.0
        per_k[str(k)] = {**tally.row(k), "tokens": spec_tokens[k], "seconds": spec_seconds[k],
                         "tokens_per_s": tps, "speedup": tps / baseline_tps if baseline_tps else 0.0}
    return {
        "temperature": temperature,
        **sampling,
        "questions": len(questions),
        "turns": conversations.done,
        "turns_skipped_too_long": conversations.skipped,
        "baseline": {"tokens": base_tokens, "seconds": base_seconds, "tokens_per_s": baseline_tps},
        "k": per_k,
    }


def plot(results: dict, out_png: str) -> None:
    """Per set: acceptance rate by draft position for every k, and tau by category for every k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = results["sets"]
    fig, axes = plt.subplots(len(sets), 2, figsize=(13, 4 * len(sets)), squeeze=False)
    for (by_position, by_category), (name, result) in zip(axes, sets.items(), strict=True):
        per_k = result["k"]
        for k, metrics in per_k.items():
            rates = metrics["acceptance_rate_per_position"]
            by_position.plot(range(1, len(rates) + 1), rates, marker="o", label=f"k={k}")
        by_position.set(
            title=f"{name}: acceptance rate by draft position", xlabel="draft position", ylabel="rate"
        )
        by_position.set(ylim=(0, 1), xticks=range(1, max(int(k) for k in per_k) + 1))
        by_position.legend(fontsize="small")

        categories = sorted({c for m in per_k.values() for c in m["per_category"]})
        width = 0.8 / len(per_k)
        for i, (k, metrics) in enumerate(per_k.items()):
            taus = [metrics["mean_acceptance_length"]]
            taus += [metrics["per_category"][c]["mean_acceptance_length"] for c in categories]
            by_category.bar([j + i * width for j in range(len(taus))], taus, width, label=f"k={k}")
        group_centers = [j + (len(per_k) - 1) * width / 2 for j in range(len(categories) + 1)]
        by_category.set_xticks(group_centers, ["all", *categories], rotation=30, ha="right")
        by_category.set(title=f"{name}: mean acceptance length (tau) by category", ylabel="tau")
        by_category.set_ylim(bottom=1)  # tau >= 1 always: the target's own token
        by_category.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def load_draft(draft_dir: str, target: dict, device: torch.device, dtype: torch.dtype):
    """The exported draft; a checkpoint without embed_tokens takes the target's (a local target dir)."""
    from eagle3build.draft.export import load_exported

    local_target = target_path(target) if Path(target_path(target)).is_dir() else None
    return load_exported(draft_dir, device=device, dtype=dtype, target_path=local_target)


def evaluate(
    draft_dir: str, target: dict, eval_sets: list[dict], out_json: str, out_png: str, params: dict
) -> dict:
    """Evaluate the exported draft in `draft_dir` on question files; write metrics JSON and a plot.

    `params`: keys of the `evaluate` config section (unset keys take the schema's defaults)."""
    params = resolve_section("evaluate", params)
    ks = sorted(set(params["k"]))
    temperatures = sampled_temperatures(params)
    sampled_ks = ks if params["sequential_k"] is None else [k for k in params["sequential_k"] if k in ks]
    sampling = {"top_p": float(params["top_p"]), "seed": int(params["seed"]),
                "draft_sample_method": params["draft_sample_method"]}
    device = resolve_device(params["device"])
    sets = {s["name"]: read_eval_set(s, params["max_samples"]) for s in eval_sets}  # before any model loads
    tokenizer = load_target_tokenizer(target)
    model = load_target_model(target, device)
    draft = load_draft(draft_dir, target, device, model.dtype)
    if draft.config.vocab_size != model.config.vocab_size:
        raise UserError(
            f"{draft_dir}: the draft was built for a vocabulary of {draft.config.vocab_size} tokens, the "
            f"target '{target_path(target)}' has {model.config.vocab_size}; evaluate it with its own target"
        )
    results = {
        "format_version": FORMAT_VERSIONS["evaluate"],
        "backend": "hf",
        "draft": str(draft_dir),
        "target": target_path(target),
        "device": str(device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "k": ks,
        "max_new_tokens": int(params["max_new_tokens"]),
        "sets": {},
    }
    # Warm-up (allocator, kernels), so the first timed decode is not charged for it.
    warm = tokenizer("warm up", add_special_tokens=False)["input_ids"] or [0]
    greedy_generate(model, warm, 4, set())
    speculative_generate(model, draft, warm, max(ks), 4, set())
    if temperatures:
        results.update(temperatures=[0.0, *temperatures], **sampling)
    for name, questions in sets.items():
        sequential = sequential_indices(len(questions), params["sequential_samples"])
        references, start = None, time.perf_counter()
        if len(sequential) < len(questions):  # the other questions' greedy decodes, in batches
            references = batched_references(model, tokenizer, questions, ks, int(params["max_new_tokens"]),
                                            sequential, params["reference_batch_size"])
            log(f"{name}: greedy decodes of {len(questions) - len(sequential)} question(s) in batches: "
                f"{time.perf_counter() - start:.0f} s")
        start = time.perf_counter()
        results["sets"][name] = evaluate_set(
            model, draft, tokenizer, questions, ks, int(params["max_new_tokens"]), params["sequential_k"],
            references,
        )
        log(f"{name}: acceptance of {results['sets'][name]['turns']} turn(s), {len(sequential)} question(s) "
            f"decoded step by step: {time.perf_counter() - start:.0f} s")
        if temperatures:  # every question from the target's batched samples; the sequential ones step by step
            sampled = [questions[qi] for qi in sequential]
            results["sets"][name]["at_temperature"] = {}
            for t in temperatures:
                start = time.perf_counter()
                row = sampled_acceptance_set(model, draft, tokenizer, questions, ks, int(params["max_new_tokens"]),
                                             t, sampling, params["reference_batch_size"])
                log(f"{name}: T={t}, acceptance of {row['turns']} turn(s) from batched samples: "
                    f"{time.perf_counter() - start:.0f} s")
                if sampled and sampled_ks:
                    start = time.perf_counter()
                    row["sequential"] = evaluate_sampled_set(
                        model, draft, tokenizer, sampled, sampled_ks, int(params["max_new_tokens"]), t, sampling)
                    log(f"{name}: T={t}, {len(sampled)} question(s) step by step: "
                        f"{time.perf_counter() - start:.0f} s")
                results["sets"][name]["at_temperature"][temperature_key(t)] = row
    write_json_atomic(out_json, results)
    plot(results, out_png)
    return results
