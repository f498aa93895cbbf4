"""Training-time test (TTT): the draft's k-step unrolled forward and its loss.

Alignment (packed batch, position p of a sample of length L; `j = p + 1 + s` at step s):
- input token   x[j]                    (step 0: the token after the aux state's position)
- input hidden  fc(aux[p]) at s = 0, else the draft's own pre-norm output of step s-1 at p
- RoPE position t + s (t = position of p inside its sample)
- target        the target's distribution at j, from the stored final stream: final norm, then the
                lm_head rows of the draft vocab only (restricted and renormalised)
- weight        loss_mask[j + 1] (the token being predicted is an assistant token) and
                "the target's greedy token at j over the FULL vocab is in the draft vocab";
                rows with j + 1 past the end of their sample are dropped.
Attention at step s: a query at p sees the step-0 keys at positions <= p of its own sample (causal,
never across packed samples) and the keys of steps 1..s at p itself (the "diagonal"), in one softmax.

The attention implementations share everything else: `flex` (block-sparse flex attention over the
step-0 keys + an exact log-sum-exp merge of the diagonal keys; compiled on GPU), `flash` and `cudnn`
(the same merge on torch's varlen FlashAttention-2 or cuDNN kernel: kernel_attention.py), `sdpa` (dense
boolean mask over the concatenated keys, fused kernels) and `reference` (dense mask, explicit softmax).
tests/test_model_ttt.py checks them against a loop-by-loop implementation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from eagle3build.draft.model import Eagle3Draft, FusedWeights, attention_scale
from eagle3build.draft.target import TargetHead, rms_norm

ATTENTION_IMPLS = ("flex", "flash", "cudnn", "sdpa", "reference")


# ---------------------------------------------------------------------------------------------- data
@dataclass
class PackedBatch:
    """Samples packed back to back (batch size 1 in the attention sense)."""

    input_ids: torch.Tensor  # int64 [N]
    loss_mask: torch.Tensor  # bool [N]
    doc: torch.Tensor  # int64 [N]: which sample each token belongs to
    position: torch.Tensor  # int64 [N]: position inside its sample
    aux: torch.Tensor  # [N, 3*Ht]: aux streams, low -> mid -> high
    final: torch.Tensor  # [N, Ht]: final stream before the target's final norm
    greedy_in_draft: torch.Tensor | None = None  # bool [N]: target argmax (full vocab) at j is kept
    # The loss layout (with_loss_rows; None: every row, laid out by ttt_forward itself):
    loss_rows: torch.Tensor | None = None  # int64 [M]: the target rows j the loss reads
    loss_source: torch.Tensor | None = None  # int64 [k, M]: step s's output row for j, j - 1 - s (clamped)
    loss_weight: torch.Tensor | None = None  # bool [k, M]: row j carries a loss at step s
    # with_step_rows; None: every step computes every row. Otherwise the rows whose output the steps
    # compute (step 0's keys and values at every row), and loss_source indexes into them:
    step_rows: torch.Tensor | None = None  # int64 [R], sorted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def loss_final(self) -> torch.Tensor:
        """The final stream at the loss rows: what TargetScorer.draft_probs scores for ttt_forward."""
        if self.loss_rows is None:
            return self.final
        return self.final[self.loss_rows.clamp(max=self.num_tokens - 1)]  # padding rows (= N) read row N - 1

    def pin_memory(self) -> PackedBatch:
        """Page-locked contiguous copies: their copy to the GPU (`to`) runs asynchronously."""
        return PackedBatch(
            *(None if (t := getattr(self, f.name)) is None else t.contiguous().pin_memory() for f in fields(self))
        )

    def to(self, device, dtype=None) -> PackedBatch:
        """On `device`; the hidden states (aux, final) also cast to `dtype` if given."""

        def move(name, t):
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if name in ("aux", "final") else None, non_blocking=True)

        return PackedBatch(**{f.name: move(f.name, getattr(self, f.name)) for f in fields(self)})


def pack(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> PackedBatch:
    """Pack (input_ids [L], loss_mask [L], hidden [L, 4, Ht]) samples into one batch."""
    lengths = torch.tensor([len(ids) for ids, _, _ in samples])
    doc = torch.repeat_interleave(torch.arange(len(samples)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
    hidden = torch.cat([h for _, _, h in samples])
    return PackedBatch(
        input_ids=torch.cat([ids for ids, _, _ in samples]).long(),
        loss_mask=torch.cat([m for _, m, _ in samples]).bool(),
        doc=doc,
        position=position,
        aux=hidden[:, :3].flatten(1),
        final=hidden[:, 3],
    )


def pad_batch(batch: PackedBatch, multiple: int) -> PackedBatch:
    """Append one dummy sample so the length is a multiple of `multiple` (compiled kernels see few shapes).

    The dummy sample has its own doc id (nothing attends across samples), no loss mask and zero
    hidden states, so it carries no loss and changes no real row.
    """
    assert batch.loss_rows is None, "pad first, then choose the loss rows (with_loss_rows)"
    pad = -batch.num_tokens % multiple
    if pad == 0:
        return batch

    def extend(t, fill):
        return None if t is None else torch.cat((t, t.new_full((pad, *t.shape[1:]), fill)))

    next_doc = int(batch.doc[-1]) + 1 if batch.num_tokens else 0
    return PackedBatch(
        input_ids=extend(batch.input_ids, 0),
        loss_mask=extend(batch.loss_mask, False),
        doc=extend(batch.doc, next_doc),
        position=torch.cat((batch.position, torch.arange(pad, device=batch.position.device))),
        aux=extend(batch.aux, 0),
        final=extend(batch.final, 0),
        greedy_in_draft=extend(batch.greedy_in_draft, False),
    )


def shift(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """y[p] = x[p + n], `fill` past the end."""
    if n == 0:
        return x
    return torch.cat((x[n:], x.new_full((min(n, len(x)),), fill)))


def predicts_assistant_token(batch: PackedBatch) -> torch.Tensor:
    """bool [N]: the token after row j, x[j + 1], is an assistant token of j's own sample."""
    return shift(batch.loss_mask, 1, False) & (shift(batch.doc, 1, -1) == batch.doc)


