"""The TTT loss and its metrics: soft cross-entropy per step, the per-step loss weights, acceptance.

Per step s: -Σ p_target · log_softmax(draft logits) summed over the rows that carry a loss at s, divided
by the number of such rows in the whole optimiser step (all micro-batches, all ranks), times
step_weight ** s, summed over steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3build.draft.model import Eagle3Draft


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
