"""The fast TTT pieces: LSE merge of the diagonal keys, fused projections, static-shape loss."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle3build.attention.dense import reference_attention, step_mask
from eagle3build.attention.merge import merge_diagonal

torch.set_num_threads(2)


def causal_with_lse(q, k, v, doc, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~step_mask(doc, 0), float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("step", [0, 1, 4])
def test_lse_merge_equals_one_softmax_over_all_keys_with_gradients(step):
    """Causal attention over step-0 keys + LSE merge == one softmax over the concatenated keys (GQA)."""
    g = torch.Generator().manual_seed(step)
    nh, nkv, hd = 6, 2, 8
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor([5, 6]))
    n = len(doc)
    q = torch.randn(1, nh, n, hd, generator=g, dtype=torch.float32, requires_grad=True)
    keys = [
        torch.randn(1, nkv, n, hd, generator=g, dtype=torch.float32, requires_grad=True)
        for _ in range(step + 1)
    ]
    values = [
        torch.randn(1, nkv, n, hd, generator=g, dtype=torch.float32, requires_grad=True)
        for _ in range(step + 1)
    ]
    scale = hd**-0.5
    probe = torch.randn(1, nh, n, hd, generator=g, dtype=torch.float32)

    expected = reference_attention(q, keys, values, doc, step, scale)
    expected_grads = torch.autograd.grad((expected * probe).sum(), [q, *keys, *values])
    out, lse = causal_with_lse(q, keys[0], values[0], doc, scale)
    merged = merge_diagonal(q, out, lse, keys[1:], values[1:], scale)
    grads = torch.autograd.grad((merged * probe).sum(), [q, *keys, *values])
    assert torch.allclose(merged, expected, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def test_fused_projections_equal_the_named_ones():
    from eagle3build.draft.model import DraftConfig, Eagle3Draft

    c = DraftConfig(32, 4, 2, 8, 48, 1e-5, 10000.0, 64, 50, 20, 32, [1, 2, 3])
    torch.manual_seed(0)
    model = Eagle3Draft(c)
    ids = torch.randint(0, 50, (1, 7))
    hidden = torch.randn(1, 7, 32)
    pos = torch.arange(7)[None]
    fused = model.fused_weights()
    plain = model.qkv(ids, hidden, pos)
    joint = model.qkv(ids, hidden, pos, fused)
    for a, b in zip(plain, joint, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    attn_out = torch.randn(1, 4, 7, 8)
    a = model.finish(attn_out, hidden)
    b = model.finish(attn_out, hidden, fused)
    assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(model.logits(b), model.logits(b, fused), atol=1e-6)
    # gradients reach the named parameters (the export layout) through the concatenation
    model.logits(b, fused).sum().backward()
    assert model.midlayer.mlp.up_proj.weight.grad is not None
    assert model.midlayer.mlp.up_proj.weight.grad.abs().sum() > 0


def test_weights_cast_once_per_step_give_the_named_weights_their_gradients():
    """Under autocast, fused_weights(dtype) casts every projection once for all TTT steps instead of once
    per use; each use's gradient adds up in that dtype and reaches the fp32 parameter: the same
    gradients as casting per use, to the dtype's rounding."""
    from eagle3build.draft.model import DraftConfig, Eagle3Draft

    c = DraftConfig(32, 4, 2, 8, 48, 1e-5, 10000.0, 64, 50, 20, 32, [1, 2, 3])
    torch.manual_seed(0)
    model = Eagle3Draft(c)
    ids, aux, pos = torch.randint(0, 50, (1, 7)), torch.randn(1, 7, 96), torch.arange(7)[None]
    attn_out = torch.randn(1, 4, 7, 8)

    def two_steps(dtype):  # each weight used twice, as the TTT steps use it
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fused = model.fused_weights(dtype)
            h = model.project_aux(aux)
            for _ in range(2):
                q, k, v, residual = model.qkv(ids, h, pos, fused)
                h = model.finish(attn_out * q.mean() + k.mean() + v.mean(), residual, fused)
            loss = model.logits(h, fused).float().square().mean()
        loss.backward()
        return {n: q.grad for n, q in model.named_parameters() if q.requires_grad}

    per_use = two_steps(None)  # autocast casts the fp32 weights at every use
    once = two_steps(torch.bfloat16)
    assert set(once) == set(per_use)
    for name, grad in once.items():
        assert grad is not None and grad.dtype == torch.float32, name
        scale = per_use[name].abs().max()
        assert scale > 0, name
        assert (grad - per_use[name]).abs().max() <= 0.02 * scale, name


