"""Extraction throughput (HF backend) against its baselines and the disk, in one run.

    python bench/extract_throughput.py --model models/SmolLM2-135M-Instruct --tokens 2000000 \
        --out bench/results/extract_throughput_smollm2.json
    python bench/extract_throughput.py --random-shape llama-3.2-1b --tokens 1000000

Measures, on the same synthetic token shard (lengths drawn from a fixed, chat-like distribution):
  disk       sequential write bandwidth of the output folder (64 MiB blocks, fsync)
  naive      one sample at a time, `output_hidden_states=True`, one safetensors file per sample
  padded64   padded batches of 64 (arrival order), `output_hidden_states=True`, one file per batch
  ours-bf16  `eagle3build.extraction.hf_server.Extractor` (length-sorted token-budget batches, hooks, packed
             rows, writer thread), bf16 storage
  ours-fp8   the same with fp8 storage
and checks that our stored states equal the naive baseline's (bf16 rounding of the same forward).
The bar (issue): >= 70% of min(disk-bound, compute-bound) tokens/s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3build.config import default_aux_layer_ids  # noqa: E402
from eagle3build.extraction.hf_server import Extractor  # noqa: E402
from eagle3build.shards import hidden_bytes_per_token, read_hidden, write_tokens  # noqa: E402

SHAPES = {  # random-weight targets of real models' shapes
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096),
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_lengths(total_tokens: int, max_len: int, seed: int = 0) -> list[int]:
    """Chat-like lengths: log-uniform between 64 and max_len."""
    g = torch.Generator().manual_seed(seed)
    lengths, n = [], 0
    while n < total_tokens:
        x = int(torch.exp(torch.empty(1).uniform_(4.16, float(torch.log(torch.tensor(max_len))), generator=g)))
        lengths.append(x)
        n += x
    return lengths


def disk_bandwidth(folder: Path, gbytes: float) -> float:
    block = os.urandom(64 << 20)
    path = folder / "disk-probe.bin"
    n = max(1, int(gbytes * 1e9 / len(block)))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for _ in range(n):
        os.write(fd, block)
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return n * len(block) / dt


def states_hf(lm, ids, mask, aux, n_layers):
    """The naive way: all hidden states, then pick (HF's last one is post-norm: take the norm's input)."""
    captured = {}
    handle = lm.model.norm.register_forward_pre_hook(lambda m, a: captured.__setitem__("pre", a[0]))
    out = lm.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    handle.remove()
    return torch.stack([out.hidden_states[i] for i in aux] + [captured["pre"]], dim=2)


@torch.inference_mode()
def run_naive(lm, ids_list, aux, n_layers, device, out_dir: Path, limit_s: float) -> tuple[int, float]:
    tokens, t0 = 0, time.perf_counter()
    for i, ids in enumerate(ids_list):
        x = ids[None].to(device)
        h = states_hf(lm, x, torch.ones_like(x), aux, n_layers)[0]
        save_file({"hidden": h.to(torch.bfloat16).cpu().contiguous(), "input_ids": ids.to(torch.int32)},
                  str(out_dir / f"{i}.safetensors"))
        tokens += len(ids)
        if time.perf_counter() - t0 > limit_s:
            break
    sync(device)
    return tokens, time.perf_counter() - t0


@torch.inference_mode()
def run_padded(lm, ids_list, aux, n_layers, device, out_dir: Path, batch: int, limit_s: float) -> tuple[int, float]:
    tokens, t0 = 0, time.perf_counter()
    for b in range(0, len(ids_list), batch):
        group = ids_list[b:b + batch]
        longest = max(len(x) for x in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, x in enumerate(group):
            ids[r, :len(x)] = x
            mask[r, :len(x)] = 1
        h = states_hf(lm, ids.to(device), mask.to(device), aux, n_layers)
        save_file({"hidden": h.to(torch.bfloat16).cpu().contiguous(), "mask": mask.to(torch.uint8)},
                  str(out_dir / f"{b}.safetensors"))
        tokens += int(mask.sum())
        if time.perf_counter() - t0 > limit_s:
            break
    sync(device)
    return tokens, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF model dir")
    src.add_argument("--random-shape", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=2_000_000)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--baseline-seconds", type=float, default=20.0, help="time cap per baseline")
    p.add_argument("--disk-gb", type=float, default=4.0)
    p.add_argument("--work", type=Path, default=None, help="scratch folder on the disk to measure")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path,
                   help="results file (bench/results/ format: this run replaces its device's entry)")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    work = Path(tempfile.mkdtemp(dir=args.work))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.model:
        model_dir, name = args.model, Path(args.model).name
    else:
        model_dir, name = str(work / "model"), f"random {args.random_shape}"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SHAPES[args.random_shape])).to(dtype).save_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    n_layers, hidden = lm.config.num_hidden_layers, lm.config.hidden_size
    aux = default_aux_layer_ids(n_layers)
    lengths = make_lengths(args.tokens, args.max_len)
    g = torch.Generator().manual_seed(1)
    ids_list = [torch.randint(10, lm.config.vocab_size, (n,), generator=g) for n in lengths]
    write_tokens(work / "tokens.safetensors", ids_list, [torch.ones(n) for n in lengths], {"tokenizer": "synthetic"})
    flops_per_token = 2 * sum(p.numel() for n, p in lm.named_parameters() if "embed" not in n and "lm_head" not in n)

    rows = []
    disk = disk_bandwidth(work, args.disk_gb)
    per_token = hidden_bytes_per_token(hidden, "bf16")
    print(f"disk: {disk / 1e9:.2f} GB/s -> bf16 bound {disk / per_token:,.0f} tok/s", flush=True)

    # warm-up (CUDA context, kernels) on a few samples, then the baselines under a time cap
    run_naive(lm, ids_list[:4], aux, n_layers, args.device, Path(tempfile.mkdtemp(dir=work)), 60)
    nd = Path(tempfile.mkdtemp(dir=work))
    tok, dt = run_naive(lm, ids_list, aux, n_layers, args.device, nd, args.baseline_seconds)
    rows.append({"method": "naive per-sample", "tokens": tok, "seconds": dt, "tokens_per_s": tok / dt})
    pdir = Path(tempfile.mkdtemp(dir=work))
    tok, dt = run_padded(lm, ids_list, aux, n_layers, args.device, pdir, 64, args.baseline_seconds)
    rows.append({"method": "padded batches of 64", "tokens": tok, "seconds": dt, "tokens_per_s": tok / dt})
    shutil.rmtree(pdir)
    del lm
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    ex = Extractor(model_dir, aux, args.device, "bfloat16" if dtype == torch.bfloat16 else "float32")
    ex.extract_shard(str(work / "tokens.safetensors"), str(work / "warm.safetensors"), "bf16", args.batch_tokens,
                     args.max_batch_size, progress=False)  # warm-up pass (allocator, kernels)
    (work / "warm.safetensors").unlink()
    for storage in ("bf16", "fp8"):
        out = work / f"ours-{storage}.safetensors"
        sync(args.device)
        stats = ex.extract_shard(str(work / "tokens.safetensors"), str(out), storage, args.batch_tokens,
                                 args.max_batch_size, progress=False)
        rows.append({"method": f"ours {storage}", "tokens": stats["tokens"], "seconds": stats["seconds"],
                     "tokens_per_s": stats["tokens_per_s"], "bytes": out.stat().st_size,
                     "disk_bound_tokens_per_s": disk / hidden_bytes_per_token(hidden, storage)})
        if storage == "fp8":
            out.unlink()
    # Equality with the naive baseline's stored tensors, sample by sample.
    from safetensors.torch import load_file

    ours = read_hidden(work / "ours-bf16.safetensors", dtype=torch.float32)
    worst = 0.0
    for i in range(min(len(list(nd.glob("*.safetensors"))), 32)):
        naive = load_file(str(nd / f"{i}.safetensors"))["hidden"].float()
        mine = ours.sample(i)[2]
        worst = max(worst, float(((mine - naive).norm(dim=-1) / naive.norm(dim=-1).clamp_min(1e-6)).max()))
    from results import cpu_device, record

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_device()
    result = {"model": name, "hidden_size": hidden, "layers": n_layers, "aux_layer_ids": aux,
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "disk_bytes_per_s": disk,
              "compute_flops_per_token": flops_per_token, "rows": rows,
              "max_rel_diff_vs_naive": worst, "torch": torch.__version__}
    for r in rows:
        print(f"{r['method']:>22}: {r['tokens_per_s']:>12,.0f} tok/s", flush=True)
    print(f"max relative row difference vs naive: {worst:.2e}")
    if args.out:
        record("extract_throughput", device, result, args.out)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
