"""The optimiser: AdamW over the draft's trainable weights, a warmup-then-cosine learning rate, and a
step that clips the gradients' global norm (inside the fused AdamW's own pass where it can)."""

from __future__ import annotations

import math

import torch
from torch import nn

from eagle3build.draft.model import Eagle3Draft


def make_optimizer(
    draft: Eagle3Draft, lr: float, weight_decay: float, fused: bool
) -> tuple[torch.optim.AdamW, list[nn.Parameter]]:
    """AdamW (weight decay on matrices only) and the trainable parameters it updates. Under FSDP2, call
    it after sharding: the parameters are then the DTensor shards."""
    trainable = [q for q in draft.parameters() if q.requires_grad]
    decay = [q for q in trainable if q.dim() >= 2]
    no_decay = [q for q in trainable if q.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=fused,
    )
    return optimizer, trainable


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """The learning rate's factor at each step: linear warmup over warmup_ratio of the steps, then a
    cosine decay to min_lr_ratio."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_scheduler(optimizer, total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, warmup_ratio, min_lr_ratio))


_GRAD_SCALE_READ: dict[str, bool] = {}


def fused_adamw_reads_grad_scale(device: torch.device) -> bool:
    """Whether a fused AdamW on `device` divides every gradient by `optimizer.grad_scale` before its
    update (the attribute GradScaler unscales through). Checked once per device type on a two-number
    problem: a torch that stopped reading it would clip nothing silently, so there the fold is off and
    clipping runs the usual way."""
    if device.type not in _GRAD_SCALE_READ:
        try:
            # eps = 1 keeps the first update g / (|g| + 1) sensitive to the gradient's scale
            scaled, reference = (torch.ones(2, device=device, requires_grad=True) for _ in range(2))
            for param, grad, scale in ((scaled, [4.0, -2.0], 4.0), (reference, [1.0, -0.5], None)):
                param.grad = torch.tensor(grad, device=device)
                optimizer = torch.optim.AdamW([param], lr=1.0, eps=1.0, weight_decay=0.0, fused=True)
                if scale is not None:
                    optimizer.grad_scale = torch.tensor(scale, device=device)
                optimizer.step()
            _GRAD_SCALE_READ[device.type] = bool(torch.allclose(scaled, reference, rtol=0, atol=1e-6))
        except (RuntimeError, TypeError, ValueError):  # no fused AdamW on this device
            _GRAD_SCALE_READ[device.type] = False
    return _GRAD_SCALE_READ[device.type]


def clipped_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float | None):
    """optimizer.step() with the gradients scaled to a global norm of at most max_norm (none if it is
    0 or None); returns the norm before clipping (None without clipping).

    With a fused AdamW and plain tensors the clip coefficient rides in the optimizer's own pass over the
    gradients (it divides them by `grad_scale` as it reads them), instead of clip_grad_norm_'s separate
    read and write of every gradient. FSDP2's sharded gradients (DTensors) and other optimizers clip the
    usual way.
    """
    if not max_norm:
        optimizer.step()
        return None
    grads = [q.grad for q in params if q.grad is not None]
    fold = (
        optimizer.defaults.get("fused")
        and grads
        and not any(hasattr(g, "full_tensor") for g in grads)
        and fused_adamw_reads_grad_scale(grads[0].device)
    )
    if not fold:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm
    norm = torch.nn.utils.get_total_norm(grads)
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)  # 1 / clip_grad_norm_'s coefficient
    optimizer.step()
    return norm


def optimizer_step(optimizer, scheduler, params: list[nn.Parameter], max_norm: float | None):
    """The clipped step, the schedule's next learning rate and cleared gradients; returns the gradients'
    norm before clipping (None without clipping)."""
    grad_norm = clipped_step(optimizer, params, max_norm)
    if grad_norm is not None and hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
