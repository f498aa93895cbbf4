"""The Blackwell host (sm_120, 99 KB shared memory per block, 96 GB, PCIe): flex attention's kernel options
by device, the GPU check script's dry mode, and the doctor's report of the GPUs and the TP memory plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3build import doctor
from eagle3build.attention import flex as flex_module
from eagle3build.attention import flex_options as fo
from eagle3build.doctor import devices

ROOT = Path(__file__).resolve().parents[1]
SM120 = ((12, 0), fo.SM120_SMEM_PER_BLOCK)
HEAD_DIMS = (64, 80, 96, 112, 128, 160, 192, 256)


def tiles(opts: dict) -> tuple[fo.Forward, fo.Backward]:
    fwd = fo.Forward(opts["fwd_BLOCK_M"], opts["fwd_BLOCK_N"], opts["fwd_num_stages"], opts["fwd_num_warps"])
    names = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps")
    return fwd, fo.Backward(*(opts[f"bwd_{n}"] for n in names))


# ------------------------------------------------------------------ the pure choice
@pytest.mark.parametrize(
    "capability, smem", [((9, 0), 232_448), ((9, 0), None), ((8, 0), 166_912), ((10, 0), 232_448)]
)
def test_hopper_and_large_smem_gpus_keep_torchs_own_choice(capability, smem):
    """No behaviour change on H100/H200 (and A100, B200): no kernel_options at all, as before."""
    for d in HEAD_DIMS:
        assert fo.flex_kernel_options(capability, smem, d) is None


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_sm120_options_fit_its_shared_memory_with_headroom(d):
    opts = fo.flex_kernel_options(*SM120, d)
    assert opts is not None and all(k.startswith(("fwd_", "bwd_")) for k in opts)
    # every name is one flex attention accepts (a rename in torch fails here, not on the Blackwell host)
    from torch.nn.attention.flex_attention import FlexKernelOptions

    accepted = set(FlexKernelOptions.__annotations__)
    assert {k[4:] for k in opts} <= accepted
    fwd, bwd = tiles(opts)
    budget = fo.SM120_SMEM_PER_BLOCK - fo.HEADROOM_BYTES
    assert fo.forward_smem_bytes(fwd, d, d) <= budget
    assert fo.backward_smem_bytes(bwd, d, d) <= budget
    # the kernels' static asserts and the block mask's 128-wide sparse blocks
    assert bwd.block_n1 % bwd.block_m1 == 0 and bwd.block_m2 % bwd.block_n2 == 0
    for block in (fwd.block_m, fwd.block_n, bwd.block_m1, bwd.block_n1, bwd.block_m2, bwd.block_n2):
        assert 128 % block == 0 and block >= 16


def test_estimates_bound_the_published_measurements():
    """The estimates are upper bounds of what Triton allocated in the measured cases (bf16)."""
    for kind, shape, qk, v, measured in fo.MEASURED:
        if kind == "forward":
            estimate = fo.forward_smem_bytes(fo.Forward(*shape, 4), qk, v)
        else:
            estimate = fo.backward_smem_bytes(fo.Backward(*shape, 4), qk, v)
        assert measured <= estimate <= 1.3 * measured, (kind, shape, estimate, measured)


def test_hopper_tiles_would_not_fit_sm120_which_is_why_it_gets_its_own():
    limit = fo.SM120_SMEM_PER_BLOCK
    assert (
        fo.backward_smem_bytes(fo.Backward(64, 128, 128, 64, 3, 8), 112, 112) > limit
    )  # torch's sm90 backward
    assert fo.forward_smem_bytes(fo.Forward(128, 64, 3, 4), 112, 112) > limit  # an older fallback forward
    # Kimi-K2.5's draft: head dim 7168 / 64 = 112, tiled as 128
    fwd, bwd = tiles(fo.flex_kernel_options(*SM120, 112))
    assert (fwd, bwd) == (fo.Forward(128, 64, 2, 8), fo.Backward(64, 64, 64, 64, 2, 4))


def test_where_torch_has_an_sm120_choice_ours_is_the_same(monkeypatch):
    """torch 2.13's CUDA heuristics (read here on CPU with the capability faked): its sm_120 forward table
    for head dims 64/128/256 and its sm12x backward below 128 are what we use; the differences (forward
    for dims not in its table, 112 among them; 1 backward stage at exactly 128) are documented in
    flex_options."""
    triton_heuristics = pytest.importorskip("torch._inductor.template_heuristics.triton")
    heuristic = triton_heuristics.CUDAConfigHeuristic()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (12, 0))
    try:
        torch_fwd = {d: heuristic.get_flex_attn_fwd_configs(d, torch.bfloat16)[-1] for d in (64, 128, 256)}
        torch_bwd = {d: heuristic.get_flex_attn_bwd_configs(d, torch.bfloat16)[-1] for d in (64, 112)}
    except (AttributeError, KeyError, TypeError) as e:
        pytest.skip(f"this torch has no sm_120 flex tables ({e})")
    for d, conf in torch_fwd.items():
        assert fo.SMALL_SMEM_FORWARD[d] == fo.Forward(
            conf.block_m, conf.block_n, conf.num_stages, conf.num_warps
        )
    for d, conf in torch_bwd.items():
        ours = tiles(fo.flex_kernel_options(*SM120, d))[1]
        assert ours == fo.Backward(
            conf.block_m1, conf.block_n1, conf.block_m2, conf.block_n2, conf.num_stages, conf.num_warps
        )


@pytest.mark.parametrize("capability, small", [((12, 0), True), ((12, 1), True), ((8, 6), True), ((8, 9), True),
                                               ((9, 0), False), ((8, 0), False)])  # fmt: skip
def test_without_the_smem_property_the_architecture_decides(capability, small):
    assert (fo.flex_kernel_options(capability, None, 112) is not None) is small


def test_smaller_devices_step_down_to_tiles_that_fit():
    for limit in (65_536, 48_000):
        fwd, bwd = tiles(fo.flex_kernel_options((8, 7), limit, 128))
        assert fo.forward_smem_bytes(fwd, 128, 128) <= limit - fo.HEADROOM_BYTES
        assert fo.backward_smem_bytes(bwd, 128, 128) <= limit - fo.HEADROOM_BYTES
    fwd, bwd = tiles(fo.flex_kernel_options((7, 5), 16_384, 256))  # nothing fits: the smallest tiles
    assert (fwd, bwd) == (fo.FORWARD_LADDER[-1], fo.BACKWARD_LADDER[-1])


def test_flex_attention_passes_the_devices_options_to_the_kernel(monkeypatch):
    """FlexAttention asks flex_options for the device of its inputs (once per shape) and hands the
    options to flex_attention; on CPU (and Hopper) it passes None, torch's default."""
    asked, seen = [], []
    attention = flex_module.FlexAttention(compile=False)
    heads, kv_heads, n, hd = 4, 2, 16, 112
    q, k, v = torch.randn(1, heads, n, hd), torch.randn(1, kv_heads, n, hd), torch.randn(1, kv_heads, n, hd)
    doc = torch.zeros(n, dtype=torch.long)
    real = attention.flex_attention

    def recording(*args, kernel_options=None, **kwargs):
        seen.append(kernel_options)
        return real(*args, kernel_options=kernel_options, **kwargs)

    attention.flex_attention = recording
    attention.causal(q, k, v, doc, hd**-0.5)  # CPU: torch's default
    assert seen == [None]

    def sm120(device, qk_dim, v_dim, itemsize):
        asked.append((qk_dim, v_dim, itemsize))
        return fo.flex_kernel_options(*SM120, qk_dim, v_dim, itemsize)

    monkeypatch.setattr(flex_module, "device_kernel_options", sm120)
    attention = flex_module.FlexAttention(compile=False)
    attention.flex_attention = lambda *a, kernel_options=None, **kw: (
        seen.append(kernel_options) or real(*a, **kw)
    )
    for _ in range(2):
        attention.causal(q, k, v, doc, hd**-0.5)
    assert (
        seen[1:] == [fo.flex_kernel_options(*SM120, 112, 112, 4)] * 2
    )  # fp32 here: smaller tiles than bf16's
    assert asked == [(112, 112, 4)]  # one lookup per shape


