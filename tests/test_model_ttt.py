"""The draft head and training-time test: the three attention paths agree with a loop-by-loop TTT."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3build.attention.factory import make_attention
from eagle3build.attention.merged import MathMergedAttention
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.draft.target import TargetHead
from eagle3build.ttt.batch import pack, with_greedy_in_draft, with_loss_rows, with_step_rows
from eagle3build.ttt.forward import gather_rows, ttt_forward
from eagle3build.ttt.loss import step_loss_weights, weighted_loss
from eagle3build.ttt.scorer import TargetScorer

torch.set_num_threads(2)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

V, K, HT = 40, 24, 16


def tiny_target(seed=0, vocab=V, hidden=HT) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, hidden, generator=g)
    return TargetHead(
        embed_tokens=embed,
        norm=1 + 0.1 * torch.randn(hidden, generator=g),
        lm_head=embed,
        hidden_size=hidden,
        vocab_size=vocab,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=24,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def tiny_mapping(vocab=V, k=K, seed=0):
    kept = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:k].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(k), t2d


def tiny_draft(seed=0) -> tuple[Eagle3Draft, TargetHead, TargetScorer]:
    target = tiny_target(seed)
    d2t, t2d = tiny_mapping(seed=seed)
    torch.manual_seed(seed)
    model = Eagle3Draft.from_target(DraftConfig.from_target(target, K), target, d2t, t2d)
    with torch.no_grad():  # non-trivial norms so that a swapped norm shows in the comparison
        for module in model.modules():
            if hasattr(module, "eps"):
                module.weight.add_(0.2 * torch.randn_like(module.weight))
    return model, target, TargetScorer(target, d2t, t2d)


def random_samples(lengths, seed=0, hidden=HT):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, V, (n,), generator=g)
        mask = torch.rand(n, generator=g) < 0.8
        out.append((ids, mask, torch.randn(n, 4, hidden, generator=g)))
    return out


# ------------------------------------------------------------------ a loop-by-loop TTT, written from the facts
def naive_ttt(model: Eagle3Draft, samples, scorer: TargetScorer, steps: int, step_weight: float):
    c = model.config
    layer = model.midlayer
    groups = c.num_attention_heads // c.num_key_value_heads
    inv_freq = [c.rope_theta ** (-2 * i / c.head_dim) for i in range(c.head_dim // 2)]

    def rope(x, pos):  # x [heads, hd]: rotate pairs (i, i + hd/2) by pos * freq_i
        half = c.head_dim // 2
        out = x.clone()
        for i in range(half):
            cos, sin = math.cos(pos * inv_freq[i]), math.sin(pos * inv_freq[i])
            out[:, i] = x[:, i] * cos - x[:, i + half] * sin
            out[:, i + half] = x[:, i + half] * cos + x[:, i] * sin
        return out

    loss_sums, counts = [0.0] * steps, [0] * steps
    for ids, mask, hidden in samples:
        n = len(ids)
        probs = scorer.draft_probs(hidden[:, 3])
        full_logits = (
            torch.nn.functional.rms_norm(hidden[:, 3], (HT,), eps=1e-5) * scorer.norm @ scorer.lm_head.T
        )
        greedy_kept = scorer.t2d[full_logits.argmax(-1)]
        keys = [dict() for _ in range(steps)]
        values = [dict() for _ in range(steps)]
        prev_out = {}
        for s in range(steps):
            out = {}
            for t in range(n - 1 - s):
                h_in = model.fc(hidden[t, :3].reshape(-1)) if s == 0 else prev_out[t]
                e = layer.input_layernorm(model.embed_tokens.weight[ids[t + 1 + s]])
                x = torch.cat([e, layer.hidden_norm(h_in)])
                att = layer.self_attn
                q = rope((att.q_proj.weight @ x).view(c.num_attention_heads, c.head_dim), t + s)
                keys[s][t] = rope((att.k_proj.weight @ x).view(c.num_key_value_heads, c.head_dim), t + s)
                values[s][t] = (att.v_proj.weight @ x).view(c.num_key_value_heads, c.head_dim)
                visible = [(0, u) for u in range(t + 1)] + [(i, t) for i in range(1, s + 1)]
                heads = []
                for hq in range(c.num_attention_heads):
                    hk = hq // groups
                    scores = torch.stack([q[hq] @ keys[i][u][hk] for i, u in visible]) / math.sqrt(c.head_dim)
                    weights = torch.softmax(scores, 0)
                    heads.append(
                        sum(w * values[i][u][hk] for w, (i, u) in zip(weights, visible, strict=True))
                    )
                h = h_in + att.o_proj.weight @ torch.cat(heads)
                post = layer.post_attention_layernorm(h)
                mlp = layer.mlp
                h = h + mlp.down_proj.weight @ (
                    torch.nn.functional.silu(mlp.gate_proj.weight @ post) * (mlp.up_proj.weight @ post)
                )
                out[t] = h
                j = t + 1 + s
                if j + 1 < n and mask[j + 1] and greedy_kept[j]:
                    logp = torch.log_softmax(model.lm_head.weight @ model.norm(h), 0)
                    loss_sums[s] = loss_sums[s] - (probs[j] * logp).sum()
                    counts[s] += 1
            prev_out = out
    return sum(step_weight**s * loss_sums[s] / max(counts[s], 1) for s in range(steps))


def batched_loss(model, samples, scorer, steps, impl, step_weight):
    batch = pack(samples)
    batch.greedy_in_draft = scorer.greedy_in_draft(batch.final)
    # "merged-math": flex's LSE-merge algorithm with a dense causal part, so it runs backward on CPU
    attention = MathMergedAttention() if impl == "merged-math" else make_attention(impl)
    stats = ttt_forward(model, batch, scorer.draft_probs(batch.final), steps, attention)
    return weighted_loss(stats, stats.count, step_loss_weights(steps, step_weight))


def grads_of(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_ttt_attention_paths_agree_with_naive_loops(steps):
    torch.manual_seed(0)
    model, _, scorer = tiny_draft()
    samples = random_samples([7, 5, 9], seed=steps)
    naive = naive_ttt(model, samples, scorer, steps, 0.8)
    naive_grads = grads_of(model, naive)
    assert naive.item() > 0
    for impl in ("reference", "sdpa", "merged-math", "flash", "flex"):
        if impl == "flex" and not torch.cuda.is_available():
            with torch.no_grad():  # torch has no flex backward on CPU; its mask is checked separately
                loss = batched_loss(model, samples, scorer, steps, impl, 0.8)
            assert loss.item() == pytest.approx(naive.item(), abs=1e-5, rel=1e-5), impl
            continue
        loss = batched_loss(model, samples, scorer, steps, impl, 0.8)
        assert loss.item() == pytest.approx(naive.item(), abs=1e-5, rel=1e-5), impl
        grads = grads_of(model, loss)
        assert set(grads) == set(naive_grads)
        for name, g in grads.items():
            assert torch.allclose(g, naive_grads[name], atol=1e-5, rtol=1e-4), (
                impl,
                name,
                (g - naive_grads[name]).abs().max(),
            )
        assert model.embed_tokens.weight.grad is None  # frozen


def test_packing_never_attends_across_samples():
    model, _, scorer = tiny_draft()
    samples = random_samples([6, 8], seed=3)
    batch = pack(samples)
    batch.greedy_in_draft = scorer.greedy_in_draft(batch.final)
    packed = ttt_forward(model, batch, scorer.draft_probs(batch.final), 3, make_attention("reference"))
    separate = []
    for sample in samples:
        b = pack([sample])
        b.greedy_in_draft = scorer.greedy_in_draft(b.final)
        separate.append(ttt_forward(model, b, scorer.draft_probs(b.final), 3, make_attention("reference")))
    assert torch.allclose(packed.loss_sum, sum(s.loss_sum for s in separate), atol=1e-5)
    assert torch.equal(packed.count, sum(s.count for s in separate))


def test_flex_block_mask_is_the_causal_per_sample_mask():
    """Flex attends over the step-0 keys only (the diagonals are merged by LSE): causal, per sample."""
    from torch.nn.attention.flex_attention import create_mask

    from eagle3build.attention.dense import step_mask
    from eagle3build.attention.flex import FlexAttention

    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 1, 7]))
    n = len(doc)
    mask = create_mask(FlexAttention.mask_mod(doc), None, None, n, n, device="cpu")
    assert torch.equal(mask[0, 0], step_mask(doc, 0))
    assert int(mask[0, 0, 7].sum()) == 2  # doc 2 position 1: two causal keys


def test_loss_layout_alignment():
    """Step s predicts row j's target from its output row p = j - 1 - s of the same sample; row j carries
    a loss when x[j + 1] is an assistant token and the target's greedy token at j is in the draft vocab."""
    ids = torch.arange(10)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    hidden = torch.zeros(10, 4, HT)
    batch = pack([(ids[:5], mask[:5], hidden[:5]), (ids[5:], mask[5:], hidden[5:])])

    def sources(b):  # per step, the output rows p that carry a loss
        return [src[w].tolist() for src, w in zip(b.loss_source, b.loss_weight, strict=True)]

    laid = with_loss_rows(batch, 3, multiple=4)
    # sample A (0..4, mask 0 0 1 1 1) predicts x[2..4] from j = 1, 2, 3; sample B the same at 6, 7, 8
    assert laid.loss_rows.tolist() == [1, 2, 3, 6, 7, 8, 10, 10]  # padded with N = 10 to a multiple of 4
    assert sources(laid) == [[0, 1, 2, 5, 6, 7], [0, 1, 5, 6], [0, 5]]  # p >= 0 and inside j's sample
    greedy = torch.ones(10, dtype=torch.bool)
    greedy[3] = False  # the target's greedy token at j = 3 is outside the draft vocab
    expected = [[0, 1, 5, 6, 7], [0, 5, 6], [5]]
    batch.greedy_in_draft = greedy
    assert sources(with_loss_rows(batch, 3, multiple=4)) == expected
    # known only after the batch was laid out (a first epoch computes it on the GPU): folded in later
    assert sources(with_greedy_in_draft(laid, greedy)) == expected
    moved = with_loss_rows(batch, 3).to("cpu", torch.float16)
    assert moved.aux.dtype == torch.float16 and moved.loss_weight.dtype == torch.bool
    assert moved.loss_source.dtype == torch.int64