def test_weight_aliases_per_step_give_the_shared_weights_gradients(monkeypatch):
    """Compiled steps each read their own alias of the per-step weights (ttt.weight_aliases), whose
    gradients one compiled kernel adds: the named weights get the gradients of plain shared use, also
    where a step leaves some aliases unused (step 1 here skips o_proj and the MLP)."""
    from eagle3build import compilation
    from eagle3build.draft.model import DraftConfig, Eagle3Draft
    from eagle3build.ttt.weight_aliases import sum_in_fp32, weight_aliases_per_step

    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "0")  # tuning GPU kernels only
    monkeypatch.setattr(compilation, "COMPILED", {})
    c = DraftConfig(32, 4, 2, 8, 48, 1e-5, 10000.0, 64, 50, 20, 32, [1, 2, 3])
    torch.manual_seed(0)
    model = Eagle3Draft(c)
    ids, aux, pos = torch.randint(0, 50, (1, 7)), torch.randn(1, 7, 96), torch.arange(7)[None]
    attn_out = torch.randn(1, 4, 7, 8)

    def three_steps(aliases: bool):
        model.zero_grad()
        fused = model.fused_weights()
        step_fused = weight_aliases_per_step(fused, 3, compile=True) if aliases else [fused] * 3
        h = model.project_aux(aux)
        for s, f in enumerate(step_fused):
            q, k, v, residual = model.qkv(ids, h, pos, f)
            out = attn_out * q.mean() + k.mean() + v.mean()
            h = h + out.mean() if s == 1 else model.finish(out, residual, f)
        model.logits(h, fused).square().mean().backward()
        return {n: q.grad for n, q in model.named_parameters() if q.requires_grad}

    shared, per_step = three_steps(False), three_steps(True)
    assert sum_in_fp32 in compilation.COMPILED  # the steps' gradients were added by the compiled kernel
    assert set(per_step) == set(shared)
    for name, grad in per_step.items():
        torch.testing.assert_close(grad, shared[name], rtol=1e-5, atol=1e-7, msg=name)


def test_padding_a_batch_changes_no_loss_or_count():
    """Compiled runs pad batches to a bucketed length: the dummy sample must carry nothing."""
    from test_model_ttt import random_samples, tiny_draft

    from eagle3build.attention.merged import MathMergedAttention
    from eagle3build.ttt.batch import pack, pad_batch
    from eagle3build.ttt.forward import ttt_forward

    model, _, scorer = tiny_draft()
    batch = pack(random_samples([7, 5, 9], seed=4))
    batch.greedy_in_draft = scorer.greedy_in_draft(batch.final)
    padded = pad_batch(batch, 16)
    assert padded.num_tokens == 32 and int(padded.doc[-1]) == 3
    plain = ttt_forward(model, batch, scorer.draft_probs(batch.final), 3, MathMergedAttention())
    pad = ttt_forward(model, padded, scorer.draft_probs(padded.final), 3, MathMergedAttention())
    assert torch.allclose(plain.loss_sum, pad.loss_sum, atol=1e-5)
    assert torch.equal(plain.count, pad.count) and torch.equal(plain.correct, pad.correct)
    assert pad_batch(batch, 7) is batch  # 21 tokens: already a multiple


def loss_and_grads(model, scorer, batch, attention, compile=False):
    """One TTT forward + backward: the stats and every parameter's gradient."""
    from eagle3build.ttt.forward import ttt_forward

    model.zero_grad()
    stats = ttt_forward(model, batch, scorer.draft_probs(batch.loss_final), 3, attention, compile=compile)
    stats.loss_sum.sum().backward()
    return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_counts_and_grads(got, expected, relative: bool = False):
    """relative: losses and gradients equal to fp32 rounding of their size (sums in another order)."""
    (stats, grads), (stats_e, grads_e) = got, expected
    assert torch.allclose(stats.loss_sum, stats_e.loss_sum, **({"rtol": 1e-5} if relative else {"atol": 1e-5}))
    assert torch.equal(stats.count, stats_e.count) and torch.equal(stats.correct, stats_e.correct)
    assert grads.keys() == grads_e.keys()
    for name, grad in grads.items():
        atol = 1e-5 * grads_e[name].abs().max() if relative else 1e-5
        assert torch.allclose(grad, grads_e[name], atol=float(atol)), name


