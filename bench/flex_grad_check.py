"""Compiled flex attention's gradients against fp32 math, as the TTT step calls it (GPU).

    python3 bench/flex_grad_check.py --out $OUT/flex_grad_check.json

Should bench/compiled_step_rows_check.py find the compiled training step's gradients off on one GPU
and not on another with the same code and inputs, this isolates the causal attention: flex attention
compiled as attention.flex.FlexAttention compiles it (doc-causal block mask,
GQA, the log-sum-exp returned and differentiated), fed queries and keys in the layouts the step produces
(token-major views of [1, T, heads, hd]) or contiguous, at SmolLM2's head shape (9 query heads, 3 kv
heads, head dim 64: the failing check's) and the Llama-8B benchmark's. Each case runs --repeats times
on fresh random inputs, allocating in between, and every run's output, log-sum-exp and q/k/v gradients
are compared with fp32 math: a wrong run is reported with its relative errors. Exit status 1 if any is
above --rtol.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3build.attention.flex import FlexAttention  # noqa: E402
from eagle3build.attention.kernel import relative_error  # noqa: E402
from eagle3build.attention.merged import MathMergedAttention  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}


def one_run(attention, T, heads, kv_heads, hd, doc, layout, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)

    def tensor(h):
        t = torch.randn(1, T, h, hd, device=device, generator=g).bfloat16()  # [1, T, h, hd], as projected
        return t.transpose(1, 2) if layout == "token-major" else t.transpose(1, 2).contiguous()

    q, k, v = tensor(heads).requires_grad_(), tensor(kv_heads).requires_grad_(), tensor(kv_heads).requires_grad_()
    d_out = torch.randn(1, heads, T, hd, device=device, generator=g).bfloat16()
    d_lse = torch.randn(1, heads, T, device=device, generator=g) * 0.1
    scale = hd**-0.5
    out, lse = attention.causal(q, k, v, doc, scale)
    grads = torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse))
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = MathMergedAttention().causal(*leaves, doc, scale)  # fp32 math, kv heads repeated
    ref_grads = torch.autograd.grad((ref_out, ref_lse), leaves, (d_out.float(), d_lse))

    errors = dict(out=relative_error(out.detach(), ref_out.detach()), lse=relative_error(lse.detach(), ref_lse.detach()))
    errors.update({f"d{n}": relative_error(a, b) for n, a, b in zip("qkv", grads, ref_grads, strict=True)})
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rtol", type=float, default=2e-2)
    ap.add_argument("--out", help="results file (bench/results/ format: this run replaces its device's entry)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("flex_grad_check: needs a CUDA GPU (flex attention has no CPU backward)")
    device = torch.device("cuda")
    T = args.seq
    docs = {
        "one sample": torch.zeros(T, dtype=torch.long, device=device),
        "two samples": (torch.arange(T, device=device) >= T // 3).long(),
    }
    cases, ok = [], True
    for shape in args.shapes.split(","):
        heads, kv_heads, hd = SHAPES[shape]
        attention = FlexAttention(compile=True)
        for doc_name, doc in docs.items():
            for layout in ("token-major", "contiguous"):
                runs = []
                for r in range(args.repeats):
                    errors = one_run(attention, T, heads, kv_heads, hd, doc, layout, r, device)
                    junk = torch.empty(int(torch.randint(1, 64, ()).item()) << 20, dtype=torch.uint8, device=device)
                    junk.fill_(0xFF)  # reuse the allocator's blocks with other contents between runs
                    del junk
                    runs.append({k: round(v, 6) for k, v in errors.items()})
                worst = max(max(e.values()) for e in runs)
                case = dict(shape=shape, doc=doc_name, layout=layout, worst=worst, ok=worst <= args.rtol, runs=runs)
                ok &= case["ok"]
                cases.append(case)
                print(json.dumps({k: v for k, v in case.items() if k != "runs"}), flush=True)
    result = dict(
        date=datetime.now(UTC).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
        torch=torch.__version__, seq=T, rtol=args.rtol, cases=cases, ok=ok,
    )
    print("OK" if ok else "FAILED")
    if args.out:
        from results import record

        record("flex_grad_check", result["device"], result, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
