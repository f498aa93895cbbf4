"""The TTT attention implementations by name (`train.attention`), and the one factory that builds them.

Every implementation is a callable `attention(q, keys, values, doc, step, scale, rows=None)`: step s's
queries [1, nh, R, hd] over the step-0 keys/values [1, nkv, N, hd] and those of steps 1..s at the query
rows (`keys`, `values`: lists of s + 1 tensors; `rows`: the step rows, None for every row), packed
samples told apart by `doc` [N]. They share everything else and agree to fp32 rounding
(tests/test_model_ttt.py checks them against a loop-by-loop implementation):

- `flex`: block-sparse flex attention over the step-0 keys + an exact log-sum-exp merge of the diagonal
  keys, compiled on GPU (attention.flex, attention.merge);
- `flash`: the same merge on torch's varlen FlashAttention-2 kernel (attention.kernel);
- `sdpa`: dense boolean mask over the concatenated keys, torch's fused kernels (attention.dense);
- `reference`: dense mask, explicit softmax (attention.dense).
"""

from __future__ import annotations

from collections.abc import Callable

from eagle3build.attention.dense import reference_attention, sdpa_attention
from eagle3build.attention.flex import FlexAttention
from eagle3build.attention.kernel import KERNELS, KernelAttention

ATTENTION_IMPLS = ("flex", *KERNELS, "sdpa", "reference")


def make_attention(impl: str, compile: bool = False) -> Callable:
    """The attention implementation `impl` (one of ATTENTION_IMPLS); compile: its kernels torch.compile'd."""
    if impl == "flex":
        return FlexAttention(compile)
    if impl in KERNELS:
        return KernelAttention(impl, compile)
    if impl == "sdpa":
        return sdpa_attention
    if impl == "reference":
        return reference_attention
    raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