def test_loss_rows_give_every_loss_count_and_gradient_of_all_rows():
    """The lm_head, loss and target distribution computed at the loss rows only (padded to a bucket)
    equal computing them at every row: rows outside carry no weight at any step."""
    from dataclasses import replace

    from test_model_ttt import random_samples, tiny_draft

    from eagle3build.attention.merged import MathMergedAttention
    from eagle3build.ttt.batch import pack, pad_batch, with_loss_rows
    from eagle3build.ttt.forward import ttt_forward

    model, _, scorer = tiny_draft()
    samples = random_samples([9, 6, 11], seed=5)
    for _ids, mask, _ in samples:  # a chat sample: its prompt carries no loss
        mask[:3] = False
    batch = pad_batch(pack(samples), 16)
    batch.greedy_in_draft = scorer.greedy_in_draft(batch.final)

    every = loss_and_grads(model, scorer, batch, MathMergedAttention())
    for multiple in (1, 8):
        with_rows = with_loss_rows(batch, 3, multiple)
        rows = with_rows.loss_rows
        assert len(rows) % multiple == 0 and len(rows) < batch.num_tokens  # prompts and padding are skipped
        assert int((rows < batch.num_tokens).sum()) == int(
            (batch.loss_mask[1:] & (batch.doc[1:] == batch.doc[:-1])).sum()
        )
        assert_same_loss_counts_and_grads(loss_and_grads(model, scorer, with_rows, MathMergedAttention()), every)
    prompts_only = with_loss_rows(replace(batch, loss_mask=torch.zeros_like(batch.loss_mask)), 3, 8)
    assert len(prompts_only.loss_rows) == 8  # padding only: compiled kernels never see 0 rows
    stats = ttt_forward(model, prompts_only, scorer.draft_probs(prompts_only.loss_final), 3, MathMergedAttention())
    assert float(stats.count.sum()) == 0 and float(stats.loss_sum.detach().abs().sum()) == 0
    with pytest.raises(ValueError, match="loss_final"):
        ttt_forward(model, with_loss_rows(batch, 3, 8), scorer.draft_probs(batch.final), 3, MathMergedAttention())


@pytest.mark.parametrize("attention", ["merged", "flash", "sdpa", "reference"])
def test_step_rows_give_every_loss_count_and_gradient_of_all_rows(attention):
    """The steps computed at the rows with a loss only (padded with spare rows to a multiple), past step
    0's keys and values, equal computing every row at every step: a prompt's rows feed nothing else."""
    from dataclasses import replace

    from test_model_ttt import random_samples, tiny_draft

    from eagle3build.attention.factory import make_attention
    from eagle3build.attention.merged import MathMergedAttention
    from eagle3build.ttt.batch import pack, pad_batch, with_greedy_in_draft, with_loss_rows, with_step_rows

    attend = MathMergedAttention() if attention == "merged" else make_attention(attention)
    model, _, scorer = tiny_draft()
    samples = random_samples([14, 6, 16], seed=6)
    for _ids, mask, _ in samples:  # a chat sample: a prompt, an answer, a second prompt and answer
        mask[:7] = False
        mask[-4:-2] = False
    padded = pad_batch(pack(samples), 8)
    batch = with_loss_rows(padded, 3, 4)

    def run(b):
        return loss_and_grads(model, scorer, b, attend)

    every = run(batch)
    for multiple in (1, 4):
        compact = with_step_rows(batch, multiple)
        rows = compact.step_rows
        assert rows is not None and len(rows) % multiple == 0 and len(rows) < batch.num_tokens
        assert torch.equal(rows, rows.unique())  # sorted, no row twice
        assert_same_loss_counts_and_grads(run(compact), every)
    assert with_step_rows(batch, batch.num_tokens).step_rows is None  # every row anyway: unchanged

    # the greedy flags folded in after the step rows were chosen (training's first epoch): still exact
    greedy = scorer.greedy_in_draft(batch.final)
    assert_same_loss_counts_and_grads(
        run(with_greedy_in_draft(with_step_rows(batch, 4), greedy)), run(with_greedy_in_draft(batch, greedy))
    )

    prompts_only = with_step_rows(with_loss_rows(replace(padded, loss_mask=torch.zeros_like(padded.loss_mask)), 3, 4), 4)
    assert len(prompts_only.step_rows) == 4  # spare rows only: compiled kernels never see 0 rows
    got, _ = run(prompts_only)
    assert float(got.count.sum()) == 0 and float(got.loss_sum.detach().abs().sum()) == 0