def test_loss_rows_gather_writes_each_gradient_once_and_matches_index_select():
    """The loss rows' gather (gather_rows) copies each row's gradient into place instead of adding it: exact
    because within a step the output rows with a loss are distinct and every other entry goes to a scratch
    row, also where step rows and clamping make two entries read one row."""
    ids = torch.arange(40)
    mask = (torch.arange(40) % 7 >= 2) & (torch.arange(40) % 13 != 4)
    lengths = [6, 1, 9, 14, 10]  # a one-token sample, and several boundaries
    parts, start = [], 0
    for n in lengths:
        parts.append((ids[start : start + n], mask[start : start + n], torch.zeros(n, 4, HT)))
        start += n
    laid = with_step_rows(with_loss_rows(pack(parts), 7, multiple=8), multiple=4)
    assert laid.step_rows is not None  # the case where sources are indexed among the step rows
    r = len(laid.step_rows)
    duplicate_read = False
    for src, scatter, w in zip(laid.loss_source, laid.loss_scatter, laid.loss_weight, strict=True):
        assert torch.equal(scatter[w], src[w]) and (scatter[~w] == r).all()
        assert len(set(src[w].tolist())) == int(w.sum())  # distinct, so a copy is exact
        duplicate_read |= len(set(src.tolist())) < len(src)
    assert duplicate_read  # without the scratch row a zero gradient could land on a real one
    g = torch.Generator().manual_seed(0)
    x = torch.randn(r, 5, generator=g, requires_grad=True)
    lost = False
    for src, scatter, w in zip(laid.loss_source, laid.loss_scatter, laid.loss_weight, strict=True):
        upstream = torch.randn(len(src), 5, generator=g) * w[:, None]  # weight-0 rows: exactly 0
        (ours,) = torch.autograd.grad(gather_rows(x, src, scatter), x, upstream)
        (reference,) = torch.autograd.grad(x.index_select(0, src), x, upstream)
        assert torch.equal(ours, reference)
        # without the scratch row: entries sent to the rows they read, the weight-0 ones last (CPU's
        # index_copy writes in order), so a zero gradient overwrites a real one where two entries share a row
        last = torch.argsort((~w).int(), stable=True)
        (copied,) = torch.autograd.grad(gather_rows(x, src[last], src[last]), x, upstream[last])
        lost |= not torch.equal(copied, reference)
    assert lost  # the scratch row is what makes the copy exact


