"""TTT attention on a fused attention kernel built into torch: varlen FlashAttention-2 (`train.attention: flash`).

The causal part (every query over the step-0 keys of its own sample) runs as one varlen attention: the
packed samples are separate sequences, so no block across samples is computed. The diagonal keys of
steps 1..s are folded in exactly, by the merge flex uses too (`attention.merge.merge_forward`).

Why a custom backward: the merge differentiates the causal part's log-sum-exp, and the kernel's
backward takes no log-sum-exp gradient. It needs none: given the *merged* output O and log-sum-exp L,
a kernel's backward computes exactly the causal keys' share of the merged softmax's gradient,
dS_ij = exp(s_ij - L_i) (dO_i·v_j - dO_i·O_i), the identity ring attention relies on. So the forward
keeps O and L of the whole softmax, the backward hands them to the kernel's backward, and the diagonal
keys' share is a few elementwise ops (`attention.merge.merge_backward`).

The kernel is torch's own op, aten::_flash_attention_forward/_backward: torch's public
`torch.nn.attention.varlen` calls it, but it is private and may change with torch. `check_kernel`
compares the kernel with explicit math on a tiny problem; training (and `make doctor`) runs it before
the first step, so a torch whose ops changed fails there with a message, not with wrong gradients. On
CPU, `flash` runs torch's CPU flash kernel (dense, with the sample mask): the same algorithm, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3build.attention.dense import reference_attention
from eagle3build.attention.merge import at_every_row, merge_backward, merge_forward
from eagle3build.compilation import cached_compiled

KERNELS = ("flash",)


@dataclass(frozen=True)
class Segments:
    """A packed batch's samples as varlen sequences: the kernels' view of `doc`."""

    n: int  # tokens
    cu: torch.Tensor  # int32 [D + 1]: where each sample starts, then N
    max_len: int
    bias: torch.Tensor | None = None  # CPU kernel: additive mask [N, N], 0 where a query sees a key


def segments(doc: torch.Tensor, dense_bias_dtype: torch.dtype | None = None) -> Segments:
    """The sample boundaries of `doc` (samples are contiguous runs). Reads two numbers back from the
    device: once per batch, since the caller caches the result for all steps."""
    counts = torch.unique_consecutive(doc, return_counts=True)[1]
    cu = F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
    bias = None
    if dense_bias_dtype is not None:
        idx = torch.arange(len(doc), device=doc.device)
        visible = (idx[None, :] <= idx[:, None]) & (doc[None, :] == doc[:, None])
        bias = torch.zeros(visible.shape, dtype=dense_bias_dtype, device=doc.device).masked_fill(~visible, float("-inf"))
    return Segments(len(doc), cu, int(counts.max()) if len(counts) else 0, bias)


def _varlen(t: torch.Tensor) -> torch.Tensor:
    """[1, heads, N, d] -> [N, heads, d], a view (the varlen kernels' layout)."""
    return t[0].transpose(0, 1)


def _batched(t: torch.Tensor) -> torch.Tensor:
    """[N, heads, d] -> [1, heads, N, d], a view."""
    return t.transpose(0, 1).unsqueeze(0)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads repeated for their query heads (GQA), dim 1; token-major, as the queries."""
    return t if t.shape[1] == heads else _batched(_varlen(t).repeat_interleave(heads // t.shape[1], dim=1))


def _reduce_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of _expand_kv: summed over each kv head's query heads, dim 1."""
    if grad.shape[1] == kv_heads:
        return grad
    b, h, *rest = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, *rest).sum(2)


