"""The TTT loss and its metrics: the per-row loss per step, the per-step loss weights, acceptance.

Per step s: the row loss summed over the rows that carry a loss at s, divided by the number of such rows
in the whole optimiser step (all micro-batches, all ranks), times step_weight ** s, summed over steps.

The row loss (`train.loss`), with p the target's distribution over the draft vocab (restricted and
renormalised, ttt.scorer) and q = softmax(draft logits):
- forward_kl: soft cross-entropy -Σ p·log q (forward KL up to the target's entropy, a constant).
- tv, nla, lk_hybrid: the acceptance-targeting losses of speculators' `--loss-fn` and SpecForge's
  `lk_loss_type` (Samarin et al., "LK Losses", arXiv 2602.23881). A drafted token is accepted by
  speculative sampling with probability α = Σ min(p, q) = 1 - TV(p, q). tv minimises 1 - α; nla
  minimises -log α (TV's gradient times 1/α, which trains from a cold start); lk_hybrid is
  λ·KL(p‖q) + (1 - λ)·(1 - α) with λ = exp(-lk_eta·α) per row, α not differentiated (KL while the
  overlap is small, TV once it is large). p is renormalised over the draft vocab: the q that maximises
  the overlap with the unrenormalised p is the same (the draft can propose draft tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3build.draft.model import Eagle3Draft
from eagle3build.errors import ConfigError


@dataclass
class TTTStats:
    """Per-step sums over a batch; normalise with counts summed over the whole optimiser step."""

    loss_sum: torch.Tensor  # fp32 [k], differentiable
    correct: torch.Tensor  # [k] draft argmax == target argmax
    count: torch.Tensor  # [k] weighted rows

    def detach(self) -> TTTStats:
        return TTTStats(self.loss_sum.detach(), self.correct, self.count)


def soft_cross_entropy(model: Eagle3Draft, fused, hidden, target_probs, weight):
    """Per step, weighted sums over rows of -Σ p·log_softmax(draft logits), draft argmax == target
    argmax, and weight.

    hidden [M, S, H] (pre-norm, every step's row at each loss row, in target order); target_probs fp32
    [M, K]; weight [M, S] in {0, 1}. Returns three [S] tensors. The rows were chosen on the host
    (with_loss_rows); a row without a loss at some step is zeroed there rather than gathered out, so the
    step never waits on the host.

    Rows are ordered (loss row, step) so that the k rows reading one target row run side by side and
    read it once from memory rather than k times; and -Σ p·log_softmax(z) is written as
    logsumexp(z)·Σp - Σ p·z, which one pass over the logits computes.
    """
    logits = model.logits(hidden, fused).float()
    p = target_probs.unsqueeze(1)  # [M, 1, K]: shared by the row's k steps
    # logsumexp spelled as softmax's max and sum of exp(z - max): the pattern Inductor computes in one
    # online pass over the logits on the GPU. torch.logsumexp's guard against an infinite max breaks the
    # pattern, and Inductor's reduction then passes over the logits for the max and again for the sum
    # (the logits are the step's largest tensor). The max is a constant shift: it needs no gradient.
    zmax = logits.detach().amax(-1, keepdim=True)
    lse = (zmax + (logits - zmax).exp().sum(-1, keepdim=True).log()).squeeze(-1)
    loss = lse * p.sum(-1) - (p * logits).sum(-1)  # [M, S]
    target_argmax = target_probs.argmax(-1, keepdim=True)  # compiled: in p.sum's pass over the target rows
    correct = (weight * (logits.argmax(-1) == target_argmax)).sum(0)
    return (weight * loss).sum(0), correct, weight.sum(0)


LOSSES = ("forward_kl", "tv", "nla", "lk_hybrid")
NLA_MIN_ACCEPTANCE = 1e-5  # -log α's floor: a row whose overlap underflows adds a bounded loss, not inf


@dataclass(frozen=True)
class Objective:
    """The row loss (`train.loss`) and lk_hybrid's λ scale (`train.lk_eta`)."""

    loss: str
    lk_eta: float

    @classmethod
    def from_params(cls, p: dict) -> Objective | None:
        """From the `train` section; None for forward_kl, which ttt_forward computes by default."""
        if p["loss"] not in LOSSES:
            raise ConfigError("train.loss", f"must be one of {list(LOSSES)}, got {p['loss']!r}")
        return None if p["loss"] == "forward_kl" else cls(p["loss"], float(p["lk_eta"]))


def acceptance_loss(model: Eagle3Draft, fused, hidden, target_probs, weight, loss: str, lk_eta: float):
    """soft_cross_entropy's three [S] sums with an acceptance-targeting row loss (tv, nla or lk_hybrid;
    see the module docstring) in place of the cross-entropy. Same inputs; everything past the logits
    in fp32 (the logits may be bf16), q never below exp(-inf) = 0, the log of a sum of minima floored."""
    logits = model.logits(hidden, fused).float()
    p = target_probs.unsqueeze(1)  # [M, 1, K]
    zmax = logits.detach().amax(-1, keepdim=True)
    lse = zmax + (logits - zmax).exp().sum(-1, keepdim=True).log()  # [M, S, 1]
    acceptance = torch.minimum(p, (logits - lse).exp()).sum(-1)  # α = Σ min(p, q), [M, S]
    if loss == "tv":
        row = 1.0 - acceptance
    elif loss == "nla":
        row = -acceptance.clamp(min=NLA_MIN_ACCEPTANCE).log()
    elif loss == "lk_hybrid":
        # KL(p‖q) = Σ p·log p - Σ p·log q; the first term is a constant of the target row, [M, 1]
        neg_entropy = torch.special.xlogy(target_probs, target_probs).sum(-1, keepdim=True)
        kl = lse.squeeze(-1) * p.sum(-1) - (p * logits).sum(-1) + neg_entropy
        mix = torch.exp(-lk_eta * acceptance.detach())
        row = mix * kl + (1.0 - mix) * (1.0 - acceptance)
    else:
        raise ValueError(f"unknown loss {loss!r}; one of {LOSSES}")
    target_argmax = target_probs.argmax(-1, keepdim=True)
    correct = (weight * (logits.argmax(-1) == target_argmax)).sum(0)
    return (weight * row).sum(0), correct, weight.sum(0)


def step_loss_weights(steps: int, step_weight: float, device=None) -> torch.Tensor:
    """fp32 [steps]: the loss weight of each TTT step, step_weight ** s (`train.step_weight`)."""
    return step_weight ** torch.arange(steps, dtype=torch.float32, device=device)


def weighted_loss(stats: TTTStats, total_count: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_s w_s * loss_sum_s / N_s, where N_s counts step s's rows over the whole optimiser step."""
    return (weights * stats.loss_sum / total_count.clamp(min=1)).sum()


def acceptance_length(accuracy: torch.Tensor) -> float:
    """Simulated chain acceptance length 1 + sum_s prod_{j<=s} acc_j (includes the bonus token)."""
    return 1.0 + float(torch.cumprod(accuracy.double(), 0).sum())


def summarize(
    loss_sum: torch.Tensor, correct: torch.Tensor, count: torch.Tensor, weights: torch.Tensor
) -> dict:
    """Metrics from per-step sums: loss (weighted, as optimised), per-step loss/accuracy, acceptance."""
    count = count.clamp(min=1)
    step_loss, accuracy = loss_sum / count, correct / count
    return {
        "loss": float((weights.to(step_loss.device) * step_loss).sum()),
        "step_loss": [round(float(x), 6) for x in step_loss],
        "step_acc": [round(float(x), 6) for x in accuracy],
        "acceptance_length": acceptance_length(accuracy),
    }
