"""TTT attention with a dense mask over the concatenated keys: explicit math (`reference`) and SDPA (`sdpa`).

Keys at step s: the N step-0 keys, then the R keys of each of steps 1..s (R = N, or the step rows). A
query at row p sees the step-0 keys at positions <= p of its own sample (causal, never across packed
samples) and, of each later step, the key at p itself (the "diagonal"), all in one softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def step_mask(doc: torch.Tensor, step: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Dense bool mask [R, N + step*R]: causal within a sample over the N step-0 keys + the diagonals,
    for queries at `rows` (R of them; None: every row, R = N)."""
    n = len(doc)
    idx = torch.arange(n, device=doc.device)
    at = idx if rows is None else rows
    causal = (idx[None, :] <= at[:, None]) & (doc[None, :] == doc[at][:, None])
    eye = torch.eye(len(at), dtype=torch.bool, device=doc.device)
    return torch.cat([causal] + [eye] * step, dim=1)


def dense_scores(q, k, v, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scores q k^T * scale [1, nh, R, keys], -inf where `mask` [R, keys] is False, and v with its kv
    heads repeated for the query heads (GQA), ready for softmax(scores) @ v."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    return scores.masked_fill(~mask, float("-inf")), v


def reference_attention(q, keys, values, doc, step, scale, rows=None):
    """Explicit math: softmax(q k^T * scale + mask) v, kv heads repeated for GQA."""
    scores, v = dense_scores(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), step_mask(doc, step, rows), scale)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def sdpa_attention(q, keys, values, doc, step, scale, rows=None):
    """The same mask on torch's scaled_dot_product_attention (its fused kernels, GQA-native)."""
    mask = step_mask(doc, step, rows)
    return F.scaled_dot_product_attention(
        q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask, scale=scale, enable_gqa=True
    )
