"""The diagonal merge: fold the keys of TTT steps 1..s into a causal attention result, exactly.

At step s a query at row p sees the step-0 keys of its sample (causal) and one key of each later step,
the one at p itself (the "diagonal"). The softmax over [causal keys] ∪ [diagonals] is a convex
combination of the causal output (weight exp(lse_c)) and each diagonal value (weight exp(q·k_i * scale)),
normalised together. The diagonal scores are N dot products per head, so the merge costs O(N·s·hd)
instead of attention over (s+1)·N keys, and the causal part can run on any kernel that returns its
log-sum-exp (attention.flex, attention.kernel).

The diagonals come in as lists, one tensor per step, and are stacked inside the merge; its backward keeps
the steps' own keys and values, which the later steps' merges read too, and no stacked copy: step s's
merge runs again in backward (it is elementwise work, O(N·s·hd)), so a stack per step, k(k - 1)/2 copies
of one step's keys and values over the k steps (4.6 GiB at T = 8192 for an MHA draft of Kimi's width),
lives only while its step's backward runs. The kernel path (attention.kernel) does the same in its own
autograd function.

Compiled, the merge is specialised to each number of diagonals s: torch.compile guards on a list's length,
so each step has its own graph. A checkpointed step (ttt.recompute) runs the merge again in backward and
must meet the graph its forward ran; with s a dynamic dimension, a graph compiled for a later step also
served the earlier steps (at 65,536 Kimi-shaped tokens Inductor's 32-bit indexing guard fails from s = 5
on, and the graph then compiled matched s = 2..4 too), and torch.utils.checkpoint stopped the step with a
CheckpointError (BENCHMARKS.md §2, long sequences). The rows N may turn dynamic as batch lengths change:
every step of a batch has the same N, so no step's compilation can serve another's.

Shapes: q, outputs [1, nh, N, hd]; log-sum-exps [1, nh, N] (fp32, natural log, scale applied); stacked
diagonals [1, nkv, N, s, hd]; query heads grouped by their kv head [1, nkv, g, N, ...] (g = nh / nkv).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from eagle3build.compilation import cached_compiled


def grouped_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, nh, N, ...] -> [b, nkv, g, N, ...]: query heads grouped by their kv head."""
    b, h, *rest = t.shape
    return t.view(b, kv_heads, h // kv_heads, *rest)


def token_major(t: torch.Tensor) -> torch.Tensor:
    """[1, N, heads, d] memory seen as [1, heads, N, d]: the layout the varlen kernels read and write
    without copies, and the one o_proj reads (attn_out.transpose(1, 2) is then a view)."""
    return t.transpose(1, 2)


def stacked(tensors) -> torch.Tensor:
    """The diagonal keys (or values) of steps 1..s, s tensors [1, nkv, N, hd], as one [1, nkv, N, s, hd]."""
    return torch.stack(tensors, dim=-2)


def merge_forward(q, causal_out, causal_lse, keys, values, scale):
    """The merged softmax's output (q's dtype, token-major) and log-sum-exp (fp32) over the causal keys
    (output and log-sum-exp of the causal attention) and the diagonals, s keys and values [1, nkv, N, hd].
    merge_diagonal differentiates it with autograd; attention.kernel pairs it with `merge_backward`."""
    diag_k, diag_v = stacked(keys), stacked(values)  # [1, nkv, N, s, hd]
    nkv = diag_k.shape[1]
    diag_scores = (grouped_heads(q, nkv).unsqueeze(-2) * diag_k.unsqueeze(2)).float().sum(-1) * scale  # [1, nkv, g, N, s]
    scores = torch.cat((grouped_heads(causal_lse, nkv).unsqueeze(-1).float(), diag_scores), dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [1, nkv, g, N]
    weights = torch.exp(scores - lse.unsqueeze(-1))
    out = weights[..., :1] * grouped_heads(causal_out, nkv).float() + (
        weights[..., 1:].unsqueeze(-1) * diag_v.unsqueeze(2).float()
    ).sum(-2)
    return token_major(out.to(q.dtype).flatten(1, 2).transpose(1, 2).contiguous()), lse.flatten(1, 2)


def merge_backward(dout, q, out, lse, keys, values, scale):
    """The diagonal keys' share of the merged softmax's gradient, given the merged output `out` and
    log-sum-exp `lse`: dq (fp32) and the diagonals' dk, dv, stacked [1, nkv, N, s, hd]. (The causal keys'
    share is what a kernel's backward computes from the same `out` and `lse`: attention.kernel.)"""
    diag_k, diag_v = stacked(keys), stacked(values)
    nkv = diag_k.shape[1]
    delta = (dout.float() * out.float()).sum(-1)  # [1, nh, N]: what the kernel's backward computes too
    qg, dog = grouped_heads(q, nkv).unsqueeze(-2), grouped_heads(dout, nkv).unsqueeze(-2)  # [1, nkv, g, N, 1, hd]
    diag_scores = (qg * diag_k.unsqueeze(2)).float().sum(-1) * scale  # [1, nkv, g, N, s]
    weights = torch.exp(diag_scores - grouped_heads(lse, nkv).unsqueeze(-1))
    d_scores = weights * ((dog * diag_v.unsqueeze(2)).float().sum(-1) - grouped_heads(delta, nkv).unsqueeze(-1)) * scale
    dq = (d_scores.unsqueeze(-1) * diag_k.unsqueeze(2).float()).sum(-2).flatten(1, 2)  # [1, nh, N, hd]
    dk = (d_scores.unsqueeze(-1) * qg.float()).sum(2)  # [1, nkv, N, s, hd]
    dv = (weights.unsqueeze(-1) * dog.float()).sum(2)
    return dq, dk.to(diag_k.dtype), dv.to(diag_v.dtype)


def merge_diagonal(q, causal_out, causal_lse, keys, values, scale, compile: bool = False):
    """Fold the diagonal keys of steps 1..s into a causal attention result, exactly (the module doc).
    Gradients reach q and the causal keys through `causal_lse`.

    q, causal_out [1, nh, N, hd]; causal_lse [1, nh, N] (natural log, scale applied);
    keys/values: s tensors [1, nkv, N, hd]. compile: one fused kernel per s (the module doc).
    """
    if not keys:
        return causal_out
    return cached_compiled(_merge, compile, dynamic=None)(q, causal_out, causal_lse, list(keys), list(values), scale)


def _merge(q, causal_out, causal_lse, keys, values, scale):
    """The merged output, differentiable in all inputs; run again in backward (the module doc), so that
    backward keeps the inputs only. Compiled, the checkpoint is the compiler's: it saves the inputs and
    recomputes the rest (torch.utils.checkpoint under torch.compile)."""
    if not torch.is_grad_enabled():
        return _merged_output(q, causal_out, causal_lse, keys, values, scale)
    return checkpoint(_merged_output, q, causal_out, causal_lse, keys, values, scale,
                      use_reentrant=False, preserve_rng_state=False)


def _merged_output(q, causal_out, causal_lse, keys, values, scale):
    return merge_forward(q, causal_out, causal_lse, keys, values, scale)[0]