@pytest.mark.parametrize("attention", ["merged", "flash", "sdpa"])
@pytest.mark.parametrize("step_rows", [True, False])
def test_every_step_hands_the_layer_the_same_memory_layout(monkeypatch, attention, step_rows):
    """The compiled second half of the layer is guarded on its inputs' strides: step 0's attention output
    (the kernel's) and the later steps' (the diagonal merge's) must reach it laid out alike, or each batch
    length compiles it twice (a real run went past dynamo's recompile limit and ran the rest eagerly)."""
    from test_model_ttt import random_samples, tiny_draft

    from eagle3build.attention.factory import make_attention
    from eagle3build.attention.merged import MathMergedAttention
    from eagle3build.ttt import forward
    from eagle3build.ttt.batch import pack, pad_batch, with_loss_rows, with_step_rows

    seen = []
    layer_out = forward._layer_out

    def spy(model, fused, attn_rows, residual):
        seen.append((tuple(attn_rows.shape), attn_rows.stride(), tuple(residual.shape), residual.stride()))
        return layer_out(model, fused, attn_rows, residual)

    monkeypatch.setattr(forward, "_layer_out", spy)
    model, _, scorer = tiny_draft()
    samples = random_samples([14, 6, 16], seed=7)
    for _ids, mask, _ in samples:
        mask[:5] = False
    batch = with_loss_rows(pad_batch(pack(samples), 16), 3, 4)
    if step_rows:
        batch = with_step_rows(batch, 4)
        assert batch.step_rows is not None
    attend = MathMergedAttention() if attention == "merged" else make_attention(attention)
    forward.ttt_forward(model, batch, scorer.draft_probs(batch.loss_final), 3, attend)
    assert len(seen) == 3 and len(set(seen)) == 1, seen


@pytest.mark.slow
def test_compiled_step_gives_the_eager_losses_counts_and_gradients(monkeypatch):
    """What the GPU runs: the fused weights, layer halves, LSE merge and loss compiled by Inductor (here its
    CPU backend), with loss rows and step rows. Same losses, counts and gradients as the eager step."""
    from test_model_ttt import random_samples, tiny_draft

    from eagle3build import compilation
    from eagle3build.attention.kernel import KernelAttention
    from eagle3build.attention.merged import MathMergedAttention
    from eagle3build.ttt.batch import pack, pad_batch, with_loss_rows, with_step_rows

    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "0")  # tuning GPU kernels only
    monkeypatch.setattr(compilation, "COMPILED", {})  # compiled here, whatever ran before
    torch._dynamo.reset()  # and counted here: dynamo keeps the compilations of earlier tests per function
    model, _, scorer = tiny_draft()

    def batch(prompt: int):
        samples = random_samples([14, 6, 16], seed=7)
        for _ids, mask, _ in samples:
            mask[:prompt] = False
        return with_step_rows(with_loss_rows(pad_batch(pack(samples), 8), 3, 4), 4)

    # As in training, batches with other loss-row and step-row counts follow (recompiled, dynamic in the
    # loss rows), then the first layout again: every one gives the eager step's losses and gradients.
    layouts = [batch(5), batch(9), batch(0), batch(5)]
    assert layouts[0].step_rows is not None and len({len(b.step_rows) for b in layouts[:3]}) == 3
    assert len({len(b.loss_rows) for b in layouts[:3]}) == 3
    merged = MathMergedAttention(compile=True)
    kernel = KernelAttention("flash", compile=True)  # the kernel's merge and its backward
    compiled_scorer = copy.copy(scorer)
    compiled_scorer.compile = True  # the target distribution too, dynamic in its rows
    for b in layouts:
        torch.testing.assert_close(compiled_scorer.draft_probs(b.loss_final), scorer.draft_probs(b.loss_final))
        eager = loss_and_grads(model, scorer, b, MathMergedAttention())
        for attention in (merged, kernel):
            compiled = loss_and_grads(model, compiled_scorer, b, attention, compile=True)
            assert_same_loss_counts_and_grads(compiled, eager, relative=True)
    # the target distribution, 4 step pieces, the per-step weights' gradient sum, flex's merge, the kernel
    # merge and its backward
    kernels = list(compilation.COMPILED.values())
    assert len(kernels) == 9 and all(hasattr(k, "_torchdynamo_orig_callable") for k in kernels)
    # the layer's second half: one compilation per step-row count, whichever attention (and its compiled
    # merge, whose output strides Inductor chooses) produced its input, at whichever step
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from eagle3build.ttt import forward

    assert len(_debug_get_cache_entry_list(forward._layer_out.__code__)) == 3


