"""EAGLE-3 training-step throughput of eagle3build (TTT, k steps) at a real head shape, in one run.

    python bench/train_throughput.py --seq 2048 4096 --out $OUT/train_throughput.json   # on the GPU
    ANCHOR_ONLY=sf_T4096_ttt7,spec_T4096_ttt7 bash .gpu/ptb/run.sh                     # the peers, same call
    python bench/train_throughput.py --seq 4096 --steps 17 --variants compiled --no-check \
        --peers $OUT/anchor_results.jsonl --out $OUT/train_throughput.json               # ours, with the ratio
    python bench/train_throughput.py --preset tiny --seq 256 --device cpu                # smoke run
    python bench/train_throughput.py --preset kimi --seq 4096 8192 16384 --no-check \
        --activation-checkpointing --loss-chunk-tokens 2048                              # long sequences
    python bench/train_throughput.py --preset kimi --seq 4096 8192 16384 32768 --dry     # the memory plan only

One step is what `eagle3build.train.loop` does per micro-batch: the target's draft-vocab distribution
(`TargetScorer.draft_probs`), the k-step TTT forward, the normalised weighted loss, backward, grad
clipping and fused AdamW, with fp32 master weights under bf16 autocast. The greedy-in-draft flag is
cached per sample by the trainer (once per run), so it is computed before timing. Synthetic inputs
already on the device, every row weighted (as the peers' bench; --loss-fraction masks a share of each
256 tokens as chat prompts are, and the step then computes the lm_head and loss at the loss rows only
and TTT steps 1.. at the rows with a loss there only, as training does; --no-step-rows computes every
row at steps 1.. for comparison), the same batch every step, so the loss must fall.

Reported per sequence length: tokens/s (mean over the timed steps), model-FLOPs utilisation against
an 8192^3 bf16 matmul timed in the same process (FLOPs counted as peer-train-bench counts them),
peak allocated memory (beside the estimate of `memory_estimate`), the loss of every step, and, once, the agreement of the fast path (compiled,
flex + LSE merge) with the dense `sdpa` path on the same weights (loss and gradients, bf16).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3build.attention.factory import make_attention  # noqa: E402
from eagle3build.attention.kernel import KERNELS, check_kernel  # noqa: E402
from eagle3build.attention.merged import MathMergedAttention  # noqa: E402
from eagle3build.draft.model import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3build.draft.target import TargetHead  # noqa: E402
from eagle3build.train.data import LOSS_ROWS_MULTIPLE, compile_length_multiple  # noqa: E402
from eagle3build.train.loop import freeze_lm_head  # noqa: E402
from eagle3build.train.memory import memory_estimate  # noqa: E402
from eagle3build.train.optim import clipped_step  # noqa: E402
from eagle3build.ttt.batch import PackedBatch, with_loss_rows, with_step_rows  # noqa: E402
from eagle3build.ttt.forward import ttt_forward  # noqa: E402
from eagle3build.ttt.loss import step_loss_weights, weighted_loss  # noqa: E402
from eagle3build.ttt.recompute import Recompute  # noqa: E402
from eagle3build.ttt.scorer import TargetScorer  # noqa: E402

PRESETS = {
    # Llama-3.1-8B's layer shape, draft vocab 32k (the peers' bench shape)
    "llama8b": dict(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, draft_vocab=32000
    ),
    # SmolLM2-135M-Instruct's layer shape with a 32k draft vocab (the quality benchmark's head)
    "smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, draft_vocab=32000),
    # Kimi-K2.5's width and vocab with a Llama-style draft layer: 56 query / 8 KV heads x 128 and the
    # target's dense intermediate size (peer-train-bench's `kimi` preset); kimi64: 64 query heads
    "kimi": dict(
        hidden=7168, heads=56, kv_heads=8, head_dim=128, intermediate=18432, vocab=163840, draft_vocab=32000
    ),
    "kimi64": dict(
        hidden=7168, heads=64, kv_heads=8, head_dim=128, intermediate=18432, vocab=163840, draft_vocab=32000
    ),
    # the draft configs/kimi-k2.5.yaml trains: DraftConfig.from_target of Kimi-K2.5's text config (64 heads,
    # MLA's num_key_value_heads 64, no head_dim: 7168 / 64 = 112; the dense intermediate size), with the
    # config's norm before fc (train.norm_before_fc)
    "kimi_derived": dict(
        hidden=7168, heads=64, kv_heads=64, head_dim=112, intermediate=18432, vocab=163840, draft_vocab=32000,
        aux_norm=True,
    ),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, draft_vocab=128),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GpuClockLog:
    """The GPU's SM clock, power draw and power-cap flag, sampled by nvidia-smi every 100 ms while the
    timed steps run. An H200 at its 700 W cap lowers its clock, and by how much depends on how hard the
    step drives it: tokens/s comparisons between trainers need the clocks beside them (BENCHMARKS §2)."""

    POWER_CAP = 0x4  # nvidia-smi clocks_throttle_reasons: SW power cap

    def __init__(self, device: torch.device):
        self.proc = None
        if device.type != "cuda" or not shutil.which("nvidia-smi"):
            return
        p = torch.cuda.get_device_properties(device)
        bus_id = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"  # this process's GPU
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--id={bus_id}", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
             "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=self.log, stderr=subprocess.DEVNULL,
        )

    def stop(self) -> dict | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.seek(0)
        samples = []
        for line in self.log.read().splitlines():
            try:
                clock, power, reasons = (x.strip() for x in line.split(","))
                samples.append((float(clock), float(power), int(reasons, 16)))
            except ValueError:  # a header, "[N/A]" or a line cut by the stop
                continue
        if not samples:
            return None
        n = len(samples)
        return dict(
            samples=n,
            sm_mhz_mean=round(sum(c for c, _, _ in samples) / n),
            sm_mhz_min=min(c for c, _, _ in samples),
            power_w_mean=round(sum(w for _, w, _ in samples) / n, 1),
            power_capped_share=round(sum(bool(r & self.POWER_CAP) for _, _, r in samples) / n, 3),
        )


def matmul_tflops(device, n=8192, warmup=3, iters=10) -> dict:
    """bf16 n^3 matmul rate, timed like the steps (the MFU reference, as peer-train-bench)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(warmup):
        a @ b
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return dict(
        n=n, tflops_mean=2 * n**3 / (sum(times) / len(times)) / 1e12, tflops_best=2 * n**3 / min(times) / 1e12
    )