def test_device_options_read_the_cuda_properties(monkeypatch):
    monkeypatch.setattr(fo, "device_smem", lambda index: SM120)
    assert fo.device_kernel_options(torch.device("cuda", 0), 112, 112, 2) == fo.flex_kernel_options(
        *SM120, 112
    )
    assert fo.device_kernel_options(torch.device("cpu"), 112, 112, 2) is None
    monkeypatch.setattr(fo, "device_smem", lambda index: ((9, 0), 232_448))
    assert fo.device_kernel_options(torch.device("cuda", 0), 112, 112, 2) is None


def test_gpu_check_script_dry_mode_prints_the_options_it_would_test():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sm120_smem_check.py"), "--dry", "--head-dims", "112,256"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    plans = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [p["head_dim"] for p in plans] == [112, 256]
    for plan in plans:
        assert plan["options"] == fo.flex_kernel_options(*SM120, plan["head_dim"])
        assert max(plan["estimate_forward"], plan["estimate_backward"]) <= plan["limit"] == 101_376


# ------------------------------------------------------------------ the doctor
RTX_PRO_6000 = devices.Gpu("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 102_641_893_376, 101_376)
H100 = devices.Gpu("NVIDIA H100 80GB HBM3", (9, 0), 85_045_035_008, 232_448)
DEEPSEEK_V3 = {  # Kimi-K2.5's text model: MLA (latent 512 + rope 64), 61 layers
    "model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "vocab_size": 163840,
}  # fmt: skip


def kimi_context(tmp_path, weights: float, **vllm) -> doctor.Context:
    """A model folder with config.json and a safetensors index (no weights), under a Kimi-like config."""
    model = tmp_path / "kimi"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": int(weights)}})
    )
    vllm = {"tensor_parallel_size": 8, "gpu_memory_utilization": 0.9, "concurrency": 16, **vllm}
    ctx = doctor.Context({"output_root": str(tmp_path / "build"), "target": {"model": str(model)},
                          "prepare": {"max_length": 4096}, "extract": {"backend": "vllm", "vllm": vllm}})  # fmt: skip
    ctx.target_config = DEEPSEEK_V3
    return ctx


