"""Acceptance length of a chain draft under greedy verification, computed from one teacher-forced pass.

Greedy speculative decoding is lossless: the tokens it emits are the target's greedy decode, whatever
the draft and whatever k. So the acceptance of every round can be read off that decode:

1. the target's greedy continuation x of each prompt (batched `generate`), and its aux states at every
   position (one forward);
2. one unrolled draft pass over all positions at once — exactly the training-time-test forward: at
   position t, step s proposes x[t+2+s] from (x[t+1+s], own state), attending to step-0 keys <= t and
   to its own chain — which is the draft's inference computation, as long as its earlier proposals
   matched (and only then does the next step count);
3. A[t] = how many leading proposals of the chain started at t match x; a round that begins with the
   verified prefix x[:n] accepts min(A[n-2], k) tokens and the target adds one.

This gives tau for every k from a single pass instead of k_max sequential decoding loops, and equals the
sequential loop (`evaluate.speculative_generate`) up to floating-point ties
(tests/test_evaluate.py::test_one_teacher_forced_pass_predicts_every_round_of_the_loop).

Speculative sampling (T > 0) is lossless too: its emitted tokens are the target's own sample x. Given the
token v it emits where a proposal was drafted from q, the proposal was accepted with probability
min(p(v), q(v)) / p(v): drawn from q and kept with min(1, p/q) it emits v with probability min(p, q)(v),
and the residual emits v with p(v) − min(p, q)(v). So one target sample x per turn, the same unrolled draft
pass (its step s at t now gives q over the draft vocabulary) and the target's p of each emitted token
give every proposal's acceptance probability r[s, t] (`sampled_acceptance`); drawing each round's
acceptances from r (`sample_rounds`) gives rounds distributed exactly as the sequential loop's
(tests/test_evaluate_sampling.py checks it against the loop with a chi-square test).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from eagle3build.draft.model import Eagle3Draft, attention_scale
from eagle3build.evaluate.sampling import probabilities
from eagle3build.ttt.batch import shift


@torch.inference_mode()
def chain_logits(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, k: int) -> Iterator[torch.Tensor]:
    """For each step s < k, the draft's logits [T, K] (draft vocabulary) at column t for x[t+2+s], the
    chain from t having read x[t+1 .. t+1+s]."""
    device = aux.device
    T = tokens.numel()
    c = draft.config
    scale = attention_scale(c)
    positions = torch.arange(T, device=device)
    causal = positions[None, :] <= positions[:, None]  # [T, T]
    hidden = draft.project_aux(aux[None].to(next(draft.parameters()).dtype))
    groups = c.num_attention_heads // c.num_key_value_heads
    keys, values = [], []
    for s in range(k):
        ids = shift(tokens, 1 + s, 0)[None]
        q, key, value, residual = draft.qkv(ids, hidden, (positions + s)[None])
        keys.append(key.repeat_interleave(groups, dim=1))
        values.append(value.repeat_interleave(groups, dim=1))
        scores0 = (q @ keys[0].transpose(-1, -2)).float() * scale  # [1, nh, T, T]
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        diag = [(q * kj).sum(-1, keepdim=True).float() * scale for kj in keys[1:]]  # [1, nh, T, 1] each
        probs = torch.softmax(torch.cat([scores0, *diag], dim=-1), dim=-1)
        attn = probs[..., :T].to(q.dtype) @ values[0]
        for j, vj in enumerate(values[1:]):
            attn = attn + probs[..., T + j : T + j + 1].to(q.dtype) * vj
        output = draft.finish(attn, residual)
        yield draft.logits(output)[0]
        hidden = draft.feedback(output)  # what the next step reads (normed under norm_output)


def chain_proposals(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, k: int) -> torch.Tensor:
    """Target ids [k, T]: row s, column t = the draft's step-s proposal for x[t+2+s] (chain from t)."""
    return torch.stack([draft.draft_to_target(logits.argmax(-1)) for logits in chain_logits(draft, tokens, aux, k)])


