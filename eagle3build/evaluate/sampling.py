"""Token choice and verification rules of chain speculative decoding: greedy, and speculative sampling.

A rule decides three things in the decoding loop (`hf.speculative_generate`, `hf.greedy_generate`):
the target's own next token (`next_token`), the draft's proposal at each draft step (`propose`), and how
many of the k proposals the target accepts plus the token it emits after them (`verify`).

`Greedy`: argmax everywhere; a proposal is accepted while it equals the target's argmax.

`Sampled` (temperature T > 0, optional top-p): the exact speculative-sampling rule (Leviathan et al.
2023, Chen et al. 2023), which vLLM's rejection sampler also implements. The target's verify forward
gives p_i (softmax at T, restricted to the top-p nucleus) for every position at once. The draft proposes
x_i ~ q_i, its softmax at T over the draft vocabulary mapped to target ids (q is zero outside the draft
vocabulary; top-p is not applied to proposals, as in vLLM) — or, with draft_sample_method "greedy"
(vLLM's default), its argmax, verified as a point mass q_i = one-hot(x_i). Proposal i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the emitted token is drawn from
normalize(max(0, p_i − q_i)); when all k are accepted the target adds a bonus token drawn from p_k. Every
emitted token is then distributed exactly as the target's own sampling at (T, top-p), whatever the draft
and either proposal rule (tests/test_evaluate_sampling.py checks that statistically). All randomness
comes from one torch.Generator, so a run is reproducible from its seed on a given device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) over the last dim in fp32, restricted to the top-p nucleus (the smallest set of
    most likely tokens whose mass reaches top_p) and renormalised."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the most likely token always stays
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


class Greedy:
    """Greedy chain decoding: the output is the target's greedy decode."""

    def next_token(self, logits: torch.Tensor) -> int:
        """The target's token after a position whose logits are `logits` [V]."""
        return int(logits.argmax())

    def propose(self, draft, draft_logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        """(target id [1, 1] of the draft's proposal, what verify needs of it) from draft logits [1, 1, K]."""
        return draft.draft_to_target(draft_logits.argmax(-1)), None

    def verify(self, proposals: list[int], drafted: list, logits: torch.Tensor) -> tuple[int, int]:
        """(accepted, next token) for k proposals and the target's logits [k+1, V] after [x, d1..dk]."""
        greedy = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == greedy[accepted]:
            accepted += 1
        return accepted, greedy[accepted]


@dataclass
class Sampled:
    """Speculative sampling at `temperature` > 0 and `top_p`, drawing from `generator`; proposals drawn
    from the draft's distribution ("probabilistic") or its argmax ("greedy")."""

    temperature: float
    top_p: float
    generator: torch.Generator
    draft_sample_method: str  # evaluate.draft_sample_method

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.temperature, self.top_p)

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def next_token(self, logits: torch.Tensor) -> int:
        return self.draw(self.probs(logits))

    def propose(self, draft, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A proposal, and the q it was drawn from over the target vocabulary (zero outside the draft's)."""
        logits = draft_logits[0, -1]  # [K]
        q = torch.zeros(draft.config.vocab_size, device=logits.device)
        if self.draft_sample_method == "greedy":
            token = draft.draft_to_target(logits.argmax().reshape(1, 1))
            q[int(token)] = 1.0
            return token, q
        q_draft = probabilities(logits, self.temperature)  # [K]
        token = draft.draft_to_target(torch.tensor([[self.draw(q_draft)]], device=logits.device))
        q[draft.draft_ids()] = q_draft
        return token, q

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Where a rejected position draws its token: normalize(max(0, p − q))."""
        excess = (p - q).clamp_min(0.0)
        total = excess.sum()
        # p <= q everywhere means p == q, where nothing is ever rejected; only rounding gets here
        return excess / total if total > 0 else p

    def verify(self, proposals: list[int], drafted: list[torch.Tensor], logits: torch.Tensor) -> tuple[int, int]:
        p = self.probs(logits)  # [k+1, V]
        for i, (token, q) in enumerate(zip(proposals, drafted, strict=True)):
            u = float(torch.rand((), generator=self.generator, device=self.generator.device))
            if u * float(q[token]) < float(p[i, token]):  # accept with probability min(1, p/q)
                continue
            return i, self.draw(self.residual(p[i], q))
        return len(proposals), self.draw(p[-1])


def rule_for(temperature: float, top_p: float, seed: int, draft_sample_method: str,
             device: torch.device) -> Greedy | Sampled:
    """The rule of one decode: greedy at T = 0, else speculative sampling seeded with `seed`."""
    if temperature == 0:
        return Greedy()
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return Sampled(float(temperature), float(top_p), generator, draft_sample_method)
