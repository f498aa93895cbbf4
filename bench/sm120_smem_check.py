"""Do the flex attention kernels training compiles for sm_120 fit its 99 KB of shared memory? (GPU)

    python3 bench/sm120_smem_check.py --dry                  # CPU: the options it would test, and their estimates
    python3 bench/sm120_smem_check.py --out $OUT/sm120_smem_check.json

No sm_120 card is needed. On the GPU there is (H100/H200), the TTT attention's flex call
(attention.flex.FlexAttention, compiled, GQA, doc-causal block mask, the log-sum-exp returned and
differentiated) runs forward and backward with the kernel options attention.flex_options picks for
sm_120 (101,376 bytes per block), for each head dim of --head-dims (112: Kimi-K2.5's draft, 7168 / 64).
Every Triton kernel Inductor compiles on the way is recorded (`triton.compile` is wrapped; Inductor
compiles in this process) and compiled again for `GPUTarget("cuda", 120, 32)`, whose
`metadata.shared` is Triton's own figure for sm_120; where this Triton cannot build for sm_120, the
sm_80 build stands in (the same mma.sync + cp.async code path, no wgmma/TMA) and the report says so.
Each flex kernel's figure must be <= 101,376 bytes and is printed beside the estimate the options were
chosen by (an estimate below the measured figure means the model in flex_options needs refitting).
--torch-default also compiles torch's own choice for this GPU for sm_120, to show what the options avoid.
Exit status 1 if any flex kernel does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3build.attention.flex_options import (  # noqa: E402
    SM120_SMEM_PER_BLOCK,
    Backward,
    Forward,
    backward_smem_bytes,
    flex_kernel_options,
    forward_smem_bytes,
)

SM120 = (12, 0)


def planned(head_dims: list[int]) -> list[dict]:
    """For each head dim: the sm_120 options and their estimated shared memory (no GPU needed)."""
    plans = []
    for d in head_dims:
        opts = flex_kernel_options(SM120, SM120_SMEM_PER_BLOCK, d)
        fwd = Forward(opts["fwd_BLOCK_M"], opts["fwd_BLOCK_N"], opts["fwd_num_stages"], opts["fwd_num_warps"])
        bwd = Backward(
            *(
                opts[f"bwd_{k}"]
                for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps")
            )
        )
        plans.append(
            dict(
                head_dim=d,
                options=opts,
                estimate_forward=forward_smem_bytes(fwd, d, d),
                estimate_backward=backward_smem_bytes(bwd, d, d),
                limit=SM120_SMEM_PER_BLOCK,
            )
        )
    return plans


def _record_compiles(records: list):
    """Wrap triton.compile (Inductor calls it through the module) to keep each (source, options, binary)."""
    import triton

    original = triton.compile

    def recording(src, *args, **kwargs):
        binary = original(src, *args, **kwargs)
        records.append((src, kwargs.get("options") or (args[1] if len(args) > 1 else None), binary))
        return binary

    triton.compile = recording
    return original


def _name(src) -> str:
    return str(getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?"))


def _is_flex(name: str) -> bool:
    # Inductor names its template kernels triton_tem_*; flex attention's forward and backward are the
    # only templates this call compiles
    return "flex" in name or name.startswith("triton_tem")


def _block_sizes(src) -> dict:
    """The tile sizes a template kernel was generated with (`BLOCK_M : tl.constexpr = 128` lines)."""
    text = getattr(getattr(src, "fn", None), "src", "") or ""
    return {k: int(v) for k, v in re.findall(r"\b(BLOCK_[MN]\d?)\s*:\s*tl\.constexpr\s*=\s*(\d+)", text)}


def _shared(binary) -> int:
    return int(binary.shared if hasattr(binary, "shared") else binary.metadata.shared)


def shared_for(compile_fn, src, options, capability: int) -> int:
    from triton.backends.compiler import GPUTarget

    return _shared(compile_fn(src, target=GPUTarget("cuda", capability, 32), options=dict(options or {})))


def run_case(head_dim, heads, kv_heads, seq, options, compile_fn, records) -> list[dict]:
    """Forward + backward of the TTT flex call at one head dim; every flex kernel compiled, measured."""
    import torch

    from eagle3build.attention.flex import FlexAttention

    class Forced(FlexAttention):
        def kernel_options(self, q, v):
            return options  # None: torch's own choice for this GPU

    torch._dynamo.reset()
    start = len(records)
    attention = Forced(compile=True)
    device = torch.device("cuda")
    doc = (torch.arange(seq, device=device) >= seq // 3).long()  # two packed samples
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    out, lse = attention.causal(q, k, v, doc, head_dim**-0.5)
    (out.float().square().mean() + lse.mean()).backward()
    torch.cuda.synchronize()
    kernels = []
    for src, opts, binary in records[start:]:
        name = _name(src)
        if not _is_flex(name):
            continue
        entry = dict(
            kernel=name,
            this_gpu=_shared(binary),
            num_stages=(opts or {}).get("num_stages"),
            num_warps=(opts or {}).get("num_warps"),
        )
        entry["blocks"] = _block_sizes(src)
        for label, cap in (("sm_120", 120), ("sm_80", 80)):
            try:
                entry[label] = shared_for(compile_fn, src, opts, cap)
            except Exception as e:  # noqa: BLE001 - reported, the other target may still answer
                entry[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        figure = entry.get("sm_120", entry.get("sm_80"))
        entry["measured_as"] = (
            "sm_120" if "sm_120" in entry else ("sm_80 (stand-in)" if "sm_80" in entry else None)
        )
        entry["fits"] = figure is not None and figure <= SM120_SMEM_PER_BLOCK
        kernels.append(entry)
    return kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dry", action="store_true", help="print the options and estimates, compile nothing (CPU)"
    )
    ap.add_argument("--head-dims", default="64,112,128,256")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument(
        "--torch-default", action="store_true", help="also measure torch's own choice for this GPU"
    )
    ap.add_argument("--out", help="results file (bench/results/ format)")
    args = ap.parse_args()
    plans = planned([int(x) for x in args.head_dims.split(",")])
    if args.dry:
        for plan in plans:
            print(json.dumps(plan))
        return 0

    # Inductor compiles in this process (no worker pool) and without its caches, so every kernel
    # passes through triton.compile here.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="sm120-triton-"))
    import torch
    import torch._inductor.config as inductor_config

    if not torch.cuda.is_available():
        sys.exit("sm120_smem_check: needs a CUDA GPU to compile on (or --dry)")
    inductor_config.compile_threads = 1
    inductor_config.force_disable_caches = True
    # kernels named after their ops (triton_tem_fused_flex_attention_...), not all `triton_`
    inductor_config.triton.unique_kernel_names = True
    records: list = []
    compile_fn = _record_compiles(records)
    cases, ok = [], True
    for plan in plans:
        for label, options in (("sm_120 options", plan["options"]), ("torch default", None)):
            if options is None and not args.torch_default:
                continue
            try:
                kernels = run_case(
                    plan["head_dim"], args.heads, args.kv_heads, args.seq, options, compile_fn, records
                )
                error = None
            except Exception as e:  # noqa: BLE001 - one failed compilation is this case's result
                kernels, error = [], f"{type(e).__name__}: {str(e)[:2000]}"
            case = dict(
                head_dim=plan["head_dim"],
                choice=label,
                options=options,
                kernels=kernels,
                estimate_forward=plan["estimate_forward"],
                estimate_backward=plan["estimate_backward"],
                error=error,
            )
            if options is not None:  # torch's default for this GPU is shown, not required to fit
                case["ok"] = bool(kernels) and all(k["fits"] for k in kernels)
                ok &= case["ok"]
            cases.append(case)
            print(json.dumps(case), flush=True)
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        limit=SM120_SMEM_PER_BLOCK,
        cases=cases,
        ok=ok,
    )
    print("OK" if ok else "FAILED")
    if args.out:
        from results import record

        record("sm120_smem_check", result["device"], result, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