def sampled_acceptance(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, k: int, p_emitted: torch.Tensor,
                       temperature: float, draft_sample_method: str) -> torch.Tensor:
    """r [k, T] (fp32): row s, column t = the probability that the step-s proposal of the chain from t was
    accepted, given that the target emitted x[t+2+s] there: min(p, q)(x) / p(x), 0 past the end.

    tokens: x [T], a sample of the target (at the temperature and top-p of p); p_emitted [T]: p(x[j+1]) at
    position j (the target's sampling distribution, sampling.probabilities, of the token that followed).
    q: the draft's softmax at `temperature` over its vocabulary, 0 for target ids outside it; with
    draft_sample_method "greedy" a point mass on its argmax (sampling.Sampled.propose)."""
    target_to_draft = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=tokens.device)
    target_to_draft[draft.draft_ids().to(tokens.device)] = torch.arange(draft.config.draft_vocab_size,
                                                                         device=tokens.device)
    rows = []
    for s, logits in enumerate(chain_logits(draft, tokens, aux, k)):
        emitted = shift(tokens, 2 + s, 0)  # x[t+2+s]
        p = shift(p_emitted.float(), 1 + s, 0.0)  # p(x[t+2+s]), from position t+1+s
        index = target_to_draft[emitted]  # [T], -1 where the draft cannot propose it
        if draft_sample_method == "greedy":
            q = (logits.argmax(-1) == index).float()
        else:
            q = probabilities(logits, temperature).gather(-1, index.clamp_min(0)[:, None])[:, 0]
            q = torch.where(index >= 0, q, 0.0)
        rows.append(torch.where(p > 0, torch.minimum(p, q) / p.clamp_min(1e-30), 0.0))
    return torch.stack(rows)


def run_lengths(proposals: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A[t]: leading proposals of the chain from t that equal x[t+2+s] (int64 [T])."""
    k, T = proposals.shape
    hits = torch.zeros(k, T, dtype=torch.bool, device=proposals.device)
    for s in range(k):
        hits[s] = proposals[s] == shift(tokens, 2 + s, -1)
    return torch.cumprod(hits.long(), dim=0).sum(0)


def simulate_rounds(lengths: torch.Tensor, prompt_len: int, stop_len: int, k: int) -> list[int]:
    """Accepted tokens per verification round while the emitted sequence is shorter than `stop_len`.

    As in the sequential loop, a round's verifier may accept tokens past `stop_len` (they are cut from
    the output but counted); `lengths` should come from a decode that runs k tokens past it.
    """
    accepts = []
    n = prompt_len + 1  # the prefill already emitted x[prompt_len]
    lengths = lengths.tolist()
    while n < stop_len:
        a = min(lengths[n - 2], k)
        accepts.append(a)
        n += a + 1
    return accepts


def sample_rounds(accept_probs: torch.Tensor, prompt_len: int, stop_len: int, k: int,
                  generator: torch.Generator) -> list[int]:
    """Accepted tokens per round along a target sample, each proposal accepted with its probability from
    `sampled_acceptance` ([>= k, T], on the CPU); the rounds as in `simulate_rounds`."""
    accepts = []
    n = prompt_len + 1
    while n < stop_len:
        accepted = 0
        while accepted < k and float(torch.rand((), generator=generator)) < float(accept_probs[accepted, n - 2]):
            accepted += 1
        accepts.append(accepted)
        n += accepted + 1
    return accepts


def acceptance_for_sequence(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, prompt_len: int,
                            ks: list[int], stop_len: int | None = None) -> dict[int, list[int]]:
    """{k: accepted per round} for one prompt + greedy response (tokens [T], aux [T, 3*Ht]).

    stop_len: where decoding stops (prompt + max_new_tokens, or just after an end token); defaults to
    the whole sequence.
    """
    proposals = chain_proposals(draft, tokens, aux, max(ks))
    lengths = run_lengths(proposals, tokens).cpu()
    return {k: simulate_rounds(lengths, prompt_len, stop_len or tokens.numel(), k) for k in ks}
