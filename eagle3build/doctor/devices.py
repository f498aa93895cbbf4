"""Preflight check of the GPUs themselves: compute capability, memory and shared memory per GPU, the flex
kernel options training will use on them, and whether the extraction server's tensor-parallel plan
fits: weights / TP + KV cache + hidden-state cache per GPU against memory x gpu_memory_utilization.

The plan per GPU, for the vLLM backend (docs/PRODUCTION.md walks it for Kimi-K2.5 on 8 x 96 GB):
- weights: the checkpoint's bytes (its safetensors index's total_size, else the files' sizes) / TP;
- KV and hidden-state cache per token on each GPU: doctor.engine.cache_plan (MLA's latent and the
  hidden-state cache are whole on every GPU, not split by tensor parallel);
- a share `RESERVE` of the usable memory for activations, CUDA graphs and NCCL buffers (the same 90%
  rule as the GPU check).
The server needs room for one max_model_len sequence (else vLLM refuses to start): fail below that;
warn where extract.vllm.concurrency full-length requests would not all fit at once (they queue).

The training step's plan (`train memory`): the estimated peak of one step at train.batch_tokens for the
draft the target's config derives (train.memory_check, what training logs again before its first step),
against the smallest visible GPU; a warning names the train keys that would fit. Known before regeneration
and extraction have run for days, not after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3build.attention.flex_options import device_smem, flex_kernel_options
from eagle3build.doctor.context import GB, Check, Context
from eagle3build.doctor.engine import cache_plan
from eagle3build.errors import ConfigError

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
    vllm = ctx.vllm
    tp, util = int(vllm["tensor_parallel_size"]), float(vllm["gpu_memory_utilization"])
    weights, caches = weights_bytes(ctx.model), cache_plan(ctx)
    if weights is None or caches is None:
        return "ok", f"TP {tp}: the checkpoint is not a local folder here, memory plan skipped", ""
    kv, states, need = caches
    per_token = kv + states
    want = int(vllm["concurrency"]) * need
    head = (
        f"TP {tp}: weights {weights / GB:.1f} GB = {weights / tp / GB:.1f} GB per GPU, KV + hidden-state cache "
        f"{per_token / 1e3:.1f} kB per token per GPU ({need * per_token / GB:.2f} GB for one {need}-token "
        f"sequence, {want * per_token / GB:.2f} GB for {vllm['concurrency']} in flight)"
    )
    if memory is None:
        return "skip", f"{head}; no GPU visible to compare with", ""
    plan = tp_plan(weights, memory, util, tp, per_token, need, want)
    detail = f"{head} of {plan['usable'] / GB:.1f} GB usable per GPU (x {util}, {RESERVE:.0%} kept for activations)"
    if not plan["fits"]:
        return (
            "fail",
            f"does not fit: {detail}",
            (
                "raise extract.vllm.tensor_parallel_size or gpu_memory_utilization, or lower prepare.max_length"
            ),
        )
    if not plan["fits_all_in_flight"]:
        return (
            "warn",
            f"fits {plan['full_sequences']} full-length sequences at once: {detail}",
            (f"lower extract.vllm.concurrency to {max(1, plan['full_sequences'])} (the others queue anyway)"),
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


def check_train_memory(ctx: Context, stage: str) -> Check:
    name = "train memory"
    if ctx.target_config is None:
        return Check(name, "skip", "the target's config was not read (the config check says why)")
    from eagle3build.draft.model import DraftConfig
    from eagle3build.draft.target import TargetShape
    from eagle3build.train.loop import resolve_params
    from eagle3build.train.memory import GIB, memory_check

    train = ctx.section("train")
    try:
        p = resolve_params(ctx.config.get("train"))
        config = DraftConfig.from_target(TargetShape.from_config(ctx.target_config),
                                         int(ctx.section("vocab")["draft_vocab_size"]), None,
                                         {k: p[k] for k in DraftConfig.OVERRIDABLE})
    except ConfigError as e:
        return Check(name, "fail", str(e), "fix the key it names")
    except (KeyError, TypeError, ValueError) as e:  # the config check reports what the target's config lacks
        return Check(name, "skip", f"the target's config gives no layer shape ({e!r})")
    gpus = visible_gpus()
    if not gpus:
        return Check(name, "skip", "no CUDA device visible to compare a step's memory with")
    world_size = max(1, int(train["gpus"] or 0))  # train.gpus processes (train/launch.py)
    fits, note = memory_check(config, p, min(g.total_memory for g in gpus) / GIB, world_size)
    shape = (f"the draft layer {config.num_attention_heads} query / {config.num_key_value_heads} KV heads x "
             f"{config.head_dim}, intermediate {config.intermediate_size}")
    return Check(name, "ok" if fits else "warn", f"{shape}: {note}")
