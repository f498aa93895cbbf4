"""A TTT batch: samples packed back to back, and the row layouts the training step reads.

Packed batch, position p of a sample of length L; at TTT step s the draft's row p predicts the target at
`j = p + 1 + s`. A row j carries a loss at step s when the token it predicts, x[j + 1], is an assistant
token of its sample (loss_mask), the target's greedy token at j over the full vocab is in the draft vocab
(greedy_in_draft), and p = j - 1 - s lies inside j's sample; rows with j + 1 past the end of their
sample carry none. Laid out on the host while the batch loads (`with_loss_rows`, `with_step_rows`), so
the training step launches no small index kernels of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from eagle3build.shards import dequantize_fp8


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
    # int64 [k, M]: loss_source where row j carries a loss at step s, else one past the last row, so the
    # gradient of step s's gather writes each output row once (ttt.forward.gather_rows)
    loss_scatter: torch.Tensor | None = None
    # with_step_rows; None: every step computes every row. Otherwise the rows whose output the steps
    # compute (step 0's keys and values at every row), and loss_source indexes into them:
    step_rows: torch.Tensor | None = None  # int64 [R], sorted
    # fp8-stored hidden states travel as stored (aux and final e4m3) with their per-row scales, and `to`
    # dequantizes them on the device; None once dequantized or when stored in bf16/fp32:
    aux_scale: torch.Tensor | None = None  # fp32 [N, 3]
    final_scale: torch.Tensor | None = None  # fp32 [N]

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
        """On `device`; the hidden states (aux, final) also cast to `dtype` if given, fp8 ones dequantized
        there (to `dtype`, else fp32) after the copy.

        Copies to a GPU are asynchronous (from pinned memory, `pin_memory`: the host goes on loading the
        next batch). Copies to the host are not: the host reads them next, and an asynchronous one could
        still be in flight (a batch laid out from such a copy once read zeros for most of its mask)."""
        non_blocking = torch.device(device).type != "cpu"
        fp8 = self.aux_scale is not None

        def move(name, t):
            if t is None:
                return None
            cast = dtype if name in ("aux", "final") and not fp8 else None
            return t.to(device=device, dtype=cast, non_blocking=non_blocking)

        moved = {f.name: move(f.name, getattr(self, f.name)) for f in fields(self)}
        if fp8:
            dq = dtype or torch.float32
            moved["aux"] = dequantize_fp8(moved["aux"].unflatten(1, (3, -1)), moved.pop("aux_scale"), dq).flatten(1)
            moved["final"] = dequantize_fp8(moved["final"], moved.pop("final_scale"), dq)
        return PackedBatch(**moved)


def pack(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scales: list[torch.Tensor] | None = None
         ) -> PackedBatch:
    """Pack (input_ids [L], loss_mask [L], hidden [L, 4, Ht]) samples into one batch; `scales` (fp32 [L, 4]
    each) when the hidden states are fp8 as stored (dequantized by `to`)."""
    lengths = torch.tensor([len(ids) for ids, _, _ in samples])
    doc = torch.repeat_interleave(torch.arange(len(samples)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
    hidden = torch.cat([h for _, _, h in samples])
    scale = torch.cat(scales) if scales is not None else None
    return PackedBatch(
        input_ids=torch.cat([ids for ids, _, _ in samples]).long(),
        loss_mask=torch.cat([m for _, m, _ in samples]).bool(),
        doc=doc,
        position=position,
        aux=hidden[:, :3].flatten(1),
        final=hidden[:, 3],
        aux_scale=None if scale is None else scale[:, :3],
        final_scale=None if scale is None else scale[:, 3],
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
        aux_scale=extend(batch.aux_scale, 0),
        final_scale=extend(batch.final_scale, 0),
    )


def shift(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """y[p] = x[p + n], `fill` past the end."""
    if n == 0:
        return x
    return torch.cat((x[n:], x.new_full((min(n, len(x)),), fill)))


def rounded_up(count: int, multiple: int) -> int:
    """count rounded up to a multiple of `multiple`, and never 0 rows: compiled kernels specialise on 0."""
    return max(-(-count // multiple), 1) * multiple


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
    size = rounded_up(len(rows), multiple)
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
    # the output rows with a loss at one step are distinct (j -> j - 1 - s), the rest share one scratch row
    scatter = torch.where(weight, source, n if batch.step_rows is None else len(batch.step_rows))
    return replace(batch, loss_rows=rows, loss_source=source, loss_weight=weight, loss_scatter=scatter)


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
    size = rounded_up(count, multiple)
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