def test_doctor_reports_capability_memory_and_that_tp8_fits_on_the_blackwell_host(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "visible_gpus", lambda: [RTX_PRO_6000] * 8)
    check = devices.check_devices(kimi_context(tmp_path, 595e9), "extract")
    assert check.status == "ok", check
    assert (
        "8 x NVIDIA RTX PRO 6000 Blackwell Server Edition (sm_120, 102.6 GB, 99 KB shared memory"
        in check.detail
    )
    assert (
        "flex attention tiles for small shared memory (forward 128x64, 2 stages" in check.detail
    )  # head dim 112
    assert "TP 8: weights 595.0 GB = 74.4 GB per GPU" in check.detail and check.detail.count("fits") == 1
    # MLA latent (512 + 64) x 61 x 2 B + hidden-state cache 4 x 7168 x 2 B, whole on every GPU
    assert "127.6 kB per token per GPU (0.52 GB for one 4097-token sequence, 8.37 GB for 16 in flight)" in check.detail
    # the same plan in every stage that uses the GPUs; training only reports them
    assert devices.check_devices(kimi_context(tmp_path, 595e9), "train").status == "ok"
    assert "TP 8" not in devices.check_devices(kimi_context(tmp_path, 595e9), "train").detail
    assert any(name == "devices" for name, _, _ in doctor.CHECKS)  # part of `make doctor`