def flops_per_token(shape: dict, T: int, ttt: int, frozen_lm_head: bool = False) -> dict:
    """Model FLOPs per input token of one training step, counted as peer-train-bench counts them.

    fc: forward + weight grad (its input is data); layer: 3x forward per TTT step; trainable lm_head:
    3x (frozen, train.freeze_lm_head: 2x, forward and input gradient, as speculators' is counted); attention: causal keys of the sample plus one diagonal key per earlier step, 3x; target: the
    draft-vocab rows of the target's lm_head, forward only (the full-vocab greedy flag is cached).
    """
    H, nh, nkv, hd = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    inter, K = shape["intermediate"], shape["draft_vocab"]
    fc = 2 * 3 * H * H
    layer = 2 * (2 * H) * (nh + 2 * nkv) * hd + 2 * nh * hd * H + 3 * 2 * H * inter
    lm = 2 * H * K
    avg_keys = (T + 1) / 2
    attn = sum(2 * 2 * nh * hd * (avg_keys + i) for i in range(ttt))
    target = 2 * H * K
    return dict(
        flops_per_token=2 * fc + 3 * ttt * layer + (2 if frozen_lm_head else 3) * ttt * lm + 3 * attn + target,
        parts=dict(fc=fc, layer_per_step=layer, lm_head_per_step=lm, attention_all_steps=attn, target=target),
    )