@pytest.mark.parametrize("path", ["merge", "merge_compiled", "kernel", "kernel_compiled"])
def test_backward_keeps_the_diagonal_keys_themselves_not_a_stacked_copy(path, monkeypatch):
    """Step s's merge reads the diagonal keys/values of steps 1..s; keeping a stack of them for backward
    cost k(k - 1)/2 copies of one step's keys and values over k steps (4.6 GiB at T = 8192 for an MHA draft
    of Kimi's width). Backward keeps the steps' own tensors, which the later steps' merges read anyway,
    and nothing else of their size: the flex path's merge (eager and compiled) and the kernel path's."""
    from eagle3build import compilation
    from eagle3build.attention.kernel import KernelAttention

    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "0")
    monkeypatch.setattr(compilation, "COMPILED", {})
    g = torch.Generator().manual_seed(5)
    nh, nkv, hd, s = 4, 4, 16, 4
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor([40, 24]))
    n = len(doc)

    def rand(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    q = rand(1, nh, n, hd)
    keys, values = [rand(1, nkv, n, hd) for _ in range(s + 1)], [rand(1, nkv, n, hd) for _ in range(s + 1)]
    compile = path.endswith("compiled")
    inputs = {t.untyped_storage().data_ptr() for t in [q, *keys, *values]}
    kept = []

    def pack(t):
        kept.append((t.numel(), t.untyped_storage().data_ptr() in inputs))
        return t

    if path.startswith("merge"):  # the merge alone: the causal part is the flex kernel's on a GPU
        from eagle3build.attention.merge import merge_diagonal

        out, lse = causal_with_lse(q, keys[0], values[0], doc, hd**-0.5)
        out, lse = out.detach().requires_grad_(), lse.detach().requires_grad_()
        inputs |= {out.untyped_storage().data_ptr(), lse.untyped_storage().data_ptr()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            merged = merge_diagonal(q, out, lse, keys[1:], values[1:], hd**-0.5, compile)
        leaves = [q, out, lse, *keys[1:], *values[1:]]
    else:
        attention = KernelAttention("flash", compile)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            merged = attention(q, keys, values, doc, s, hd**-0.5)
        leaves = [q, *keys, *values]
    one_step = keys[0].numel()
    new = [numel for numel, shared in kept if not shared and numel >= one_step]
    if path != "merge":  # eager checkpointing keeps its inputs by reference, out of the hooks' sight
        assert sum(shared for _, shared in kept) >= 2 * s, kept
    # the kernel path keeps its own output and the zero-padded queries it ran at (q's size each), no stack
    assert sum(new) <= (2 * nh * n * hd if path.startswith("kernel") else 0), kept
    probe = torch.randn(merged.shape, generator=g)
    grads = torch.autograd.grad((merged * probe).sum(), leaves)
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)


def test_the_merge_never_holds_several_steps_keys_in_one_tensor():
    """A stack of the diagonals of steps 1..s lived, with its gradient, while step s's backward ran: 7.9 GiB
    and as much again at 49,152 tokens for the MHA draft Kimi's config derives. The merge
    reads the steps one by one: no tensor that its forward or backward makes (the flex path's, with
    autograd, and the kernel path's explicit backward) is bigger than one step's keys (MHA: a query's
    heads are its key's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from eagle3build.attention.merge import merge_backward, merge_diagonal, merge_forward

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    g = torch.Generator().manual_seed(6)
    nh, hd, s = 4, 16, 5
    doc = torch.zeros(48, dtype=torch.long)
    n = len(doc)
    q, *diag = (torch.randn(1, nh, n, hd, generator=g).requires_grad_() for _ in range(1 + 2 * (s + 1)))
    keys, values = diag[: s + 1], diag[s + 1 :]
    out, lse = causal_with_lse(q, keys[0], values[0], doc, hd**-0.5)
    out, lse = out.detach().requires_grad_(), lse.detach().requires_grad_()
    one_step = keys[0].numel()
    with Largest() as flex:
        merged = merge_diagonal(q, out, lse, keys[1:], values[1:], hd**-0.5)
        merged.backward(torch.randn(merged.shape, generator=g))
    with Largest() as kernel:
        merged, merged_lse = merge_forward(q, out, lse, keys[1:], values[1:], hd**-0.5)
        dq, dks, dvs = merge_backward(torch.randn(merged.shape, generator=g), q, merged, merged_lse, keys[1:],
                                      values[1:], hd**-0.5)
    assert flex.numel <= one_step and kernel.numel <= one_step, (flex.numel, kernel.numel, one_step)
    assert len(dks) == len(dvs) == s and dks[0].shape == keys[1].shape