class _StridedAdds(TorchDispatchMode):
    """Records additions of two same-shaped tensors laid out differently (a pass across strides)."""

    def __enter__(self):
        self.seen = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor):
            a, b = args[:2]
            if isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() != b.stride():
                self.seen.append((tuple(a.shape), a.stride(), b.stride()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compile", [False, True])
def test_diagonal_merge_gives_gradients_in_the_token_major_layout_of_its_inputs(compile):
    """q, keys and values are token-major in memory, as are the causal kernel's gradients. The merge's
    gradients for them must be too: autograd adds q's two gradients (and the keys' across steps), and an
    addition of a head-major and a token-major tensor reads one across strides (a third of the memory's
    bandwidth). Compiled, also once the rows turn dynamic (a second batch length), where Inductor chooses
    layouts anew. (The causal output's gradient only feeds the kernel's backward, which reads any strides.)"""
    from eagle3build.attention.merge import merge_diagonal

    g = torch.Generator().manual_seed(0)
    nh, nkv, hd = 6, 2, 8

    def token_major(heads, rows):  # [1, heads, rows, hd] over [1, rows, heads, hd] memory, as the projections write it
        return torch.randn(1, rows, heads, hd, generator=g).transpose(1, 2).requires_grad_()

    for n in (24, 40):  # the second length compiles with dynamic rows
        q, causal_out = token_major(nh, n), token_major(nh, n)
        lse = torch.randn(1, nh, n, generator=g, requires_grad=True)
        keys, values = [token_major(nkv, n) for _ in range(3)], [token_major(nkv, n) for _ in range(3)]
        out = merge_diagonal(q, causal_out, lse, keys, values, 0.3, compile)
        grads = torch.autograd.grad(out.float().square().sum(), [q, *keys, *values])
        for x, grad in zip([q, *keys, *values], grads, strict=True):
            assert grad.stride() == x.stride(), (n, grad.stride(), x.stride())
        # and the merge is the softmax over [causal keys] + [diagonals]: against the head-major reference
        reference = merge_diagonal(*(t.detach().contiguous() for t in (q, causal_out, lse)),
                                   [k.detach().contiguous() for k in keys], [v.detach().contiguous() for v in values],
                                   0.3)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)

    # queries at some rows only (with_step_rows): q's gradient through the copy into the kernel's full-length
    # queries is token-major too, and the outputs are the full-length attention's at those rows
    n, rows = 24, torch.tensor([1, 4, 5, 9, 17, 23])
    doc = torch.zeros(n, dtype=torch.long)
    attention = MathMergedAttention(compile)
    keys, values = [token_major(nkv, n)], [token_major(nkv, n)]  # step 0's, at every row
    q_rows = token_major(nh, len(rows))
    diagonals = [token_major(nkv, len(rows)) for _ in range(4)]
    at_rows = attention(q_rows, [keys[0], *diagonals[:2]],
                        [values[0], *diagonals[2:]], doc, 2, 0.3, rows)
    with _StridedAdds() as strided:
        torch.autograd.grad(at_rows.float().square().sum(), q_rows)
    assert not strided.seen  # q's two gradients (the copy's, the merge's) are laid out alike
    full = torch.zeros(1, nh, n, hd)
    full[:, :, rows] = q_rows.detach()
    diagonal_full = [torch.zeros(1, nkv, n, hd).index_copy(2, rows, d.detach()) for d in diagonals]
    everywhere = attention(full, [keys[0].detach(), *diagonal_full[:2]], [values[0].detach(), *diagonal_full[2:]],
                           doc, 2, 0.3)
    torch.testing.assert_close(at_rows, everywhere[:, :, rows], atol=1e-5, rtol=1e-5)


def test_inference_layer_with_cache_matches_full_pass_and_ttt_step0():
    model, _, scorer = tiny_draft()
    g = torch.Generator().manual_seed(1)
    T = 9
    ids = torch.randint(0, V, (2, T), generator=g)
    hidden = torch.randn(2, T, model.config.hidden_size, generator=g)
    pos = torch.arange(T).expand(2, T)
    full, (k_full, _) = model.layer(ids, hidden, pos, None)
    assert k_full.shape == (2, model.config.num_key_value_heads, T, model.config.head_dim)
    part, cache = model.layer(ids[:, :4], hidden[:, :4], pos[:, :4], None)
    rest, cache = model.layer(ids[:, 4:], hidden[:, 4:], pos[:, 4:], cache)
    assert torch.allclose(torch.cat([part, rest], 1), full, atol=1e-5)
    # cropping the cache (rejected tokens) and re-running gives the same outputs
    cropped = (cache[0][:, :, :6], cache[1][:, :, :6])
    again, _ = model.layer(ids[:, 6:], hidden[:, 6:], pos[:, 6:], cropped)
    assert torch.allclose(again, full[:, 6:], atol=1e-5)
    # TTT step 0 is the same causal layer (input token shifted by one)
    aux = torch.randn(T, 3 * HT, generator=g)
    x = torch.randint(0, V, (T,), generator=g)
    batch = pack(
        [(x, torch.ones(T, dtype=torch.bool), torch.cat([aux.view(T, 3, HT), torch.randn(T, 1, HT)], 1))]
    )
    stats = ttt_forward(model, batch, scorer.draft_probs(batch.final), 1, make_attention("reference"))
    out, _ = model.layer(
        x[1:].unsqueeze(0), model.project_aux(aux[:-1]).unsqueeze(0), torch.arange(T - 1).unsqueeze(0)
    )
    logp = torch.log_softmax(model.logits(out[0]), -1)
    # rows j = 1 .. T - 2 predict x[2 .. T - 1] (no greedy flags on this batch: every such row counts)
    expected = -(scorer.draft_probs(batch.final)[1:-1] * logp[:-1]).sum()
    assert stats.loss_sum[0].item() == pytest.approx(expected.item(), rel=1e-5)


def test_lm_head_initialised_from_target_rows_and_d2t_maps():
    model, target, _ = tiny_draft()
    kept = model.draft_ids()
    assert torch.equal(model.lm_head.weight, target.lm_head[kept])
    assert torch.equal(model.draft_to_target(torch.arange(K)), kept)
    assert bool(model.t2d[kept].all()) and int(model.t2d.sum()) == K


def test_compiled_tuning_follows_the_environment(monkeypatch):
    """Coordinate-descent tuning is off unless TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 (the documented switch):
    its minutes of compilation per batch length kept a workflow run's first training step waiting."""
    import torch._inductor.config as inductor_config

    from eagle3build.compilation import compiled

    monkeypatch.setattr(inductor_config, "coordinate_descent_tuning", inductor_config.coordinate_descent_tuning)
    monkeypatch.delenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", raising=False)
    compiled(torch.neg)
    assert inductor_config.coordinate_descent_tuning is False
    monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "1")
    compiled(torch.neg)
    assert inductor_config.coordinate_descent_tuning is True


def test_a_batch_copied_to_the_host_is_complete_before_it_is_read(monkeypatch):
    """Copies to a GPU run asynchronously (the host loads the next batch meanwhile); copies to the host
    must not: the host lays out loss rows from them next, and an asynchronous device-to-host copy can still
    be in flight (on an H100 a batch built on the GPU then read zeros for most of its loss mask)."""
    batch = pack([(torch.arange(6), torch.ones(6, dtype=torch.bool), torch.zeros(6, 4, HT))])
    seen = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        seen.append((str(kwargs.get("device")), kwargs.get("non_blocking")))
        return real_to(self, *args, **{**kwargs, "device": "cpu"})

    monkeypatch.setattr(torch.Tensor, "to", to)
    batch.to("cpu")
    assert seen and all(non_blocking is False for _, non_blocking in seen)
    seen.clear()
    batch.to("cuda:0")  # only recorded: the copy itself stays on the host here
    assert seen and all(device == "cuda:0" and non_blocking is True for device, non_blocking in seen)
