"""The training step's loss (draft logits -> TTT soft cross-entropy) forward + backward, as trained vs alternatives.

    python bench/loss_kernels.py --preset kimi --seq 8192 --out $OUT/loss_kernels_kimi.json     # on the GPU

Shape (--preset, bench/train_throughput.py's presets): T loss rows × k TTT steps of pre-norm draft output
[T, k, H], the draft's norm and lm_head [K, H] (frozen unless --train-lm-head), the target's distribution over
the draft vocab fp32 [T, K], every row weighted. Timed per call after warm-up, fwd + bwd:
- `matmul`: the norm and lm_head alone, compiled, backward from a fixed gradient: the part of the loss that is
  matmul.
- `as trained`: ttt.loss.soft_cross_entropy compiled as the step compiles it.
- `max gather`: the same loss with the draft's top-1 hit read as "the logit at the target's argmax is the
  row's max" (a gather) rather than an argmax inside the reduction over the logits.
- `as trained, rows dynamic`: as trained with the rows' dimension marked dynamic, as the step marks it (the
  number of loss rows varies from batch to batch there): the bench's other rows compile for static shapes.
- each of these with Inductor's coordinate-descent tuning (`tuned`).
The loss part of each is its time less `matmul`'s; the bytes the loss must move at least (logits read in
forward and in backward, their gradient written: 3 × T·k·K × 2 bytes) over that time is its bandwidth.
The alternatives' three sums are checked against `as trained`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_throughput import PRESETS, sync  # noqa: E402  (the layer shapes the training-step bench times)

from eagle3build.compilation import compiled  # noqa: E402
from eagle3build.draft.model import Eagle3Draft, RMSNorm  # noqa: E402
from eagle3build.ttt.loss import soft_cross_entropy, step_loss_weights  # noqa: E402


class Head(nn.Module):
    """The draft's norm and lm_head, with the draft's own `logits`."""

    logits = Eagle3Draft.logits

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = RMSNorm(hidden, 1e-6)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def max_gather_cross_entropy(model, fused, hidden, target_probs, weight):
    """soft_cross_entropy with the top-1 hit as a gather at the target's argmax compared with the row max."""
    logits = model.logits(hidden, fused).float()
    p = target_probs.unsqueeze(1)
    zmax = logits.detach().amax(-1, keepdim=True)
    lse = (zmax + (logits - zmax).exp().sum(-1, keepdim=True).log()).squeeze(-1)
    loss = lse * p.sum(-1) - (p * logits).sum(-1)
    target_argmax = target_probs.argmax(-1, keepdim=True)  # [M, 1]
    at_target = logits.detach().gather(-1, target_argmax.unsqueeze(1).expand(-1, logits.shape[1], 1))
    correct = (weight * (at_target >= zmax).squeeze(-1)).sum(0)
    return (weight * loss).sum(0), correct, weight.sum(0)


def timed(fn, iters: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kimi", choices=list(PRESETS))
    ap.add_argument("--seq", type=int, default=8192, help="loss rows T")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--train-lm-head", action="store_true", help="lm_head trained (its gradient computed)")
    ap.add_argument("--no-tuning", dest="tuning", action="store_false", help="skip the coordinate-descent rows")
    ap.add_argument("--out", default=None,
                    help="results file (bench/results/ format: this run replaces its device's entry)")
    args = ap.parse_args()
    shape, T, S = PRESETS[args.preset], args.seq, args.ttt
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a check of the script at the tiny preset
    H, K = shape["hidden"], shape["draft_vocab"]
    torch.manual_seed(0)
    head = Head(H, K).to(dev, torch.bfloat16)
    head.lm_head.weight.data.normal_(0, H**-0.5)
    head.lm_head.weight.requires_grad_(args.train_lm_head)
    hidden = torch.randn(T, S, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    target_probs = torch.softmax(torch.randn(T, K, device=dev) * 3, -1)
    weight = torch.ones(T, S, device=dev)
    step_weights = step_loss_weights(S, 0.8, dev)  # train.step_weight's default
    grad_logits = torch.randn(T, S, K, device=dev, dtype=torch.bfloat16) * 1e-4

    logits = compiled(lambda: head.logits(hidden))  # compiled as the loss is: the norm fuses into its neighbours

    def matmul():
        logits().backward(grad_logits)

    def loss_call(fn, dynamic_rows: bool):
        inputs = (hidden, target_probs, weight)
        if dynamic_rows:  # other tensor objects: a mark stays on the tensor and would reach the static variants
            inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)  # as ttt_forward marks the loss's inputs

        def call():
            loss_sum, correct, count = fn(head, None, *inputs)
            (step_weights * loss_sum / count).sum().backward()
            return loss_sum.detach(), correct, count
        return call

    rows, sums = [], {}
    matmul_ms = timed(matmul, args.iters, dev)
    rows.append({"variant": "matmul", "fwd_bwd_ms": round(matmul_ms, 3)})
    loss_bytes = 3 * T * S * K * 2
    variants = [("as trained", soft_cross_entropy, False), ("max gather", max_gather_cross_entropy, False),
                ("as trained, rows dynamic", soft_cross_entropy, True)]
    for tuned in (False, True) if args.tuning else (False,):
        os.environ["TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"] = "1" if tuned else "0"
        for name, fn, dynamic_rows in variants:
            torch._dynamo.reset()
            call = loss_call(compiled(fn), dynamic_rows)
            t0 = time.perf_counter()
            sums[name] = [t.float().cpu() for t in call()]
            compile_s = time.perf_counter() - t0
            ms = timed(call, args.iters, dev)
            loss_ms = ms - matmul_ms
            row = {"variant": name + (", tuned" if tuned else ""), "fwd_bwd_ms": round(ms, 3),
                   "loss_ms": round(loss_ms, 3), "first_call_s": round(compile_s, 1),
                   "loss_gb_per_s": round(loss_bytes / (loss_ms * 1e-3) / 1e9) if loss_ms > 0 else None}
            if name != "as trained":
                ref = sums["as trained"]
                row["loss_sum_max_rel_err"] = float(((sums[name][0] - ref[0]).abs() / ref[0].abs()).max())
                row["correct_diff"] = float((sums[name][1] - ref[1]).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    device_name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_name,
              "preset": args.preset, "shape": {"T": T, "ttt": S, "hidden": H, "draft_vocab": K},
              "lm_head": "trained" if args.train_lm_head else "frozen", "torch": torch.__version__,
              "python": platform.python_version(), "rows": rows}
    if args.out:
        from results import record

        record("loss_kernels", result["device"], result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
