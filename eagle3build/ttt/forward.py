"""Training-time test (TTT): the draft's k-step unrolled forward over a packed batch, to its loss sums.

Alignment (packed batch, position p of a sample of length L; `j = p + 1 + s` at step s):
- input token   x[j]                    (step 0: the token after the aux state's position)
- input hidden  fc(aux[p]) at s = 0, else the draft's own output of step s-1 at p: pre-norm, or
                normed with norm_output (Eagle3Draft.feedback)
- RoPE position t + s (t = position of p inside its sample)
- target        the target's distribution at j, from the stored final stream: final norm, then the
                lm_head rows of the draft vocab only (restricted and renormalised: ttt.scorer)
- weight        loss_mask[j + 1] (the token being predicted is an assistant token) and
                "the target's greedy token at j over the FULL vocab is in the draft vocab";
                rows with j + 1 past the end of their sample are dropped (ttt.batch).
Attention at step s: a query at p sees the step-0 keys at positions <= p of its own sample (causal,
never across packed samples) and the keys of steps 1..s at p itself (the "diagonal"), in one softmax:
any implementation of attention.factory.make_attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from eagle3build.compilation import cached_compiled
from eagle3build.draft.model import Eagle3Draft, FusedWeights, attention_scale
from eagle3build.ttt.batch import PackedBatch, loss_layout
from eagle3build.ttt.loss import Objective, TTTStats, acceptance_loss, soft_cross_entropy
from eagle3build.ttt.recompute import Recompute, chunked_loss, recomputed
from eagle3build.ttt.weight_aliases import weight_aliases_per_step


# The pieces of a step that ttt_forward compiles, each a function of its own (one compilation each).
def _fused_weight_tensors(model, dtype):
    return model.fused_weight_tensors(dtype)


def _layer_in(model, fused, embed_qkv, hidden, position):
    return model.qkv(None, hidden, position, fused, embed_qkv)


def _layer_out(model, fused, attn_rows, residual):
    return model.finish_rows(attn_rows, residual, fused)


def _feedback(model, out):
    return model.feedback(out)


class _GatherRows(torch.autograd.Function):
    """x.index_select(0, index) whose backward writes each row's gradient into place once (index_copy)
    instead of accumulating it (index_select's backward, an index_add: on CUDA one atomic add per element,
    far below the memory's bandwidth; BENCHMARKS.md §2). `scatter` is `index` with every
    entry that carries no gradient sent to one scratch row past the end; the others must be distinct.
    A gradient that is exactly 0 at those entries (a weight-0 loss row) then makes it index_select's exactly."""

    @staticmethod
    def forward(ctx, x, index, scatter):
        ctx.save_for_backward(scatter)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (scatter,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.rows + 1, *grad.shape[1:])  # + the scratch row
        return out.index_copy_(0, scatter, grad)[: ctx.rows], None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, scatter: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, ...] at rows `index` [M]; gradients through `scatter` [M] (rows in 0..R, R: none), see _GatherRows.
    scatter None: `index` itself, for distinct rows."""
    return _GatherRows.apply(x, index, index if scatter is None else scatter)


def ttt_forward(
    model: Eagle3Draft,
    batch: PackedBatch,
    target_probs: torch.Tensor,
    steps: int,
    attention: Callable,
    compile: bool = False,
    objective: Objective | None = None,
    recompute: Recompute | None = None,
) -> TTTStats:
    """Unroll `steps` draft steps over a packed batch and return per-step loss sums and accuracy counts.

    target_probs: fp32 [M, K] from TargetScorer.draft_probs(batch.loss_final) (no gradient): the
    target's distribution at the batch's loss rows (with_loss_rows; every row when it has none).
    compile: torch.compile the per-step layer halves and the loss (static shapes: one compilation
    per batch length; pad or bucket lengths when they vary).
    objective: the row loss (train.loss, ttt.loss.Objective); None: soft cross-entropy (forward KL).
    recompute: the parts recomputed in backward to save memory (ttt.recompute); None: none.

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
    fused = FusedWeights(*cached_compiled(_fused_weight_tensors, compile)(model, dtype))
    step_fused = weight_aliases_per_step(fused, steps, compile)
    layer_in, layer_out = cached_compiled(_layer_in, compile), cached_compiled(_layer_out, compile)
    loss_fn = cached_compiled(soft_cross_entropy if objective is None else acceptance_loss, compile)
    feedback = cached_compiled(_feedback, compile) if model.config.norm_output else None
    hidden = model.project_aux(batch.aux).unsqueeze(0)  # [1, N, H]
    # Step s reads the ids shifted by 1 + s (token 0 past the end): the embedding half of its q/k/v is
    # rows 1 + s .. n + s of one projection of the padded ids, made once for all steps.
    embed_qkv = model.embed_qkv(F.pad(batch.input_ids, (0, steps)), fused)
    # Row gathers with gradients are gather_rows: index_select, whose backward copies each row's gradient
    # into place (advanced indexing's backward is a sorted, accumulating index_put; index_select's an
    # index_add with atomics). Exact: the step rows are distinct, and a step's loss rows read each row at
    # most once where there is a loss (the others go to a scratch row, batch.loss_scatter).
    rows = batch.step_rows

    def layer(s, hidden, keys, values):  # step s's layer: (its output, its keys, its values)
        at = None if s == 0 else rows  # step 0's keys and values at every row: every query reads them
        if at is None:
            position = (batch.position + s).unsqueeze(0)
            step_embed_qkv = embed_qkv[1 + s : 1 + s + n].unsqueeze(0)
        else:
            position = (batch.position[at] + s).unsqueeze(0)
            step_embed_qkv = gather_rows(embed_qkv, at + 1 + s).unsqueeze(0)
        q, k, v, residual = layer_in(model, step_fused[s], step_embed_qkv, hidden, position)
        attn_out = attention(q, [*keys, k], [*values, v], batch.doc, s, scale, at)  # [1, nh, R, hd]
        # squeeze, not [0]: a view in backward too ([0]'s backward fills a zero tensor and copies the gradient in)
        attn_rows = attn_out.squeeze(0).transpose(0, 1)  # [R, nh, hd]
        if s == 0 and rows is not None:  # the rest of the steps at the step rows only
            attn_rows, residual = gather_rows(attn_rows, rows), gather_rows(residual.squeeze(0), rows)[None]
        # [1, R, nh * hd], laid out alike at every step: the attention kernel's output (step 0) and the
        # diagonal merge's (later steps, strides of Inductor's choosing) differ, and dynamo guards strides,
        # so each layout would compile layer_out again for every batch length. A view where the rows are
        # already [R, nh, hd]-contiguous; else the copy o_proj's input needs anyway.
        attn_rows = attn_rows.reshape(1, len(attn_rows), -1)
        return layer_out(model, step_fused[s], attn_rows, residual), k, v

    keys, values, at_target = [], [], []
    for s in range(steps):
        if recompute is not None and s < recompute.steps:  # keys/values as tuples: the lists grow after
            hidden, k, v = recomputed(layer, s, hidden, tuple(keys), tuple(values))
        else:
            hidden, k, v = layer(s, hidden, keys, values)
        keys.append(k)
        values.append(v)
        at_target.append(gather_rows(hidden.flatten(0, 1), source[s], batch.loss_scatter[s]))  # flatten: a view
        if feedback is not None and s + 1 < steps:  # norm_output: the next step reads the normed output
            hidden = feedback(model, hidden)
    at_target = torch.stack(at_target, dim=1)  # [M, S, H]
    if compile:  # the number of loss rows varies from batch to batch: one compilation for all of them
        for t, dim in ((at_target, 0), (target_probs, 0), (weight, 0)):
            torch._dynamo.mark_dynamic(t, dim)
    # Every step's loss at once: no step reads the previous step's logits (it reads its hidden state),
    # so the lm_head is one matmul over all steps, and so is its weight gradient (k matmuls and k - 1
    # accumulations otherwise).
    extra = () if objective is None else (objective.loss, objective.lk_eta)
    if recompute is not None and recompute.loss_chunk:
        loss_sum, correct, count = chunked_loss(
            loss_fn, recompute.loss_chunk, model, fused, at_target, target_probs, weight, *extra, compile=compile
        )
    else:
        loss_sum, correct, count = loss_fn(model, fused, at_target, target_probs, weight, *extra)
    return TTTStats(loss_sum, correct.float(), count.float())