def build(
    shape: dict, T: int, device, seed: int = 0, loss_fraction: float = 1.0, ttt: int = 7, step_rows: bool = True
):
    """Random-weight draft + target head and one synthetic packed batch of T tokens.

    loss_fraction < 1 masks the first (1 - loss_fraction) of every 256 tokens, as a chat sample's prompts
    are masked; the batch's loss rows (and step rows, unless step_rows is False) are chosen and laid out
    on the host, as training does.
    """
    H, V, K = shape["hidden"], shape["vocab"], shape["draft_vocab"]
    g = torch.Generator(device=device).manual_seed(seed)
    embed = torch.randn(V, H, device=device, generator=g) * 0.02
    target = TargetHead(
        embed_tokens=embed,
        norm=torch.ones(H, device=device),
        lm_head=embed,
        hidden_size=H,
        vocab_size=V,
        num_hidden_layers=32,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate"],
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    )
    kept = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:K].sort().values
    d2t, t2d = kept - torch.arange(K), torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    config = DraftConfig.from_target(target, K, [2, 16, 29], {"norm_before_fc": True} if shape.get("aux_norm") else None)
    torch.manual_seed(seed)
    with torch.device(device):
        draft = Eagle3Draft.from_target(config, target, d2t.to(device), t2d.to(device))
    data_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scorer = TargetScorer(target, d2t, t2d, device, data_dtype)
    batch = PackedBatch(
        input_ids=torch.randint(0, V, (T,), device=device, generator=g),
        loss_mask=torch.arange(T, device=device) % 256 >= round((1 - loss_fraction) * 256),
        doc=torch.zeros(T, dtype=torch.long, device=device),
        position=torch.arange(T, device=device),
        aux=torch.randn(T, 3 * H, device=device, generator=g).to(data_dtype),
        final=torch.randn(T, H, device=device, generator=g).to(data_dtype),
        greedy_in_draft=torch.ones(T, dtype=torch.bool, device=device),  # every loss row weighted
    )
    batch = with_loss_rows(batch.to("cpu"), ttt, LOSS_ROWS_MULTIPLE)
    if step_rows:  # rounded as training rounds them: to its length buckets where it compiles (GPU)
        batch = with_step_rows(batch, compile_length_multiple(T) if device.type == "cuda" else 1)
    return draft, scorer, batch.to(device)


def loss_and_grads(draft, scorer, batch, attention, ttt, compile, autocast, recompute=None):
    """One TTT forward + backward; returns per-step mean losses and the gradients (no update)."""
    draft.zero_grad(set_to_none=True)
    with autocast:
        stats = ttt_forward(draft, batch, scorer.draft_probs(batch.loss_final), ttt, attention, compile=compile,
                            recompute=recompute)
        loss = weighted_loss(stats, stats.count, step_loss_weights(ttt, 0.8, batch.aux.device))
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad(set_to_none=True)
    return (stats.loss_sum / stats.count).detach().float().cpu(), grads


def relative_grad_diffs(grads: dict, reference: dict) -> dict[str, float]:
    """|g - ref| / |ref| per parameter (Frobenius norms)."""
    return {n: float((grads[n] - r).norm() / r.norm().clamp(min=1e-30)) for n, r in reference.items()}


def check_against_dense(draft, scorer, batch, fast_attention, ttt, compile, autocast, recompute=None) -> dict:
    """Fast path (with the memory switches, if any) vs the dense-mask sdpa path without them, same weights
    and batch (both bf16 autocast on GPU)."""
    fast_loss, fast_grads = loss_and_grads(draft, scorer, batch, fast_attention, ttt, compile, autocast, recompute)
    dense_loss, dense_grads = loss_and_grads(
        draft, scorer, batch, make_attention("sdpa"), ttt, False, autocast
    )
    cos = {
        n: float(torch.nn.functional.cosine_similarity(fast_grads[n].flatten(), g.flatten(), dim=0))
        for n, g in dense_grads.items()
    }
    rel = relative_grad_diffs(fast_grads, dense_grads)
    return dict(
        step_loss_fast=[round(float(x), 5) for x in fast_loss],
        step_loss_dense=[round(float(x), 5) for x in dense_loss],
        max_step_loss_rel_diff=float(((fast_loss - dense_loss).abs() / dense_loss.abs()).max()),
        min_grad_cosine=min(cos.values()),
        max_grad_rel_diff=max(rel.values()),
        worst_grad=max(rel, key=rel.get),
    )


