"""The fused-kernel TTT attention: its startup check passes on a working kernel and stops on a changed one."""

from __future__ import annotations

import pytest
import torch

from eagle3build.attention.kernel import FlashKernel, check_kernel, segments
from eagle3build.errors import ConfigError

torch.set_num_threads(2)


def sample_mask(cu: torch.Tensor, dtype) -> torch.Tensor:
    """The CPU kernel's additive mask for the samples a varlen op's cumulative lengths describe."""
    return segments(torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long()), dtype).bias


def test_segments_are_the_packed_samples():
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    seg = segments(doc, torch.float32)
    assert seg.n == 9 and seg.cu.tolist() == [0, 3, 5, 9] and seg.cu.dtype == torch.int32 and seg.max_len == 4
    visible = seg.bias == 0  # the CPU kernel's mask: causal inside a sample only
    assert visible[4].tolist() == [False, False, False, True, True, False, False, False, False]


def test_check_kernel_passes_on_cpu_flash():
    errors = check_kernel("flash", "cpu")
    names = {"out", "dq", "dk0", "dk1", "dk2", "dv0", "dv1", "dv2"}
    assert set(errors) == {f"{case}.{name}" for case in ("every", "rows") for name in names}
    assert max(errors.values()) < 1e-5


def test_check_kernel_stops_a_kernel_whose_lse_convention_changed(monkeypatch):
    """A torch whose kernel backward read the log-sum-exp differently (say base 2) gives wrong
    gradients silently; the check names the kernel and the config key to change."""
    backward = FlashKernel.backward

    def base2_backward(self, dout, q, k, v, out, lse, seg, scale):
        return backward(self, dout, q, k, v, out, lse * 1.4426950408889634, seg, scale)

    monkeypatch.setattr(FlashKernel, "backward", base2_backward)
    with pytest.raises(RuntimeError, match=r"'flash' disagrees .*Set train.attention: flex"):
        check_kernel("flash", "cpu")


def test_train_reports_a_kernel_that_fails_its_check(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    from eagle3build.train import loop as train_module

    def broken(name, device):
        raise RuntimeError(f"attention kernel {name!r} does not run")

    monkeypatch.setattr(train_module, "check_kernel", broken)
    missing = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="train.attention.*does not run"):
        train_module.train(
            [missing], missing, missing, str(tmp_path / "out"), str(tmp_path / "state"), {"attention": "flash"}
        )


def test_flash_varlen_adapter_with_a_cpu_stand_in(monkeypatch):
    """The varlen FlashAttention-2 path's plumbing (token-major views, native GQA, lse [nh, N] there and
    back), run through check_kernel with a CPU stand-in for aten::_flash_attention_forward/_backward."""
    cpu = torch.ops.aten

    def batched(t, heads):  # [N, h, d] -> [1, heads, N, d], kv heads repeated as FA2 does inside
        t = t.transpose(0, 1).unsqueeze(0)
        return t.repeat_interleave(heads // t.shape[1], dim=1).contiguous()

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
        assert causal and max_q == max_k == 120 and cu_q.dtype == torch.int32
        heads = q.shape[1]
        out, lse = cpu._scaled_dot_product_flash_attention_for_cpu(
            batched(q, heads), batched(k, heads), batched(v, heads), 0.0, False, attn_mask=sample_mask(cu_q, q.dtype), scale=scale
        )
        return out[0].transpose(0, 1), lse[0], torch.zeros(2), torch.empty(0), None

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, *, scale):
        heads, kv_heads = q.shape[1], k.shape[1]
        assert lse.shape == (heads, len(q)) and lse.is_contiguous() and rng.shape == (2,) and unused.numel() == 0
        dq, dk, dv = cpu._scaled_dot_product_flash_attention_for_cpu_backward(
            *(batched(t, heads) for t in (dout, q, k, v, out)), lse.unsqueeze(0), 0.0, False,
            attn_mask=sample_mask(cu_q, q.dtype), scale=scale,
        )  # fmt: skip
        dk, dv = (g.view(1, kv_heads, heads // kv_heads, *g.shape[2:]).sum(2) for g in (dk, dv))
        return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward)
    assert max(check_kernel(FlashKernel(varlen=True), "cpu").values()) < 1e-5
