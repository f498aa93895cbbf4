"""Preflight check of the GPUs themselves: compute capability, memory and shared memory per GPU, the flex
kernel options training will use on them, and whether the extraction server's tensor-parallel plan
fits: weights / TP + KV cache + hidden-state cache per GPU against memory x gpu_memory_utilization.

The plan per GPU, for the vLLM backend (docs/PRODUCTION.md walks it for Kimi-K2.5 on 8 x 96 GB):
- weights: the checkpoint's bytes (its safetensors index's total_size, else the files' sizes) / TP;
- KV cache per token: multi-head latent attention (kv_lora_rank in the config) keeps one latent of
  kv_lora_rank + qk_rope_head_dim values per layer on every TP rank (it is not split); other
  attention 2 x kv heads / TP (at least one) x head_dim per layer. Bytes per value: 1 with
  `--kv-cache-dtype fp8*` in extract.vllm.extra_args, else 2;
- hidden-state cache per token: (aux ids + the final layer) x hidden size x 2 bytes, on every GPU
  (vLLM's extract_hidden_states does not split it over TP ranks);
- a share `RESERVE` of the usable memory for activations, CUDA graphs and NCCL buffers.
The server needs room for one max_model_len sequence (else vLLM refuses to start): fail below that;
warn where extract.vllm.concurrency full-length requests would not all fit (they queue).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from eagle3build.attention.flex_options import device_smem, flex_kernel_options
from eagle3build.doctor.context import GB, Check, Context

RESERVE = 0.10  # of memory x gpu_memory_utilization: activations, CUDA graphs, NCCL


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    total_memory: int  # bytes
    smem_per_block: int | None  # opt-in shared memory per block, bytes (None: not reported)


def visible_gpus() -> list[Gpu]:
    """This machine's CUDA devices ([] without any)."""
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        capability, smem = device_smem(i)
        gpus.append(Gpu(props.name, capability, int(props.total_memory), smem))
    return gpus


def weights_bytes(model: str) -> int | None:
    """The checkpoint's size: the safetensors index's total_size, else the files' sizes (None: not local)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if total:
                return int(total)
        except (OSError, json.JSONDecodeError):
            pass
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) or None


def kv_bytes_per_token(cfg: dict, tp: int, value_bytes: int = 2) -> int:
    """KV cache bytes one token takes on one GPU at tensor parallel `tp` (see the module doc)."""
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):  # MLA: the compressed latent plus the decoupled RoPE key, replicated
        return layers * (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 64)) * value_bytes
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return layers * 2 * max(1, math.ceil(kv_heads / tp)) * head_dim * value_bytes


def hidden_cache_bytes_per_token(hidden_size: int, slots: int = 4, value_bytes: int = 2) -> int:
    """extract_hidden_states' cache per token on every GPU: the aux layers + the final one."""
    return slots * hidden_size * value_bytes


def kv_value_bytes(extra_args: list[str]) -> int:
    args = [str(a) for a in extra_args]
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--kv-cache-dtype=") else (
            args[i + 1] if arg == "--kv-cache-dtype" and i + 1 < len(args) else None
        )
        if value is not None:
            return 1 if value.startswith("fp8") else 2
    return 2