def profile_step(step, device, path: Path) -> str:
    """torch.profiler table of one step (top kernels by their own device time) written to `path`, and on the
    GPU its Chrome trace beside it (`.trace.json.gz`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    try:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            step()
            sync(device)
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=60, max_name_column_width=90
        )
        path.write_text(table)
        if cuda:  # the timeline too (gaps, order, launch times), for chrome://tracing or Perfetto
            trace = path.with_suffix(".trace.json")
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
                shutil.copyfileobj(f, g)
            trace.unlink()
        return str(path.name)
    except Exception as e:  # noqa: BLE001 - the profile is a diagnostic, never a failure
        return f"failed: {type(e).__name__}: {e}"


def run_config(args, shape, T, device, variant: str, matmul: dict, out_dir: Path | None) -> dict:
    """variant: 'compiled' (flex + compiled layer halves and loss) or 'flex-only' (only flex compiled)."""
    cuda = device.type == "cuda"
    result = dict(T=T, ttt=args.ttt, variant=variant, ok=False, **memory_switches(args, shape, T))
    recompute = Recompute.from_params({"activation_checkpointing": args.activation_checkpointing,
                                       "ttt_steps": args.ttt, "loss_chunk_tokens": args.loss_chunk_tokens})
    t_start = time.perf_counter()
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        draft, scorer, batch = build(
            shape, T, device, loss_fraction=args.loss_fraction, ttt=args.ttt, step_rows=args.step_rows
        )
        result["loss_fraction"] = args.loss_fraction
        result["step_rows"] = None if batch.step_rows is None else len(batch.step_rows)
        compile_rest = variant == "compiled"
        scorer.compile = compile_rest  # the target distribution too, as training does
        result["attention"] = args.attention
        if cuda or args.attention != "flex":
            if args.attention in KERNELS:  # torch's private kernel ops: as training, checked first
                result["kernel_check"] = check_kernel(args.attention, device)
            attention = make_attention(args.attention, compile=True)
            attention.compile = compile_rest  # flex is always compiled; the LSE merge only in "compiled"
        else:  # flex has no CPU backward: the same merge with a dense causal part
            attention = MathMergedAttention(compile=compile_rest)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
        weights = step_loss_weights(args.ttt, 0.8, device)
        if args.check:
            result["check_vs_dense_sdpa"] = check_against_dense(
                draft, scorer, batch, attention, args.ttt, compile_rest, autocast, recompute
            )
        if args.freeze_lm_head:
            freeze_lm_head(draft, initialised=True)  # build() copies the target's rows, as training does
        trainable = [p for p in draft.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), fused=cuda)

        def step() -> torch.Tensor:
            with autocast:
                stats = ttt_forward(
                    draft, batch, scorer.draft_probs(batch.loss_final), args.ttt, attention, compile=compile_rest,
                    recompute=recompute,
                )
                loss = weighted_loss(stats, stats.count, weights)
            loss.backward()
            clipped_step(optimizer, trainable, 0.5)  # as training clips and steps
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        losses = []
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            losses.append(step())
        sync(device)
        result["warmup_s"] = time.perf_counter() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        clocks = GpuClockLog(device)
        for _ in range(args.steps):
            sync(device)
            t0 = time.perf_counter()
            losses.append(step())
            sync(device)
            times.append(time.perf_counter() - t0)
        result["gpu_clocks"] = clocks.stop()
        mean = sum(times) / len(times)
        fm = flops_per_token(shape, T, args.ttt, args.freeze_lm_head)
        # A step that trains nothing runs fast: refuse to report it (every row of this batch has a loss).
        if not all(math.isfinite(float(x)) and float(x) > 0 for x in losses):
            raise RuntimeError(f"losses {[round(float(x), 5) for x in losses]}: the step trained no row")
        result.update(
            step_ms_mean=1e3 * mean,
            step_ms_min=1e3 * min(times),
            step_ms=[round(1e3 * t, 2) for t in times],
            tokens_per_s=T / mean,
            achieved_tflops=fm["flops_per_token"] * T / mean / 1e12,
            mfu=fm["flops_per_token"] * T / mean / (matmul["tflops_mean"] * 1e12),
            flops=fm,
            losses=[round(float(x), 5) for x in losses],
        )
        if cuda:
            result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        result["ok"] = True
        if args.profile and out_dir is not None:
            result["profile"] = profile_step(step, device, out_dir / f"profile_T{T}_{variant}{'' if args.attention == 'flex' else '_' + args.attention}.txt")
    except Exception as e:  # noqa: BLE001 - a failing variant is recorded and the next one runs
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    result["wall_s"] = time.perf_counter() - t_start
    return result


def memory_switches(args, shape: dict, T: int) -> dict:
    """A result's memory switches and its estimated peak (memory_estimate, GiB)."""
    estimate = memory_estimate(shape, T, args.ttt, args.loss_fraction, args.activation_checkpointing,
                               args.loss_chunk_tokens, args.freeze_lm_head)
    return dict(activation_checkpointing=args.activation_checkpointing, loss_chunk_tokens=args.loss_chunk_tokens,
                freeze_lm_head=args.freeze_lm_head, peak_estimate_gib=estimate)


