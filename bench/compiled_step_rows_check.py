"""The compiled training step with step rows whose count changes from batch to batch (GPU).

    python3 bench/compiled_step_rows_check.py                   # SmolLM2's head shape, T = 4096
    python3 bench/compiled_step_rows_check.py --preset llama8b  # the training benchmark's shape

Training rounds each batch's step rows up to its length buckets, so a compiled kernel meets the rows
count R of several buckets, with gradients and under no_grad (validation). For batches whose share of
loss tokens gives R = 2/4, 3/4 and all of T (then no step rows at all), this runs the compiled step
(flex attention, or --attention's kernel; compiled layer halves, LSE merge, loss) with and without step rows on the same weights
and checks: the same per-step losses, gradients equal to bf16 rounding, and no graph break or eager
fallback in dynamo's counters. Each batch is also run eagerly with dense attention in fp32 (the
reference: both bf16 runs within --ref-rtol of it), and a batch seen before (the same inputs) must give
its first gradients again after other shapes compiled. A failing check names the worst parameter.
The CPU suite checks the same equalities with Inductor's CPU backend (tests/test_ttt_fast.py); flex
attention's backward needs the GPU. Inductor's coordinate-descent tuning is off unless
TORCHINDUCTOR_COORDINATE_DESCENT_TUNING says otherwise: it changes kernel speed, not results, and would
add minutes of compilation for each of these shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext

import torch

os.environ.setdefault("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_throughput import PRESETS, build, loss_and_grads, relative_grad_diffs  # noqa: E402

from eagle3build.attention.factory import make_attention  # noqa: E402
from eagle3build.attention.flex import FlexAttention  # noqa: E402
from eagle3build.attention.kernel import KERNELS  # noqa: E402
from eagle3build.ttt.forward import ttt_forward  # noqa: E402


class ContiguousFlex(FlexAttention):
    """Flex attention given contiguous q, k and v. The every-row path hands flex a transposed query and
    key/value views; compiled flex backward has given wrong gradients for some input strides before
    (pytorch#146377), so this tells whether the strides matter should the check fail."""

    def causal(self, q, k, v, doc, scale):
        return super().causal(q.contiguous(), k.contiguous(), v.contiguous(), doc, scale)


def worst(diffs: dict[str, float]) -> dict:
    name = max(diffs, key=diffs.get)
    return dict(worst=name, worst_relative_grad_diff=diffs[name])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2", choices=list(PRESETS))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--loss-fractions", type=float, nargs="+", default=[0.6, 0.3, 1.0, 0.6])
    ap.add_argument("--grad-rtol", type=float, default=1e-3,
                    help="worst relative gradient difference allowed between two compiled runs (step rows vs every "
                    "row; a batch seen before vs its first time)")
    ap.add_argument("--ref-rtol", type=float, default=3e-2,
                    help="worst relative gradient difference allowed against the fp32 dense reference (bf16 runs)")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip the fp32 dense-attention reference of every batch")
    ap.add_argument("--attention", default="flex", choices=["flex", "flex-contiguous", *KERNELS],
                    help="the causal attention's kernel (flash: attention/kernel.py; flex-contiguous: flex "
                         "given contiguous copies of q, k and v)")
    ap.add_argument("--out", help="results file (bench/results/ format: this run replaces its device's entry)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compiled_step_rows_check: needs a CUDA GPU (flex attention has no CPU backward)")
    import torch._dynamo.utils as dynamo_utils

    device = torch.device("cuda")
    attention = ContiguousFlex(compile=True) if args.attention == "flex-contiguous" else make_attention(args.attention, compile=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    checks, ok, seen = [], True, {}
    for fraction in args.loss_fractions:
        runs = {}
        for step_rows in (True, False):
            draft, scorer, batch = build(
                PRESETS[args.preset], args.seq, device, loss_fraction=fraction, ttt=args.ttt, step_rows=step_rows
            )
            started = time.perf_counter()
            losses, grads = loss_and_grads(draft, scorer, batch, attention, args.ttt, True, autocast)
            with torch.no_grad(), autocast:  # what validation runs
                stats = ttt_forward(draft, batch, scorer.draft_probs(batch.loss_final), args.ttt, attention, compile=True)
            runs[step_rows] = dict(
                rows=None if batch.step_rows is None else len(batch.step_rows),
                losses=losses,
                grads=grads,
                no_grad_losses=(stats.loss_sum / stats.count).float().cpu(),
                seconds=round(time.perf_counter() - started, 1),
            )
        fast, every = runs[True], runs[False]
        check = dict(
            loss_fraction=fraction,
            step_rows=fast["rows"],
            of_rows=args.seq,
            loss_max_diff=float((fast["losses"] - every["losses"]).abs().max()),
            no_grad_loss_max_diff=float((fast["no_grad_losses"] - every["no_grad_losses"]).abs().max()),
            **worst(relative_grad_diffs(fast["grads"], every["grads"])),
            seconds=[fast["seconds"], every["seconds"]],
        )
        check["ok"] = fast["grads"].keys() == every["grads"].keys() and check["worst_relative_grad_diff"] <= args.grad_rtol
        check["ok"] &= check["loss_max_diff"] <= 1e-4 and check["no_grad_loss_max_diff"] <= 1e-4
        if args.reference:  # which of the two is right, should they differ: eager, dense attention, fp32,
            # on the every-row run's weights and batch (the loop's last build; loss_and_grads changes neither)
            _, reference = loss_and_grads(
                draft, scorer, batch.to(device, torch.float32), make_attention("sdpa"), args.ttt, False, nullcontext()
            )
            for name, run in (("step_rows", fast), ("every_row", every)):
                check[f"{name}_vs_fp32"] = worst(relative_grad_diffs(run["grads"], reference))
                check["ok"] &= check[f"{name}_vs_fp32"]["worst_relative_grad_diff"] <= args.ref_rtol
        if fraction in seen:  # the same inputs again, after other shapes compiled: the same gradients
            for name, run in (("step_rows", fast), ("every_row", every)):
                check[f"{name}_vs_first_time"] = worst(relative_grad_diffs(run["grads"], seen[fraction][name]))
                check["ok"] &= check[f"{name}_vs_first_time"]["worst_relative_grad_diff"] <= args.grad_rtol
        else:
            seen[fraction] = {"step_rows": fast["grads"], "every_row": every["grads"]}
        ok &= check["ok"]
        checks.append(check)
        print(json.dumps(check), flush=True)
    counters = {k: dict(v) for k, v in dynamo_utils.counters.items() if k in ("frames", "graph_break", "unimplemented")}
    ok &= not counters.get("graph_break") and not counters.get("unimplemented")
    result = dict(
        preset=args.preset, seq=args.seq, ttt=args.ttt, attention=args.attention, device=torch.cuda.get_device_name(), torch=torch.__version__,
        checks=checks, dynamo_counters=counters, ok=ok,
    )
    print(f"dynamo: {counters}\n{'OK' if ok else 'FAILED'}: {len(checks)} batches")
    if args.out:
        from results import record

        record("compiled_step_rows_check", result["device"], result, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
