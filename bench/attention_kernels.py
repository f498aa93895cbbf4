"""The training step's causal attention (doc-masked, GQA) forward + backward: flex as trained vs alternatives.

    python bench/attention_kernels.py --seq 4096 --out $OUT/attention_kernels.json      # on the GPU
    python bench/attention_kernels.py --preset kimi --seq 8192 --no-autotune --out $OUT/attention_kernels_kimi.json

Shape (--preset, bench/train_throughput.py's presets): the Llama-8B head (32 query heads, 8 KV heads,
head_dim 128; the default) or e.g. `kimi` (56 / 8 × 128), bf16, one sample of T tokens (the peers' data;
--docs 2: two packed samples, 1/3 and 2/3 of T), with the log-sum-exp the TTT merge needs.
Timed per call (fwd + bwd, and fwd alone under no_grad), after warm-up. Alternatives: flex compiled with
`max-autotune` (autotunes its block sizes), flex with hand-set block sizes or TMA loads (`USE_TMA`, off by
default on CUDA), and PyTorch's varlen attention (FlashAttention-2 with cu_seqlens; with no GQA argument
in torch 2.11 the KV heads are repeated). The output and lse are checked against flex.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_throughput import PRESETS  # noqa: E402  (the layer shapes the training-step bench times)

from eagle3build.compilation import compiled  # noqa: E402  (torch.compile with the training step's Inductor settings)


def timed(fn, grads, iters: int) -> dict:
    """fn() -> (out, lse); mean ms of fwd + bwd and of fwd alone."""
    for _ in range(3):
        torch.autograd.backward(list(fn()), grads)
    with torch.no_grad():
        for _ in range(3):  # no-grad calls compile a graph of their own: warm it too
            fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.autograd.backward(list(fn()), grads)
    torch.cuda.synchronize()
    fwd_bwd = (time.perf_counter() - t0) / iters * 1e3
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    return {"fwd_bwd_ms": round(fwd_bwd, 3), "fwd_ms": round((time.perf_counter() - t0) / iters * 1e3, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--preset", default="llama8b", choices=list(PRESETS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--docs", type=int, default=1, choices=(1, 2), help="packed samples in the sequence")
    ap.add_argument("--no-autotune", dest="autotune", action="store_false", help="skip max-autotune (slow to compile)")
    ap.add_argument("--out", default=None,
                    help="results file (bench/results/ format: this run replaces its device's entry)")
    args = ap.parse_args()
    T, dev = args.seq, "cuda"
    shape = PRESETS[args.preset]
    HEADS, KV_HEADS, HEAD_DIM = shape["heads"], shape["kv_heads"], shape["head_dim"]
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV_HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, KV_HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(1, HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16),
             torch.randn(1, HEADS, T, device=dev) * 0.01]
    doc = torch.zeros(T, dtype=torch.long, device=dev)
    start = T // 3 if args.docs == 2 else 0  # where the last sample starts
    doc[start:] = args.docs - 1
    scale = HEAD_DIM**-0.5
    pairs = sum(n * (n + 1) // 2 for n in ((T - start, start) if start else (T,)))
    flops_fwd = 4 * pairs * HEADS * HEAD_DIM
    block_mask = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (doc[ki] == doc[qi]), None, None, T, T, device=dev)
    aux = AuxRequest(lse=True)

    def flex(attend, options=None):
        def fn():
            out, a = attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=aux,
                            kernel_options=options)
            return out, a.lse
        return fn

    from torch.nn.attention import varlen

    cu = torch.tensor([0, start, T] if start else [0, T], device=dev, dtype=torch.int32)
    has_gqa = "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters

    def varlen_fa2():
        qq, kk, vv = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, heads, hd]
        extra = {"enable_gqa": True} if has_gqa else {}
        if not has_gqa:
            kk, vv = kk.repeat_interleave(HEADS // KV_HEADS, 1), vv.repeat_interleave(HEADS // KV_HEADS, 1)
        out, lse = varlen.varlen_attn(qq, kk, vv, cu, cu, T - start, T - start, return_aux=varlen.AuxRequest(lse=True),
                                      scale=scale, window_size=(-1, 0), **extra)
        return out.transpose(0, 1).unsqueeze(0), lse.reshape(1, HEADS, T)

    impls = {"flex, as trained (compilation.compiled, default blocks)": flex(compiled(flex_attention, dynamic=False))}
    if args.autotune:
        impls["flex, max-autotune"] = flex(compiled(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs"))
    for opts in (dict(USE_TMA=True),
                 dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                 dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=64, bwd_num_warps=8, bwd_num_stages=2),
                 dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=64, bwd_num_warps=8, bwd_num_stages=3),
                 dict(bwd_BLOCK_M1=64, bwd_BLOCK_N1=64, bwd_BLOCK_M2=64, bwd_BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=3),
                 dict(bwd_BLOCK_M1=32, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=32, bwd_num_warps=4, bwd_num_stages=3),
                 dict(USE_TMA=True, PRESCALE_QK=True)):
        impls[f"flex, {opts}"] = flex(compiled(flex_attention, dynamic=False), opts)
    impls[f"varlen_attn (FlashAttention-2{'' if has_gqa else ', KV heads repeated'})"] = varlen_fa2

    with torch.no_grad():
        ref_out, ref_lse = next(iter(impls.values()))()
    rows = []
    for name, fn in impls.items():
        row = {"impl": name, "T": T}
        torch.compiler.reset()  # every variant compiles the same function: past the recompile limit it runs eager
        try:
            row.update(timed(fn, grads, args.iters))
            # Attended (query, key) pairs × 4 FLOPs (QK^T and PV) per head dim per head; backward does 2.5× that.
            row["fwd_bwd_tflops"] = round(3.5 * flops_fwd / row["fwd_bwd_ms"] / 1e9, 1)
            with torch.no_grad():
                out, lse = fn()
            row["max_abs_diff_out"] = float((out - ref_out).abs().max())
            row["max_abs_diff_lse"] = float((lse - ref_lse).abs().max())
        except Exception as e:  # noqa: BLE001 - a kernel that fails is recorded, the next one runs
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
              "preset": args.preset,
              "torch": torch.__version__, "python": platform.python_version(), "rows": rows}
    for row in rows:
        print(json.dumps(row))
    if args.out:
        from results import record

        record("attention_kernels", result["device"], result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
