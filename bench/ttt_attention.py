"""TTT attention alone, per `train.attention`: flex (compiled) vs torch's varlen FlashAttention-2.

    python3 bench/ttt_attention.py --out $OUT/ttt_attention.json
    python3 bench/ttt_attention.py --device cpu --seq 256 --impls flash   # smoke run (CPU flash)

(bench/attention_kernels.py times one causal call with flex's kernel options instead.)

The attention of one training batch as ttt_forward runs it: k steps, each a causal attention over the
step-0 keys plus the diagonal keys of steps 1..s, forward and backward (gradients to the queries, keys
and values of every step), at the training benchmark's head shape (32 query heads, 8 kv heads, head dim
128, bf16). Layouts: one sample of T tokens (the training benchmark's batch), and T tokens packed from
samples of --sample-len tokens (chat data: blocks across samples are skipped by every kernel here).

Before timing, each fused kernel is checked against fp32 math on a tiny problem (check_kernel, as
training does), and its outputs and gradients at the benchmark's size are compared with flex's (both
bf16). Timed with CUDA events, median over --iters after --warmup. TFLOP/s counts the causal part only:
4·nh·hd·Σ L(L+1)/2 per step forward, 2.5 times that backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3build.attention.factory import make_attention  # noqa: E402
from eagle3build.attention.kernel import KERNELS, check_kernel, relative_error  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def inputs(T: int, ttt: int, device, dtype, seed: int = 0):
    """Per step: a query [1, nh, T, hd] and key/value [1, nkv, T, hd] leaves in the token-major memory layout
    the layer produces ([1, T, heads, hd] transposed), and an output gradient."""
    g = torch.Generator(device=device).manual_seed(seed)

    def leaf(heads):
        return torch.randn(1, T, heads, HEAD_DIM, device=device, generator=g).to(dtype).requires_grad_()

    qs, ks, vs = [leaf(HEADS) for _ in range(ttt)], [leaf(KV_HEADS) for _ in range(ttt)], [leaf(KV_HEADS) for _ in range(ttt)]
    douts = [torch.randn(1, HEADS, T, HEAD_DIM, device=device, generator=g).to(dtype) for _ in range(ttt)]
    return qs, ks, vs, douts


def attention_pass(attention, qs, ks, vs, doc, scale, douts=None):
    """Every step's attention; with douts, also the gradients of every leaf."""
    keys, values, outs = [], [], []
    for s in range(len(qs)):
        keys.append(ks[s].transpose(1, 2))
        values.append(vs[s].transpose(1, 2))
        outs.append(attention(qs[s].transpose(1, 2), keys, values, doc, s, scale))
    if douts is None:
        return outs, None
    return outs, torch.autograd.grad(outs, [*qs, *ks, *vs], douts)


def causal_flops(doc: torch.Tensor, ttt: int) -> float:
    lengths = torch.unique_consecutive(doc, return_counts=True)[1].double()
    return 4.0 * HEADS * HEAD_DIM * float((lengths * (lengths + 1) / 2).sum()) * ttt


def timed(fn, device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(relative_error(x, y) for x, y in zip(a, b, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--sample-len", type=int, default=512, help="the packed layout's sample length")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--impls", default=",".join(["flex", *KERNELS]))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="results file (bench/results/ format: this run replaces its device's entry)")
    args = ap.parse_args()
    from results import cpu_device, record

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impls = args.impls.split(",")
    report = dict(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_device(),
        shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, ttt=args.ttt, dtype=str(dtype)),
        command=" ".join(sys.argv),
        kernel_checks={},
        results=[],
    )
    for impl in impls:
        if impl in KERNELS:
            try:
                report["kernel_checks"][impl] = check_kernel(impl, device)
            except RuntimeError as e:
                report["kernel_checks"][impl] = f"failed: {e}"
            print(json.dumps({impl: report["kernel_checks"][impl]}), flush=True)
    scale = HEAD_DIM**-0.5
    for T in args.seq:
        for layout in ("one sample", f"samples of {args.sample_len}"):
            if layout == "one sample":
                doc = torch.zeros(T, dtype=torch.long, device=device)
            else:
                doc = torch.arange(T, device=device) // args.sample_len
            qs, ks, vs, douts = inputs(T, args.ttt, device, dtype)
            flops = causal_flops(doc, args.ttt)
            baseline = None
            for impl in impls:
                row = dict(T=T, layout=layout, impl=impl)
                if impl in KERNELS and not isinstance(report["kernel_checks"].get(impl), dict):
                    row["skipped"] = "kernel check failed"
                    report["results"].append(row)
                    continue
                try:
                    attention = make_attention(impl, compile=device.type == "cuda")
                    outs, grads = attention_pass(attention, qs, ks, vs, doc, scale, douts)
                    if baseline is None:
                        baseline, row["reference"] = (outs, grads), True
                    else:
                        row["out_vs_first"] = relative(outs, baseline[0])
                        row["grads_vs_first"] = relative(grads, baseline[1])
                    del outs, grads
                    forward = partial(attention_pass, attention, qs, ks, vs, doc, scale)
                    with torch.no_grad():
                        fwd_ms = statistics.median(timed(forward, device, args.warmup, args.iters))
                    both_ms = statistics.median(timed(partial(forward, douts=douts), device, args.warmup, args.iters))
                    row.update(
                        forward_ms=round(fwd_ms, 3),
                        forward_backward_ms=round(both_ms, 3),
                        backward_ms=round(both_ms - fwd_ms, 3),
                        forward_tflops=round(flops / fwd_ms / 1e9, 1),
                        backward_tflops=round(2.5 * flops / max(both_ms - fwd_ms, 1e-9) / 1e9, 1),
                    )
                except Exception as e:  # noqa: BLE001 - a failing kernel is recorded and the next one runs
                    row["error"] = f"{type(e).__name__}: {e}"[:1500]
                print(json.dumps(row), flush=True)
                report["results"].append(row)
                if args.out:  # after every row, so a run cut short still leaves its results
                    record("ttt_attention", report["device"], report, args.out)
            del qs, ks, vs, douts, baseline
    for r in report["results"]:
        if "forward_backward_ms" in r:
            print(f"T={r['T']} {r['layout']:>16} {r['impl']:>6}: fwd {r['forward_ms']:7.2f} ms, fwd+bwd "
                  f"{r['forward_backward_ms']:7.2f} ms ({r['forward_tflops']} / {r['backward_tflops']} TFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