def dry_run(args, shape: dict) -> int:
    """--dry: each length's estimated peak with the switches as given, and with each switch, no device work."""
    for T in args.seq:
        row = {"T": T, **memory_switches(args, shape, T)}
        for name, ckpt, chunk in (("plain", False, 0), ("checkpointing", True, 0),
                                  ("chunked_loss", False, args.loss_chunk_tokens or 2048),
                                  ("both", True, args.loss_chunk_tokens or 2048)):
            row[f"estimate_{name}_gib"] = memory_estimate(shape, T, args.ttt, args.loss_fraction, ckpt, chunk,
                                                          args.freeze_lm_head)["total"]
        print(json.dumps(row), flush=True)
    return 0


PEER_KEYS = ("tokens_per_s", "step_ms_mean", "step_ms_median", "step_ms_min", "mfu", "peak_mem_timed_gib",
             "loss_first", "loss_last", "warmup_s", "torch", "source", "speculators_version", "sliding_window",
             "attention_backend", "compute")


def attach_peers(results: list[dict], path: Path) -> None:
    """Beside each of our results: the peers' results at its length and k (peer-train-bench's JSON lines of
    the same call), and our tokens/s over the faster peer's (over the one peer's, named, if only one finished)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def matches(p: dict, r: dict) -> bool:  # by the line's own length and k (its tag only where it has none)
        if "seq" in p and "ttt" in p:
            return p["seq"] == r["T"] and p["ttt"] == r["ttt"]
        return p.get("tag", "").endswith(f"_T{r['T']}_ttt{r['ttt']}")

    for r in results:
        same = {p["peer"]: {k: p[k] for k in PEER_KEYS if k in p} for p in lines if p.get("ok") and matches(p, r)}
        failed = {p["tag"]: p.get("error", "failed") for p in lines if not p.get("ok") and matches(p, r)}
        if failed:
            r["peers_not_finished"] = failed
        if r["ok"] and same:
            r["peers"] = same
            name, best = max(same.items(), key=lambda kv: kv[1]["tokens_per_s"])
            r["ratio_vs_faster_peer" if len(same) > 1 else f"ratio_vs_{name}"] = round(
                r["tokens_per_s"] / best["tokens_per_s"], 3)


def save(report: dict, args) -> None:
    """Record the run in --out (bench/results/ format), with the peers of --peers beside each result."""
    from results import record

    if args.peers:
        attach_peers(report["results"], Path(args.peers))
    record("train_throughput", report["device"], report, args.out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama8b", choices=list(PRESETS))
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=27, help="timed steps (the loss is recorded for all)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--loss-fraction", type=float, default=1.0,
                    help="share of tokens with a loss (1: every row, as the peers compute; chat data: ~0.6)")
    ap.add_argument("--no-step-rows", dest="step_rows", action="store_false",
                    help="TTT steps 1.. compute every row, not only the rows with a loss there")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--activation-checkpointing", nargs="?", type=int, const=True, default=False, metavar="N",
                    help="recompute each TTT step's layer in backward, or the first N steps' "
                         "(train.activation_checkpointing: true or N)")
    ap.add_argument("--loss-chunk-tokens", type=int, default=0, metavar="ROWS",
                    help="the loss over chunks of ROWS loss rows (train.loss_chunk_tokens; 0: all at once)")
    ap.add_argument("--freeze-lm-head", action="store_true",
                    help="the draft's lm_head frozen at the target's rows (train.freeze_lm_head; speculators' default)")
    ap.add_argument("--dry", action="store_true",
                    help="print the estimated peak memory of each length (memory_estimate) and run nothing")
    ap.add_argument("--variants", default="compiled,flex-only", help="tried in order until one succeeds")
    ap.add_argument("--attention", default="flex", choices=["flex", *KERNELS],
                    help="the causal attention's kernel: flex, or torch's varlen flash (attention/kernel.py)")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the fast-vs-dense check")
    ap.add_argument("--check-seq", type=int, default=2048, help="run the check only at this length")
    ap.add_argument("--profile", nargs="?", const=".", default=None, metavar="DIR",
                    help="torch.profiler table (on the GPU also a Chrome trace) of one step per length, into DIR")
    ap.add_argument("--peers", default=None, metavar="JSONL",
                    help="peer-train-bench's results of the same call (its anchor_results.jsonl): the peers' "
                    "numbers and our ratio to the faster one beside each length's result")
    ap.add_argument("--out", default=None,
                    help="results file (bench/results/ format: this run replaces its device's entry)")
    args = ap.parse_args()
    from results import cpu_device

    shape = PRESETS[args.preset]
    if args.dry:
        return dry_run(args, shape)
    device = torch.device(args.device)
    out_dir = Path(args.profile) if args.profile else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_device(),
        preset=args.preset,
        shape=shape,
        ttt=args.ttt,
        warmup=args.warmup,
        steps=args.steps,
        command=" ".join(sys.argv),
    )
    report["matmul_bf16"] = matmul_tflops(device)
    print(json.dumps({"matmul_bf16": report["matmul_bf16"]}), flush=True)
    report["results"] = []
    check_all = args.check
    for T in args.seq:
        args.check = check_all and T == args.check_seq
        for variant in args.variants.split(","):
            r = run_config(args, shape, T, device, variant, report["matmul_bf16"], out_dir)
            summary = {k: v for k, v in r.items() if k not in ("losses", "flops", "traceback")}
            print(json.dumps(summary), flush=True)
            if not r["ok"]:
                print(r.get("traceback", ""), file=sys.stderr, flush=True)
            report["results"].append(r)
            if args.out:  # after every config, so a run cut short still leaves its results
                save(report, args)
            torch._dynamo.reset()
            if r["ok"]:
                break
    if args.out:
        save(report, args)
    ok = [r for r in report["results"] if r["ok"]]
    for r in ok:
        ckpt = r["activation_checkpointing"]
        switches = ("" if not ckpt else " checkpointed" if ckpt is True else f" first {ckpt} step(s) checkpointed") + (
            " frozen lm_head" if r.get("freeze_lm_head") else "") + (
            f" loss chunks of {r['loss_chunk_tokens']}" if r["loss_chunk_tokens"] else "")
        print(
            f"T={r['T']} {r['variant']}{switches}: {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%, "
            f"peak {r.get('peak_mem_gib', math.nan):.1f} GiB (estimate {r['peak_estimate_gib']['total']:.1f}), loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
            + (f", SM clock {c['sm_mhz_mean']} MHz at {c['power_w_mean']} W" if (c := r.get("gpu_clocks")) else "")
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