def tp_plan(weights: int, memory: int, util: float, tp: int, per_token: int, need: int, want: int) -> dict:
    """Bytes per GPU of the server's plan and whether one sequence (`need` tokens) and every request
    in flight (`want` tokens) fit. Pure: tests feed it any device."""
    usable = memory * util
    room = usable * (1 - RESERVE) - weights / tp
    return {
        "weights_per_gpu": weights / tp,
        "usable": usable,
        "cache_need": need * per_token,
        "cache_want": want * per_token,
        "fits": room >= need * per_token,
        "fits_all_in_flight": room >= want * per_token,
        "full_sequences": max(0, int(room // (need * per_token))) if need * per_token else 0,
    }


def _describe(gpus: list[Gpu], head_dim: int | None) -> str:
    """'8 x NAME (sm_120, 95.6 GB, 99 KB shared memory per block: flex tiles ...)', per kind of GPU."""
    parts = []
    for gpu in dict.fromkeys(gpus):
        count = gpus.count(gpu)
        smem = f", {gpu.smem_per_block / 1024:.0f} KB shared memory per block" if gpu.smem_per_block else ""
        options = flex_kernel_options(gpu.capability, gpu.smem_per_block, head_dim or 128)
        tiles = (
            f": flex attention tiles for small shared memory (forward {options['fwd_BLOCK_M']}x{options['fwd_BLOCK_N']}, "
            f"{options['fwd_num_stages']} stages; backward {options['bwd_BLOCK_M1']}x{options['bwd_BLOCK_N1']}, "
            f"{options['bwd_num_stages']} stages)"
            if options
            else ""
        )
        major, minor = gpu.capability
        parts.append(f"{count} x {gpu.name} (sm_{major}{minor}, {gpu.total_memory / GB:.1f} GB{smem}{tiles})")
    return "; ".join(parts)


def _draft_head_dim(ctx: Context) -> int | None:
    """The draft's head dim as training will build it: train.head_dim, else the target's (draft.target)."""
    train, cfg = ctx.section("train"), ctx.target_config or {}
    if train.get("head_dim"):
        return int(train["head_dim"])
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    heads = cfg.get("num_attention_heads")
    return int(cfg["hidden_size"]) // int(heads) if heads and cfg.get("hidden_size") else None


def _server_plan(ctx: Context, memory: int | None) -> tuple[str, str, str]:
    """(status, detail, fix) of the extraction server's tensor-parallel memory plan."""
    cfg, vllm = ctx.target_config or {}, ctx.vllm
    tp, util = int(vllm["tensor_parallel_size"]), float(vllm["gpu_memory_utilization"])
    weights = weights_bytes(ctx.model)
    if weights is None or "num_hidden_layers" not in cfg:
        return "ok", f"TP {tp}: the checkpoint's size is unknown here (not a local folder), memory plan skipped", ""
    per_token = kv_bytes_per_token(cfg, tp, kv_value_bytes(vllm.get("extra_args") or [])) + hidden_cache_bytes_per_token(
        int(cfg["hidden_size"])
    )
    need = int(vllm.get("max_model_len") or ctx.max_length + 1)
    want = int(vllm["concurrency"]) * (ctx.max_length + 1)
    head = (
        f"TP {tp}: weights {weights / GB:.1f} GB = {weights / tp / GB:.1f} GB per GPU, KV + hidden-state cache "
        f"{per_token / 1024:.1f} KB per token per GPU ({need * per_token / GB:.2f} GB for one {need}-token sequence, "
        f"{want * per_token / GB:.2f} GB for {vllm['concurrency']} in flight)"
    )
    if memory is None:
        return "skip", f"{head}; no GPU visible to compare with", ""
    plan = tp_plan(weights, memory, util, tp, per_token, need, want)
    detail = f"{head} of {plan['usable'] / GB:.1f} GB usable per GPU (x {util}, {RESERVE:.0%} kept for activations)"
    if not plan["fits"]:
        return "fail", f"does not fit: {detail}", (
            "raise extract.vllm.tensor_parallel_size or gpu_memory_utilization, lower prepare.max_length, "
            "or add --kv-cache-dtype fp8 to extract.vllm.extra_args"
        )
    if not plan["fits_all_in_flight"]:
        return "warn", f"fits {plan['full_sequences']} full-length sequences at once: {detail}", (
            f"lower extract.vllm.concurrency to {max(1, plan['full_sequences'])} (the others queue anyway)"
        )
    return "ok", f"fits: {detail}", ""


def check_devices(ctx: Context, stage: str) -> Check:
    name = "devices"
    gpus = visible_gpus()
    described = _describe(gpus, _draft_head_dim(ctx)) if gpus else "no CUDA device visible"
    if stage in ("all", "extract") and ctx.backend == "vllm":
        memory = min(g.total_memory for g in gpus) if gpus else None
        status, plan, fix = _server_plan(ctx, memory)
        return Check(name, status, f"{described}; {plan}", fix)
    return Check(name, "ok" if gpus else "skip", described)
