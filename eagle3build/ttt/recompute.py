"""Memory for compute in a training step: what makes long sequences fit (docs/TRAINING.md, "Memory").

Two switches of the `train` section, both off by default (the step then runs exactly as without them):
- `activation_checkpointing`: each TTT step's layer (q/k/v, attention, MLP) keeps only its inputs and
  outputs for backward and runs again when backward reaches it (torch.utils.checkpoint, non-reentrant:
  the compiled layer halves and flex attention run inside it as they are). The layer's saved activations,
  about 14 tensors per token per step, most of them H- or intermediate-wide, give way to its output and
  keys/values; backward does one more forward of the layer. `true` checkpoints every step; a number N
  the first N steps only, for a length that needs part of the saving at part of the cost.
- `loss_chunk_tokens`: the loss over chunks of that many loss rows, each chunk's logits computed again
  in backward, so one chunk's [rows, k, K] logits and their gradient are live instead of the batch's.
  Backward does one more lm_head forward per chunk.

Neither changes the math: with checkpointing the gradients are the same bits (the recomputation repeats
the forward's operations); a chunked loss adds the chunks' sums in another order (fp32 rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from eagle3build.errors import ConfigError


@dataclass(frozen=True)
class Recompute:
    """Which parts of a training step recompute in backward instead of keeping their activations."""

    steps: int  # train.activation_checkpointing: the TTT steps 0 .. steps - 1 recompute their layer
    loss_chunk: int  # train.loss_chunk_tokens: loss rows per chunk of the loss (0: the whole batch at once)

    @classmethod
    def from_params(cls, p: dict) -> Recompute | None:
        """From the `train` section; None when both are off (the step as it runs without them)."""
        recompute = cls(checkpointed_steps(p["activation_checkpointing"], int(p["ttt_steps"])),
                        int(p["loss_chunk_tokens"] or 0))
        return recompute if recompute.steps or recompute.loss_chunk else None


def checkpointed_steps(value: bool | int, ttt_steps: int) -> int:
    """How many TTT steps (the first ones) a `train.activation_checkpointing` value recomputes: true every
    step, false none, a number that many."""
    if isinstance(value, bool):
        return ttt_steps if value else 0
    if not 0 <= value <= ttt_steps:
        raise ConfigError("train.activation_checkpointing",
                          f"{value} steps of train.ttt_steps {ttt_steps}: give 0..{ttt_steps}, or true for every step")
    return int(value)


def recomputed(fn: Callable, *args):
    """fn(*args), its activations recomputed in backward (non-reentrant; no random numbers to replay).
    Without gradients (validation) nothing is kept anyway: fn runs as is."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def chunked_loss(loss_fn: Callable, chunk: int, model, fused, hidden, target_probs, weight, *extra,
                 compile: bool = False):
    """loss_fn's three [S] sums (ttt.loss.soft_cross_entropy or acceptance_loss) over chunks of `chunk`
    loss rows, each recomputed in backward: the [chunk, S, K] logits of one chunk live at a time.
    compile: the chunks' row counts are dynamic (the last chunk is shorter): one compilation for all."""
    sums = None
    for h, p, w in zip(hidden.split(chunk), target_probs.split(chunk), weight.split(chunk), strict=True):
        if compile:
            for t in (h, p, w):
                torch._dynamo.mark_dynamic(t, 0)
        part = recomputed(loss_fn, model, fused, h, p, w, *extra)
        sums = part if sums is None else tuple(a + b for a, b in zip(sums, part, strict=True))
    return sums
