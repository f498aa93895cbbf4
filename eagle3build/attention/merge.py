"""The diagonal merge: fold the keys of TTT steps 1..s into a causal attention result, exactly.

At step s a query at row p sees the step-0 keys of its sample (causal) and one key of each later step,
the one at p itself (the "diagonal"). The softmax over [causal keys] ∪ [diagonals] is a convex
combination of the causal output (weight exp(lse_c)) and each diagonal value (weight exp(q·k_i * scale)),
normalised together. The diagonal scores are N dot products per head, so the merge costs O(N·s·hd)
instead of attention over (s+1)·N keys, and the causal part can run on any kernel that returns its
log-sum-exp (attention.flex, attention.kernel).

The diagonals come in as lists, one tensor per step, and the merge reads them one by one: no tensor holds
the keys (or values) of several steps. Its backward keeps the steps' own keys and values, which the later
steps' merges read too, and nothing else of size N·hd per step: step s's merge runs again in backward (it
is elementwise work, O(N·s·hd)). Stacking the diagonals cost k(k - 1)/2 copies of one step's keys and
values over the k steps when backward kept the stacks (4.6 GiB at T = 8192 for an MHA draft of Kimi's
width), and still the stacks of s steps, and as much again for their gradient, while step s's backward ran
(7.9 GiB for s = 6 at 49,152 tokens for that draft). The kernel path (attention.kernel) pairs
`merge_forward` with `merge_backward` in its own autograd function.

Compiled, the merge is specialised to each number of diagonals s: torch.compile guards on a list's length,
so each step has its own graph. A checkpointed step (ttt.recompute) runs the merge again in backward and
must meet the graph its forward ran; with s a dynamic dimension, a graph compiled for a later step also
served the earlier steps (at 65,536 Kimi-shaped tokens Inductor's 32-bit indexing guard fails from s = 5
on, and the graph then compiled matched s = 2..4 too), and torch.utils.checkpoint stopped the step with a
CheckpointError (BENCHMARKS.md §2, long sequences). The rows N may turn dynamic as batch lengths change:
every step of a batch has the same N, so no step's compilation can serve another's.

Shapes: q, outputs [1, nh, N, hd]; log-sum-exps [1, nh, N] (fp32, natural log, scale applied); each
diagonal key or value [1, nkv, N, hd]; query heads grouped by their kv head [1, nkv, g, N, ...] (g = nh / nkv),
or token-major [1, N, nkv, g, ...] in `merge_forward`. q, keys and values are token-major in memory (the draft's
projections write [1, N, heads, hd]), and so is the gradient the causal kernel gives q: the forward merge
computes token-major, so that the gradients autograd derives from it are laid out alike and add to the kernel's
without a strided pass (head-major, each step's dq addition read q's gradient across strides, at a third of the
memory's bandwidth; BENCHMARKS.md §2). Products of an fp32 weight and a bf16 tensor promote to fp32, and
autograd then keeps the bf16 tensor.
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
    without copies, and the one o_proj reads (attn_out.transpose(1, 2) is then a view). Its own inverse."""
    return t.transpose(1, 2)


def at_every_row(q: torch.Tensor, n: int, rows: torch.Tensor) -> torch.Tensor:
    """Queries q [1, nh, R, hd] at `rows` of n rows, 0 at the others: the full-length input a causal kernel
    runs at. Token-major, and copied as whole rows of heads × hd, so that where autograd differentiates the
    copy, q's gradient through it is token-major too (as the merge's, which it is added to)."""
    return token_major(q.new_zeros(q.shape[0], n, q.shape[1], q.shape[3]).index_copy(1, rows, token_major(q)))


def token_groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, heads, N, ...] -> [1, N, nkv, heads / nkv, ...]: token-major, heads grouped by their kv head (a view)."""
    return t.transpose(1, 2).unflatten(2, (kv_heads, -1))


def diagonal_score(qg, kg, scale):
    """Each query's score against one diagonal key: qg grouped queries, kg the key broadcast over the group
    (either grouping) -> fp32, less the head dim (the product in the inputs' dtype, summed in fp32)."""
    return (qg * kg).float().sum(-1) * scale


def merge_forward(q, causal_out, causal_lse, keys, values, scale):
    """The merged softmax's output (q's dtype, token-major) and log-sum-exp (fp32) over the causal keys
    (output and log-sum-exp of the causal attention) and the diagonals, s keys and values [1, nkv, N, hd].
    merge_diagonal differentiates it with autograd; attention.kernel pairs it with `merge_backward`.
    Computed token-major (the module doc)."""
    nkv = keys[0].shape[1]
    qg = token_groups(q, nkv)  # [1, N, nkv, g, hd]
    scores = torch.stack(
        [token_groups(causal_lse, nkv).float()]
        + [diagonal_score(qg, token_major(k).unsqueeze(3), scale) for k in keys],
        -1,
    )  # [1, N, nkv, g, 1 + s]
    lse = torch.logsumexp(scores, dim=-1)  # [1, N, nkv, g]
    weights = torch.exp(scores - lse.unsqueeze(-1))
    out = weights[..., 0, None] * token_groups(causal_out, nkv)  # fp32 [1, N, nkv, g, hd]
    for i, v in enumerate(values, 1):
        out = out + weights[..., i, None] * token_major(v).unsqueeze(3)
    return token_major(out.to(q.dtype).flatten(2, 3)), token_major(lse.flatten(2, 3)).contiguous()


def merge_backward(dout, q, out, lse, keys, values, scale):
    """The diagonal keys' share of the merged softmax's gradient, given the merged output `out` and
    log-sum-exp `lse`: dq (fp32) and the diagonals' dk, dv, lists of s tensors [1, nkv, N, hd]. (The causal
    keys' share is what a kernel's backward computes from the same `out` and `lse`: attention.kernel.)"""
    nkv = keys[0].shape[1]
    delta = grouped_heads((dout.float() * out.float()).sum(-1), nkv)  # [1, nkv, g, N]: the kernel's backward's too
    qg, dog, lse_g = grouped_heads(q, nkv), grouped_heads(dout, nkv), grouped_heads(lse, nkv)  # [1, nkv, g, N, ...]
    dq, dks, dvs = 0, [], []
    for k, v in zip(keys, values, strict=True):
        weight = torch.exp(diagonal_score(qg, k.unsqueeze(2), scale) - lse_g)  # [1, nkv, g, N]
        d_score = weight * ((dog * v.unsqueeze(2)).float().sum(-1) - delta) * scale
        dq = dq + d_score.unsqueeze(-1) * k.unsqueeze(2)
        dks.append((d_score.unsqueeze(-1) * qg).sum(2).to(k.dtype))  # [1, nkv, N, hd]
        dvs.append((weight.unsqueeze(-1) * dog).sum(2).to(v.dtype))
    return dq.flatten(1, 2), dks, dvs


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
