"""Aliases of the fused weights, one per TTT step, whose gradients are added in one compiled pass.

A tensor that k steps read gets its gradient by k - 1 in-place adds as the steps' backward passes
arrive, each reading two weight-sized gradients and writing one. Gradients of distinct outputs of one
autograd node are instead kept apart until all have arrived; `WeightAliases`' backward then adds them
in one compiled kernel, in fp32, rounded once. The price: the aliases' gradients of all steps are held
until step 0's backward (k - 1 more weight-sized gradients).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from eagle3build.compilation import cached_compiled
from eagle3build.draft.model import FusedWeights

ALIASED_WEIGHTS = ("qkv_hidden", "gate_up", "o", "down")  # the fused weights every TTT step's layer reads
# (lm_head and qkv_embed are read once per batch: by the loss over all steps, by the embedding half's projection)


class WeightAliases(torch.autograd.Function):
    """`steps` aliases of each weight, one per TTT step, whose backward adds the steps' gradients in one pass."""

    @staticmethod
    def forward(ctx, steps: int, *weights):
        ctx.set_materialize_grads(False)  # a step whose alias got no gradient adds nothing
        ctx.n = len(weights)
        return tuple(w.view_as(w) for _ in range(steps) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        sums = []
        for i in range(ctx.n):
            parts = [g for g in grads[i :: ctx.n] if g is not None]  # weight i's gradient from each step
            if len(parts) > 1:
                parts = [cached_compiled(sum_in_fp32, True)(*parts)]
            sums.append(parts[0] if parts else None)
        return (None, *sums)


def sum_in_fp32(*grads):
    """The gradients' sum, accumulated in fp32 and rounded once to their dtype."""
    total = grads[0].float()
    for g in grads[1:]:
        total = total + g.float()
    return total.to(grads[0].dtype)


def weight_aliases_per_step(fused: FusedWeights, steps: int, compile: bool) -> list[FusedWeights]:
    """The fused weights of each TTT step: WeightAliases' aliases where the step is compiled (eagerly,
    its sum would be k - 1 adds again, and in fp32)."""
    if steps == 1 or not compile or not torch.is_grad_enabled():
        return [fused] * steps
    aliases = WeightAliases.apply(steps, *(getattr(fused, n) for n in ALIASED_WEIGHTS))
    n = len(ALIASED_WEIGHTS)
    return [
        replace(fused, **dict(zip(ALIASED_WEIGHTS, aliases[s * n : (s + 1) * n], strict=True))) for s in range(steps)
    ]