def test_doctor_fails_when_tp_does_not_fit_and_warns_when_requests_would_queue(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "visible_gpus", lambda: [RTX_PRO_6000] * 8)
    check = devices.check_devices(kimi_context(tmp_path, 595e9, tensor_parallel_size=4), "extract")
    assert check.status == "fail" and "does not fit" in check.detail and "tensor_parallel_size" in check.fix
    # 8 GB of room per GPU: a few full-length sequences fit, not 64 of them
    check = devices.check_devices(kimi_context(tmp_path, 595e9, concurrency=64), "extract")
    assert check.status == "warn" and "full-length sequences at once" in check.detail
    assert "extract.vllm.concurrency" in check.fix
    monkeypatch.setattr(devices, "visible_gpus", lambda: [H100] * 8)  # Hopper: torch's own flex tiles
    check = devices.check_devices(kimi_context(tmp_path, 595e9), "extract")
    assert check.status == "fail" and "sm_90" in check.detail and "flex attention tiles" not in check.detail


def test_doctor_without_gpus_states_what_each_gpu_will_need(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "visible_gpus", lambda: [])
    check = devices.check_devices(kimi_context(tmp_path, 595e9), "extract")
    assert check.status == "skip" and "74.4 GB per GPU" in check.detail and "no GPU visible" in check.detail
    assert devices.check_devices(kimi_context(tmp_path, 595e9), "train").status == "skip"


KIMI_TEXT = {**DEEPSEEK_V3, "num_key_value_heads": 64, "intermediate_size": 18432}  # as Kimi-K2.5's config.json


def test_doctor_plans_the_kimi_configs_training_step_on_the_blackwell_cards_before_anything_runs(tmp_path, monkeypatch):
    """The draft configs/kimi-k2.5.yaml trains (64 query / 64 KV heads x 112, the norm before fc) at its
    batch_tokens on 8 GPUs with DDP: within a 96 GB card and an 80 GB one; half as many tokens more do not fit
    the 80 GB card (the advice names the keys)."""
    import yaml

    train = yaml.safe_load((ROOT / "configs" / "kimi-k2.5.yaml").read_text())["train"]
    ctx = kimi_context(tmp_path, 595e9)
    ctx.config["train"], ctx.target_config = train, KIMI_TEXT
    monkeypatch.setattr(devices, "visible_gpus", lambda: [RTX_PRO_6000] * 8)
    check = devices.check_train_memory(ctx, "all")
    assert check.status == "ok", check
    assert "64 query / 64 KV heads x 112, intermediate 18432" in check.detail
    assert "estimated peak of a step 68.4 GiB at train.batch_tokens 16384" in check.detail  # 64.1 + DDP's 4.2
    monkeypatch.setattr(devices, "visible_gpus", lambda: [H100] * 8)
    assert devices.check_train_memory(ctx, "train").status == "ok"
    ctx.config["train"] = {**train, "batch_tokens": 24576}
    check = devices.check_train_memory(ctx, "train")
    assert check.status == "warn" and "may run out of memory; set train." in check.detail
    ctx.config["train"] = {**train, "num_key_value_heads": 7}
    check = devices.check_train_memory(ctx, "train")
    assert check.status == "fail" and "train.num_key_value_heads" in check.detail
    ctx.config["train"] = train
    monkeypatch.setattr(devices, "visible_gpus", lambda: [])
    assert devices.check_train_memory(ctx, "train").status == "skip"
    monkeypatch.setattr(devices, "visible_gpus", lambda: [RTX_PRO_6000] * 8)
    for target_config in (None, {"hidden_size": 7168}):  # not read, or no layer shape: the config check says
        ctx.target_config = target_config
        assert devices.check_train_memory(ctx, "train").status == "skip"
    assert any(name == "train memory" for name, _, _ in doctor.CHECKS)  # part of `make doctor`


def test_visible_gpus_reads_torchs_device_properties(monkeypatch):
    class Props:
        name, major, minor, total_memory, shared_memory_per_block_optin = (
            RTX_PRO_6000.name,
            12,
            0,
            102_641_893_376,
            101_376,
        )

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    assert devices.visible_gpus() == [RTX_PRO_6000] * 2
