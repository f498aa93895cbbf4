"""The target's distribution over the draft vocab, from its stored final hidden stream.

The TTT loss's target at row j: final norm, then the lm_head rows of the draft vocab only (restricted and
renormalised); and whether the target's greedy token over the full vocab is in the draft vocab. Never
[N, V] logits at once.
"""

from __future__ import annotations

import torch

from eagle3build.compilation import cached_compiled
from eagle3build.draft.target import TargetHead, rms_norm


class TargetScorer:
    """The target's distribution from its stored final stream: final norm + lm_head (never [N, V] at once)."""

    def __init__(
        self,
        target: TargetHead,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        chunk_tokens: int = 1024,
        compile: bool = False,
    ):
        draft_ids = torch.arange(len(d2t)) + d2t
        self.norm = target.norm.to(device, dtype)
        self.eps = target.rms_norm_eps
        self.lm_head = target.lm_head.to(device, dtype)  # [V, H], only for the greedy token
        self.lm_head_draft = self.lm_head[draft_ids.to(device)]  # [K, H]
        self.t2d = t2d.to(device)
        self.chunk_tokens = chunk_tokens
        self.compile = compile  # draft_probs: one compilation for every row count

    @torch.no_grad()
    def greedy_in_draft(self, final: torch.Tensor) -> torch.Tensor:
        """bool [N]: the target's greedy token over the full vocab is in the draft vocab."""
        out = []
        for rows in final.split(self.chunk_tokens):
            logits = rms_norm(rows.to(self.norm.dtype), self.norm, self.eps) @ self.lm_head.T
            out.append(self.t2d[logits.argmax(-1)])
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool, device=final.device)

    @torch.no_grad()
    def draft_probs(self, final: torch.Tensor) -> torch.Tensor:
        """fp32 [N, K]: the target distribution restricted to the draft vocab and renormalised."""
        if self.compile:
            torch._dynamo.mark_dynamic(final, 0)
        return cached_compiled(_draft_probs, self.compile, dynamic=None)(final, self.norm, self.eps, self.lm_head_draft)


def _draft_probs(final, norm, eps, lm_head_draft):
    # compiled, the fp32 cast and the softmax are one kernel over the bf16 logits (eagerly: an fp32 copy, then a softmax)
    logits = rms_norm(final.to(norm.dtype), norm, eps) @ lm_head_draft.T
    return torch.softmax(logits.float(), dim=-1)