class FlashKernel:
    """torch's FlashAttention-2, varlen and GQA-native (CUDA); torch's CPU flash kernel on CPU."""

    name = "flash"

    def __init__(self, varlen: bool | None = None):
        self.varlen = varlen  # None: the varlen kernel on CUDA, the CPU kernel on CPU
        self.rng_state = None  # the forward's (no dropout: handed back unused)

    def forward(self, q, k, v, seg: Segments, scale: float):
        """-> output [1, nh, N, hd] and log-sum-exp [1, nh, N] (fp32, natural log, scale applied)."""
        if not (q.is_cuda if self.varlen is None else self.varlen):
            heads = q.shape[1]
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, _expand_kv(k, heads), _expand_kv(v, heads), 0.0, False, attn_mask=seg.bias, scale=scale
            )
        out, lse, *self.rng_state = torch.ops.aten._flash_attention_forward(
            _varlen(q), _varlen(k), _varlen(v), seg.cu, seg.cu, seg.max_len, seg.max_len, 0.0, True, False, scale=scale
        )[:4]
        return _batched(out), lse.unsqueeze(0)  # lse [nh, N] for varlen

    def backward(self, dout, q, k, v, out, lse, seg: Segments, scale: float):
        if not (q.is_cuda if self.varlen is None else self.varlen):
            heads, kv_heads = q.shape[1], k.shape[1]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.contiguous(), q, _expand_kv(k, heads), _expand_kv(v, heads), out.contiguous(), lse.contiguous(),
                0.0, False, attn_mask=seg.bias, scale=scale,
            )  # fmt: skip
            return dq, _reduce_kv(dk, kv_heads), _reduce_kv(dv, kv_heads)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            _varlen(dout), _varlen(q), _varlen(k), _varlen(v), _varlen(out), lse[0].contiguous(), seg.cu, seg.cu,
            seg.max_len, seg.max_len, 0.0, True, *self.rng_state, scale=scale,
        )  # fmt: skip
        return _batched(dq), _batched(dk), _batched(dv)


def make_kernel(name):
    """A kernel by name (`KERNELS`), or a kernel object as it is."""
    if not isinstance(name, str):
        return name
    if name == "flash":
        return FlashKernel()
    raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")


class _KernelMergedAttention(torch.autograd.Function):
    """Causal attention over the step-0 keys by a kernel, merged with the diagonals; see the module doc.
    The diagonals come as s keys then s values, each [1, nkv, R, hd]: backward keeps them as they are (the
    later steps read them too) and reads them one by one, as attention.merge does."""

    @staticmethod
    def forward(ctx, q, k0, v0, rows, kernel, seg, scale, compile, *diagonals):
        if rows is None:
            every = q
        else:  # the kernel runs at its full length; the other rows' queries are 0 and their outputs dropped
            every = at_every_row(q, seg.n, rows)
        causal_out, causal_lse = kernel.forward(every, k0, v0, seg, scale)
        at_rows = (causal_out, causal_lse) if rows is None else (causal_out[:, :, rows], causal_lse[:, :, rows])
        s = len(diagonals) // 2
        if s == 0:
            out, lse = at_rows[0], at_rows[1]
        else:
            keys, values = list(diagonals[:s]), list(diagonals[s:])
            out, lse = cached_compiled(merge_forward, compile, dynamic=None)(q, *at_rows, keys, values, scale)
        ctx.save_for_backward(q, every, k0, v0, out, lse, causal_lse, rows, *diagonals)
        ctx.kernel, ctx.seg, ctx.scale, ctx.compile = kernel, seg, scale, compile
        return out

    @staticmethod
    def backward(ctx, dout):
        q, every, k0, v0, out, lse, causal_lse, rows, *diagonals = ctx.saved_tensors
        kernel, seg, scale, s = ctx.kernel, ctx.seg, ctx.scale, len(diagonals) // 2
        if rows is None:
            dq, dk0, dv0 = kernel.backward(dout, every, k0, v0, out, lse, seg, scale)
        else:  # rows without a query get dout = 0, so they add nothing; their lse only needs to be finite
            full = torch.zeros_like(every)  # token-major, as every
            dq, dk0, dv0 = kernel.backward(
                full.index_copy(2, rows, dout), every, k0, v0, full.index_copy(2, rows, out),
                causal_lse.index_copy(2, rows, lse), seg, scale,
            )  # fmt: skip
            dq = dq[:, :, rows]
        d_diagonals = ()
        if s:
            dq_diag, d_keys, d_values = cached_compiled(merge_backward, ctx.compile, dynamic=None)(
                dout, q, out, lse, diagonals[:s], diagonals[s:], scale
            )
            dq = (dq.float() + dq_diag).to(q.dtype)
            d_diagonals = (*d_keys, *d_values)  # s keys' then s values' [1, nkv, R, hd]
        return dq, dk0, dv0, None, None, None, None, None, *d_diagonals