def with_loss_rows(batch: PackedBatch, steps: int, multiple: int = 1) -> PackedBatch:
    """The batch with its loss layout for `steps` TTT steps: the rows j whose predicted token x[j + 1] is
    an assistant token of j's sample, padded with N (weight 0) to a multiple of `multiple` rows
    (compiled kernels see few shapes), and each step's source row and weight there (`loss_layout`).

    Only these rows can carry a loss at any step, so the draft's lm_head, the loss and the target's
    restricted distribution are computed for them alone: on chat data, where prompts and system
    messages are masked, that skips their share of the step's largest matmul. Laid out on the host
    while the batch loads, so the training step launches none of these small index kernels (the GPU
    would idle while the host launched them) and never waits for the GPU to count rows. Set
    greedy_in_draft before, or fold it in later with `with_greedy_in_draft`.
    """
    rows = predicts_assistant_token(batch).nonzero().flatten()
    size = max(-(-len(rows) // multiple), 1) * multiple  # never 0 rows: compiled kernels specialise on 0
    rows = torch.cat((rows, rows.new_full((size - len(rows),), batch.num_tokens)))
    return loss_layout(batch, rows, steps)


def loss_layout(batch: PackedBatch, rows: torch.Tensor, steps: int) -> PackedBatch:
    """The batch with loss rows `rows` (N marks padding) and, per step s, the output row p = j - 1 - s
    that predicts row j's target and whether it carries a loss: p inside the batch and in j's sample,
    x[j + 1] an assistant token of that sample, and the target's greedy token at j in the draft vocab.
    Where the batch has step rows, p is indexed among them (every p with a loss is one of them)."""
    n = batch.num_tokens
    source = rows - 1 - torch.arange(steps, device=rows.device)[:, None]  # [S, M]
    j = rows.clamp(max=n - 1)
    weight = (source >= 0) & (rows < n) & predicts_assistant_token(batch)[j]
    source = source.clamp(0, n - 1)
    weight &= batch.doc[source] == batch.doc[j]
    if batch.greedy_in_draft is not None:
        weight &= batch.greedy_in_draft[j]
    if batch.step_rows is not None:
        source = torch.searchsorted(batch.step_rows, source).clamp(max=len(batch.step_rows) - 1)
    return replace(batch, loss_rows=rows, loss_source=source, loss_weight=weight)


def with_step_rows(batch: PackedBatch, multiple: int = 1) -> PackedBatch:
    """The batch (laid out by with_loss_rows) with its step rows, the rows whose output the TTT steps
    compute: those with a loss at some step, plus spare rows up to a multiple of `multiple` (compiled
    kernels see the lengths the batches are padded to); the batch unchanged if that is every row.

    Why this is exact: every row's step-0 keys and values are computed (every later query reads them),
    and beyond them row p's output at step s reads only row p's earlier steps. So a row with no loss at
    any step changes nothing that is trained: on chat data most of a prompt is such rows, and after its
    step-0 q/k/v and attention they are skipped as their lm_head already is. Rows whose loss the
    greedy-in-draft flags remove later (with_greedy_in_draft) stay: still exact.
    """
    assert batch.loss_rows is not None and batch.step_rows is None, "lay out the loss rows first (with_loss_rows)"
    n, steps = batch.num_tokens, len(batch.loss_weight)
    needed = torch.zeros(n, dtype=torch.bool, device=batch.doc.device)
    needed[batch.loss_source[batch.loss_weight]] = True
    count = int(needed.sum())
    size = max(-(-count // multiple), 1) * multiple  # never 0 rows: compiled kernels specialise on 0
    if size >= n:
        return batch
    needed[(~needed).nonzero().flatten()[: size - count]] = True  # spare rows: computed, never read
    batch = replace(batch, step_rows=needed.nonzero().flatten())
    return loss_layout(batch, batch.loss_rows, steps)


def with_greedy_in_draft(batch: PackedBatch, greedy: torch.Tensor) -> PackedBatch:
    """The batch with the target's greedy-in-draft flags [N], its loss layout (if any) redone with them."""
    batch = replace(batch, greedy_in_draft=greedy)
    if batch.loss_rows is None:
        return batch
    return loss_layout(batch, batch.loss_rows, len(batch.loss_weight))


# ---------------------------------------------------------------------------------------------- compile
def compiled(fn: Callable, **kwargs) -> Callable:
    """torch.compile(fn, **kwargs), with Inductor's coordinate-descent tuning of its generated kernels on.

    The tuning times a few block sizes for each fused elementwise/reduction kernel the first time it is
    compiled (~2 extra minutes per batch length, kept in Inductor's on-disk cache: the image points
    TORCHINDUCTOR_CACHE_DIR at /cache) and makes the training step ≈2% faster (BENCHMARKS.md §2).
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=0 turns it off.
    """
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    # A kernel compiled for static shapes meets each of training's length buckets (the step rows are
    # rounded to them too) with gradients and again under no_grad in validation: dynamo's default
    # limit (8 compilations per function) would run the rest eagerly.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 16)
    inductor_config.coordinate_descent_tuning = os.environ.get("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "1") == "1"
    return torch.compile(fn, **kwargs)


# ---------------------------------------------------------------------------------------------- target
class TargetScorer:
    """The target's distribution from its stored final stream: final norm + lm_head (never [N, V] at once)."""

    def __init__(
        self,
        target: TargetHead,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        chunk_tokens: int = 1024,
        compile: bool = False,
    ):
        draft_ids = torch.arange(len(d2t)) + d2t
        self.norm = target.norm.to(device, dtype)
        self.eps = target.rms_norm_eps
        self.lm_head = target.lm_head.to(device, dtype)  # [V, H], only for the greedy token
        self.lm_head_draft = self.lm_head[draft_ids.to(device)]  # [K, H]
        self.t2d = t2d.to(device)
        self.chunk_tokens = chunk_tokens
        self.compile = compile  # draft_probs: one compilation for every row count

    @torch.no_grad()
    def greedy_in_draft(self, final: torch.Tensor) -> torch.Tensor:
        """bool [N]: the target's greedy token over the full vocab is in the draft vocab."""
        out = []
        for rows in final.split(self.chunk_tokens):
            logits = rms_norm(rows.to(self.norm.dtype), self.norm, self.eps) @ self.lm_head.T
            out.append(self.t2d[logits.argmax(-1)])
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool, device=final.device)

    @torch.no_grad()
    def draft_probs(self, final: torch.Tensor) -> torch.Tensor:
        """fp32 [N, K]: the target distribution restricted to the draft vocab and renormalised."""
        if self.compile:
            torch._dynamo.mark_dynamic(final, 0)
        return _kernel(_draft_probs, self.compile, dynamic=None)(final, self.norm, self.eps, self.lm_head_draft)


def _draft_probs(final, norm, eps, lm_head_draft):
    # compiled, the fp32 cast and the softmax are one kernel over the bf16 logits (eagerly: an fp32 copy, then a softmax)
    logits = rms_norm(final.to(norm.dtype), norm, eps) @ lm_head_draft.T
    return torch.softmax(logits.float(), dim=-1)


# ---------------------------------------------------------------------------------------------- attention
def _step_mask(doc: torch.Tensor, step: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Dense bool mask [R, N + step*R]: causal within a sample over the N step-0 keys + the diagonals,
    for queries at `rows` (R of them; None: every row, R = N)."""
    n = len(doc)
    idx = torch.arange(n, device=doc.device)
    at = idx if rows is None else rows
    causal = (idx[None, :] <= at[:, None]) & (doc[None, :] == doc[at][:, None])
    eye = torch.eye(len(at), dtype=torch.bool, device=doc.device)
    return torch.cat([causal] + [eye] * step, dim=1)


def reference_attention(q, keys, values, doc, step, scale, rows=None):
    """Explicit math: softmax(q k^T * scale + mask) v, kv heads repeated for GQA."""
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~_step_mask(doc, step, rows), float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def sdpa_attention(q, keys, values, doc, step, scale, rows=None):
    mask = _step_mask(doc, step, rows)
    return F.scaled_dot_product_attention(
        q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask, scale=scale, enable_gqa=True
    )


def stacked_diagonals(keys, values, compile: bool = False):
    """The diagonal keys/values of steps 1..s stacked, [1, nkv, N, s, hd] each. compile: their s dim
    marked dynamic, so the merge's kernels compile once for all steps (s = 1 is specialised: size-1
    dims always are)."""
    diag_k, diag_v = torch.stack(keys, dim=-2), torch.stack(values, dim=-2)
    if compile and len(keys) > 1:
        torch._dynamo.mark_dynamic(diag_k, 3)
        torch._dynamo.mark_dynamic(diag_v, 3)
    return diag_k, diag_v


def merge_diagonal(q, causal_out, causal_lse, keys, values, scale, compile: bool = False):
    """Fold the diagonal keys of steps 1..s into a causal attention result, exactly.

    softmax over [causal keys] ∪ [diagonals] = a convex combination of the causal output (weight
    exp(lse_c)) and each diagonal value (weight exp(q·k_i * scale)), normalised together. The
    diagonal scores are N dot products per head, so this costs O(N·s·hd) instead of attention over
    (s+1)·N keys. Gradients reach q and the causal keys through `causal_lse`.

    q, causal_out [1, nh, N, hd]; causal_lse [1, nh, N] (natural log, scale applied);
    keys/values: s tensors [1, nkv, N, hd]. compile: one fused kernel (the number of diagonals is
    a dynamic dimension, so all steps share a compilation).
    """
    if not keys:
        return causal_out
    diag_k, diag_v = stacked_diagonals(keys, values, compile)
    return _kernel(_merge, compile, dynamic=None)(q, causal_out, causal_lse, diag_k, diag_v, scale)


def _merge(q, causal_out, causal_lse, diag_k, diag_v, scale):
    return merge_forward(q, causal_out, causal_lse, diag_k, diag_v, scale)[0]  # differentiable in all inputs


def grouped_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, nh, N, ...] -> [b, nkv, g, N, ...]: query heads grouped by their kv head."""
    b, h, *rest = t.shape
    return t.view(b, kv_heads, h // kv_heads, *rest)


def token_major(t: torch.Tensor) -> torch.Tensor:
    """[1, N, heads, d] memory seen as [1, heads, N, d]: the layout the varlen kernels read and write
    without copies, and the one o_proj reads (attn_out.transpose(1, 2) is then a view)."""
    return t.transpose(1, 2)


def merge_forward(q, causal_out, causal_lse, diag_k, diag_v, scale):
    """The merged softmax's output (q's dtype, token-major) and log-sum-exp (fp32) over the causal keys
    (output and log-sum-exp of the causal attention) and the diagonals diag_k/diag_v [1, nkv, N, s, hd].
    Flex's merge differentiates it with autograd; kernel_attention pairs it with its own backward."""
    nkv = diag_k.shape[1]
    diag_scores = (grouped_heads(q, nkv).unsqueeze(-2) * diag_k.unsqueeze(2)).float().sum(-1) * scale  # [1, nkv, g, N, s]
    scores = torch.cat((grouped_heads(causal_lse, nkv).unsqueeze(-1).float(), diag_scores), dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # [1, nkv, g, N]
    weights = torch.exp(scores - lse.unsqueeze(-1))
    out = weights[..., :1] * grouped_heads(causal_out, nkv).float() + (
        weights[..., 1:].unsqueeze(-1) * diag_v.unsqueeze(2).float()
    ).sum(-2)
    return token_major(out.to(q.dtype).flatten(1, 2).transpose(1, 2).contiguous()), lse.flatten(1, 2)


class MergedAttention:
    """TTT attention as one causal attention over the step-0 keys + an exact LSE merge of the diagonals.

    The step-0 keys/values are computed once (step 0) and reused by every step; only the queries
    change. Subclasses supply `causal` (output and log-sum-exp of doc-masked causal attention).
    """

    def causal(self, q, k, v, doc, scale):
        raise NotImplementedError

    compile = False

    def __call__(self, q, keys, values, doc, step, scale, rows=None):
        if rows is None:
            out, lse = self.causal(q, keys[0], values[0], doc, scale)
        else:  # queries at `rows` only: the causal kernel runs at the length it was built for (the
            # other rows' queries are 0 and their outputs dropped, so they reach no gradient)
            every = q.new_zeros(*q.shape[:2], len(doc), q.shape[3]).index_copy(2, rows, q)
            out, lse = self.causal(every, keys[0], values[0], doc, scale)
            out, lse = out.index_select(2, rows), lse.index_select(2, rows)
        return merge_diagonal(q, out, lse, keys[1:], values[1:], scale, self.compile)


class MathMergedAttention(MergedAttention):
    """Dense causal part with explicit softmax: the CPU check of the merge (flex has no CPU backward)."""

    def __init__(self, compile: bool = False):
        self.compile = compile

    def causal(self, q, k, v, doc, scale):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(~_step_mask(doc, 0), float("-inf"))
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v, torch.logsumexp(scores, dim=-1)


class FlexAttention(MergedAttention):
    """Causal part by block-sparse flex attention over the step-0 keys only (blocks above the diagonal
    and across packed samples are skipped); its block mask is built once per batch and reused by all
    steps, and every step calls the kernel with the same shapes (one compilation per length).

    torch 2.13 has no flex backward on CPU: training on CPU uses `sdpa` (same mask, dense).
    """

    def __init__(self, compile: bool):
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

        self.create_block_mask = create_block_mask
        self.flex_attention = compiled(flex_attention, dynamic=False) if compile else flex_attention
        self.aux_request = AuxRequest(lse=True)
        self.compile = compile
        self._doc = self._block_mask = None  # the batch the cached block mask belongs to

    @staticmethod
    def mask_mod(doc: torch.Tensor):
        """Causal within a sample over the step-0 keys, N x N."""

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (doc[kv_idx] == doc[q_idx])

        return mask_mod

    def block_mask(self, doc: torch.Tensor):
        # keyed on the tensor object, which the cache keeps alive: a new batch is a new doc tensor
        if self._doc is not doc:
            n = len(doc)
            self._block_mask = self.create_block_mask(
                self.mask_mod(doc), None, None, n, n, device=doc.device, _compile=self.compile
            )
            self._doc = doc
        return self._block_mask

    def causal(self, q, k, v, doc, scale):
        out, aux = self.flex_attention(
            q,
            k,
            v,
            block_mask=self.block_mask(doc),
            scale=scale,
            enable_gqa=True,
            return_aux=self.aux_request,
        )
        return out, aux.lse


def make_attention(impl: str, compile: bool = False) -> Callable:
    if impl == "flex":
        return FlexAttention(compile)
    if impl in ("flash", "cudnn"):
        from eagle3build.attention.kernel import KernelAttention  # which builds on this module

        return KernelAttention(impl, compile)
    if impl == "sdpa":
        return sdpa_attention
    if impl == "reference":
        return reference_attention
    raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")


# ---------------------------------------------------------------------------------------------- TTT
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
    # (2.0 ms per step at the Llama-8B head shape on an H200 for 2.35 GB of input, ≈ 1.2 TB/s). The max
    # is a constant shift: it needs no gradient.
    zmax = logits.detach().amax(-1, keepdim=True)
    lse = (zmax + (logits - zmax).exp().sum(-1, keepdim=True).log()).squeeze(-1)
    loss = lse * p.sum(-1) - (p * logits).sum(-1)  # [M, S]
    target_argmax = target_probs.argmax(-1, keepdim=True)  # compiled: in p.sum's pass over the target rows
    correct = (weight * (logits.argmax(-1) == target_argmax)).sum(0)
    return (weight * loss).sum(0), correct, weight.sum(0)


_COMPILED: dict[str, Callable] = {}


def _kernel(fn: Callable, compile: bool, dynamic: bool | None = False) -> Callable:
    """`fn` itself, or its torch.compile'd version (one per function, shared by all calls).
    dynamic=None: static but in the dims marked dynamic (stacked_diagonals)."""
    if not compile:
        return fn
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = compiled(fn, dynamic=dynamic)
    return _COMPILED[fn.__name__]


def _fused_weight_tensors(model, dtype):
    return model.fused_weight_tensors(dtype)


class PerStepWeights(torch.autograd.Function):
    """`steps` aliases of each weight, one per TTT step, whose backward adds the steps' gradients in one pass.

    A tensor that k steps read gets its gradient by k - 1 in-place adds as the steps' backward passes
    arrive, each reading two weight-sized gradients and writing one (1.8 ms of a training step at the
    Llama-8B head shape on an H200, sixteenth session's profile). Gradients of distinct outputs of one
    autograd node are instead kept apart until all have arrived; this node's backward then adds them in
    one compiled kernel, in fp32, rounded once. The price: the per-step weights' gradients of all steps
    are held until step 0's backward (k - 1 more weight-sized gradients).
    """

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
                parts = [_kernel(_sum_in_fp32, True)(*parts)]
            sums.append(parts[0] if parts else None)
        return (None, *sums)


def _sum_in_fp32(*grads):
    total = grads[0].float()
    for g in grads[1:]:
        total = total + g.float()
    return total.to(grads[0].dtype)


PER_STEP = ("qkv_hidden", "gate_up", "o", "down")  # the fused weights every TTT step's layer reads (lm_head
# and qkv_embed are read once per batch: by the loss over all steps, by the embedding half's projection)


def per_step_weights(fused: FusedWeights, steps: int, compile: bool) -> list[FusedWeights]:
    """The fused weights of each TTT step: PerStepWeights' aliases where the step is compiled (eagerly,
    its sum would be k - 1 adds again, and in fp32)."""
    if steps == 1 or not compile or not torch.is_grad_enabled():
        return [fused] * steps
    aliases = PerStepWeights.apply(steps, *(getattr(fused, n) for n in PER_STEP))
    n = len(PER_STEP)
    return [replace(fused, **dict(zip(PER_STEP, aliases[s * n : (s + 1) * n], strict=True))) for s in range(steps)]


def _layer_in(model, fused, embed_qkv, hidden, position):
    return model.qkv(None, hidden, position, fused, embed_qkv)


def _layer_out(model, fused, attn_out, residual):
    return model.finish(attn_out, residual, fused)


def ttt_forward(
    model: Eagle3Draft,
    batch: PackedBatch,
    target_probs: torch.Tensor,
    steps: int,
    attention: Callable,
    compile: bool = False,
) -> TTTStats:
    """Unroll `steps` draft steps over a packed batch and return per-step loss sums and accuracy counts.

    target_probs: fp32 [M, K] from TargetScorer.draft_probs(batch.loss_final) (no gradient): the
    target's distribution at the batch's loss rows (with_loss_rows; every row when it has none).
    compile: torch.compile the per-step layer halves and the loss (static shapes: one compilation
    per batch length; pad or bucket lengths when they vary).

    Row p of step s predicts the target at j = p + 1 + s. The loss is taken in target order at the loss
    rows j: step s contributes its output row j - 1 - s (weight 0 where that is before the batch or
    outside j's sample), so the target tensors serve every step as they are, and one loss call covers
    all steps. Past step 0's q/k/v and attention, the steps compute the batch's step rows only, if it has
    them (with_step_rows).
    """
    n = batch.num_tokens
    if batch.loss_rows is None:  # every row, laid out here (training lays batches out on the host)
        batch = loss_layout(batch, torch.arange(n, device=batch.doc.device), steps)
    if len(target_probs) != len(batch.loss_rows):
        raise ValueError(
            f"target_probs has {len(target_probs)} rows for {len(batch.loss_rows)} loss rows: score batch.loss_final"
        )
    if len(batch.loss_weight) != steps:
        raise ValueError(f"the batch's loss rows were laid out for {len(batch.loss_weight)} steps, not {steps}")
    scale = attention_scale(model.config)
    target_probs = target_probs.float()
    source, weight = batch.loss_source, batch.loss_weight.T.to(target_probs.dtype, memory_format=torch.contiguous_format)
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    # Once per batch, shared by the steps. Compiled, the casts, concatenations and the scale fold are a
    # few fused kernels forward and backward instead of eager copies and zero-filled slice gradients.
    fused = FusedWeights(*_kernel(_fused_weight_tensors, compile)(model, dtype))
    step_fused = per_step_weights(fused, steps, compile)
    layer_in, layer_out = _kernel(_layer_in, compile), _kernel(_layer_out, compile)
    loss_fn = _kernel(soft_cross_entropy, compile)
    hidden = model.fuse(batch.aux).unsqueeze(0)  # [1, N, H]
    # Step s reads the ids shifted by 1 + s (token 0 past the end): the embedding half of its q/k/v is
    # rows 1 + s .. n + s of one projection of the padded ids, made once for all steps.
    embed_qkv = model.embed_qkv(F.pad(batch.input_ids, (0, steps)), fused)
    # Row gathers with gradients are index_select, not advanced indexing: its backward is a fill and one
    # index_add (deterministic here: a row is gathered twice only where all but one copy carry a zero
    # gradient), advanced indexing's a sorted, accumulating index_put (≈ 1 ms of a step at the Llama-8B
    # head shape on an H200, sixteenth session's profile)
    rows = batch.step_rows
    keys, values, at_target = [], [], []
    for s in range(steps):
        at = None if s == 0 else rows  # step 0's keys and values at every row: every query reads them
        if at is None:
            position = (batch.position + s).unsqueeze(0)
            step_embed_qkv = embed_qkv[1 + s : 1 + s + n].unsqueeze(0)
        else:
            position = (batch.position[at] + s).unsqueeze(0)
            step_embed_qkv = embed_qkv.index_select(0, at + 1 + s).unsqueeze(0)
        q, k, v, residual = layer_in(model, step_fused[s], step_embed_qkv, hidden, position)
        keys.append(k)
        values.append(v)
        attn_out = attention(q, keys, values, batch.doc, s, scale, at)
        if s == 0 and rows is not None:  # the rest of the steps at the step rows only
            attn_out, residual = attn_out.index_select(2, rows), residual.index_select(1, rows)
        hidden = layer_out(model, step_fused[s], attn_out, residual)
        at_target.append(hidden.flatten(0, 1).index_select(0, source[s]))  # a view: no select backward
    at_target = torch.stack(at_target, dim=1)  # [M, S, H]
    if compile:  # the number of loss rows varies from batch to batch: one compilation for all of them
        for t, dim in ((at_target, 0), (target_probs, 0), (weight, 0)):
            torch._dynamo.mark_dynamic(t, dim)
    # Every step's loss at once: no step reads the previous step's logits (it reads its hidden state),
    # so the lm_head is one matmul over all steps, and so is its weight gradient (k matmuls and k - 1
    # accumulations otherwise).
    loss_sum, correct, count = loss_fn(model, fused, at_target, target_probs, weight)
    return TTTStats(loss_sum, correct.float(), count.float())


def step_weights(steps: int, step_weight: float, device=None) -> torch.Tensor:
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