class KernelAttention:
    """TTT attention (the `attention` callable of ttt_forward) on a fused kernel (`KERNELS`, or a kernel object)."""

    def __init__(self, kernel, compile: bool = False):
        self.kernel = make_kernel(kernel)
        self.compile = compile  # the merge's elementwise work as compiled kernels
        self._key = self._segments = None  # the batch the cached segments belong to

    def segments(self, doc: torch.Tensor, dtype: torch.dtype) -> Segments:
        # keyed on the tensor object, which the cache keeps alive: a new batch is a new doc tensor
        if self._key is None or self._key[0] is not doc or self._key[1] != dtype:
            self._segments = segments(doc, dtype if doc.device.type == "cpu" else None)
            self._key = (doc, dtype)
        return self._segments

    def __call__(self, q, keys, values, doc, step, scale, rows=None):
        seg = self.segments(doc, q.dtype)
        return _KernelMergedAttention.apply(
            q, keys[0], values[0], rows, self.kernel, seg, scale, self.compile, *keys[1:], *values[1:]
        )


def check_kernel(kernel, device, dtype=torch.bfloat16, rtol: float = 3e-2) -> dict:
    """Compare the kernel attention with explicit fp32 math on a tiny TTT problem (GQA, two samples, two
    diagonal steps; queries at every row, and at step rows only): outputs and gradients. Raises
    RuntimeError naming what differs; returns the relative errors."""
    label = getattr(kernel, "name", kernel)
    device = torch.device(device)
    if device.type == "cpu":
        dtype = torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    n, heads, kv_heads, hd, scale = 192, 4, 2, 64, 0.125
    doc = torch.repeat_interleave(torch.arange(2, device=device), torch.tensor([120, 72], device=device))

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dtype).requires_grad_()

    errors = {}
    for case, rows in (("every", None), ("rows", torch.arange(0, n, 3, device=device))):
        r = n if rows is None else len(rows)
        q = rand(1, heads, r, hd)
        keys = [rand(1, kv_heads, n, hd)] + [rand(1, kv_heads, r, hd) for _ in range(2)]
        values = [rand(1, kv_heads, n, hd)] + [rand(1, kv_heads, r, hd) for _ in range(2)]
        dout = torch.randn(1, heads, r, hd, device=device, generator=g).to(dtype)
        leaves = [q, *keys, *values]
        try:
            out = KernelAttention(kernel)(q, keys, values, doc, 2, scale, rows)
            grads = torch.autograd.grad(out, leaves, dout)
        except Exception as e:
            raise RuntimeError(
                f"attention kernel {label!r} does not run in torch {torch.__version__} on {device}: "
                f"{type(e).__name__}: {e}. Set train.attention: flex"
            ) from e
        with torch.autocast(device.type, enabled=False):
            ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
            ref = reference_attention(ref_leaves[0], ref_leaves[1:4], ref_leaves[4:], doc, 2, scale, rows)
            ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
        errors[f"{case}.out"] = relative_error(out.detach(), ref.detach())
        for name, a, b in zip(["q", "k0", "k1", "k2", "v0", "v1", "v2"], grads, ref_grads, strict=True):
            errors[f"{case}.d{name}"] = relative_error(a, b)
    bad = {k: v for k, v in errors.items() if not v <= rtol}
    if bad:
        raise RuntimeError(
            f"attention kernel {label!r} disagrees with the math reference in torch {torch.__version__} on "
            f"{device} (relative errors {bad}, tolerance {rtol}). Set train.attention: flex"
        )
    return errors


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius norms, in fp32)."""
    return float((got.float() - want.float()).norm() / want.float().norm())
