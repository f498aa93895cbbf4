"""Preflight checks of this machine: GPUs and their memory, the training attention kernel, free disk."""

from __future__ import annotations

import shutil
from pathlib import Path

from eagle3build.doctor.context import GB, Check, Context
from eagle3build.doctor.engine import cache_plan, describe_cache_plan
from eagle3build.extraction.disk import tokens_to_extract
from eagle3build.extraction.plan import mirrored_shards, pending_token_shards
from eagle3build.extraction.vllm import file_threads
from eagle3build.shards import hidden_bytes_per_token


def _weights_bytes(ctx: Context) -> int | None:
    if not ctx.is_local:
        return None
    files = list(Path(ctx.model).glob("*.safetensors")) or list(Path(ctx.model).glob("*.bin"))
    return sum(f.stat().st_size for f in files) or None


def check_gpus(ctx: Context, stage: str) -> Check:
    name = "GPUs"
    import torch

    if not torch.cuda.is_available():
        return Check(name, "skip", "no CUDA device visible: GPU checks skipped (this run uses the CPU)")
    count = torch.cuda.device_count()
    mems = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
    parts = [f"{count} visible, smallest {min(mems) / GB:.0f} GB"]
    if stage in ("all", "extract") and ctx.backend == "vllm":
        tp, dp = int(ctx.vllm["tensor_parallel_size"]), int(ctx.vllm["data_parallel_size"])
        if tp * dp > count:
            return Check(
                name,
                "fail",
                f"extract.vllm tensor_parallel_size {tp} x data_parallel_size {dp} needs "
                f"{tp * dp} GPUs, {count} visible",
                "lower the parallel sizes or expose more GPUs (CUDA_VISIBLE_DEVICES, --gpus)",
            )
        weights = _weights_bytes(ctx)
        usable = min(mems) * float(ctx.vllm["gpu_memory_utilization"])
        if weights:
            per_gpu = weights / tp
            parts.append(f"weights {weights / GB:.1f} GB = {per_gpu / GB:.1f} GB per GPU at TP {tp}")
            if per_gpu > 0.9 * usable:  # leave room for activations and the KV / hidden-state cache
                return Check(
                    name,
                    "fail",
                    f"{per_gpu / GB:.1f} GB of weights per GPU leaves no room in "
                    f"{usable / GB:.1f} GB usable ({'; '.join(parts)})",
                    "raise extract.vllm.tensor_parallel_size or gpu_memory_utilization",
                )
        plan = cache_plan(ctx)
        if plan is not None:  # the caches one longest sequence needs on each GPU, next to the weights
            kv, states, tokens = plan
            parts.append(describe_cache_plan(ctx))
            if weights and weights / tp + (kv + states) * tokens > 0.9 * usable:
                return Check(
                    name,
                    "fail",
                    f"{weights / tp / GB:.1f} GB of weights + {(kv + states) * tokens / GB:.1f} GB of KV and "
                    f"hidden-state cache for one {tokens}-token sequence exceed {0.9 * usable / GB:.1f} GB per GPU "
                    f"({'; '.join(parts)})",
                    "lower prepare.max_length (extract.vllm.max_model_len), or raise "
                    "extract.vllm.tensor_parallel_size or gpu_memory_utilization",
                )
    if stage in ("all", "train"):
        want = int(ctx.section("train")["gpus"] or 0)
        if want > count:
            return Check(
                name, "fail", f"train.gpus {want} but {count} GPUs are visible", f"set train.gpus <= {count}"
            )
    return Check(name, "ok", "; ".join(parts))


def check_attention(ctx: Context) -> Check:
    """A train.attention kernel of torch's private ops (attention.kernel.KERNELS), run once on a tiny
    problem against fp32 math on this machine's GPU (check_kernel; training runs it again before loading)."""
    name = "attention"
    import torch

    from eagle3build.attention.kernel import KERNELS, check_kernel

    impl = ctx.section("train")["attention"]
    if impl not in KERNELS:
        return Check(name, "ok", f"train.attention {impl}: nothing to check")
    if not torch.cuda.is_available():
        return Check(name, "skip", f"train.attention {impl}: no CUDA device visible, checked where training runs")
    try:
        errors = check_kernel(impl, "cuda")
    except RuntimeError as e:
        return Check(name, "fail", str(e), "set train.attention: flex (the default on GPUs)")
    worst = max(errors, key=errors.get)
    return Check(name, "ok", f"train.attention {impl} agrees with fp32 math (worst: {worst} {errors[worst]:.1e})")


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(ctx: Context) -> Check:
    name = "disk"
    if ctx.target_config is None:
        return Check(name, "skip", "no target config")
    storage = ctx.extract["storage_dtype"]
    per_token = hidden_bytes_per_token(int(ctx.target_config["hidden_size"]), storage)
    per_million = f"{per_token * 1e6 / GB:.1f} GB per million tokens ({storage})"
    root = ctx.output_root
    pending = pending_token_shards(mirrored_shards(root / "tokens", root / "hidden"))
    remaining = tokens_to_extract(pending)
    shards = len(pending)
    free = shutil.disk_usage(_existing_parent(root)).free
    reserve = float(ctx.extract["disk_reserve_gb"]) * GB
    problems = []
    if shards:
        need = remaining * per_token
        detail = (
            f"{shards} shards / {remaining:,} tokens left to extract need {need / GB:.1f} GB "
            f"({per_million}); {free / GB:.1f} GB free under {root}"
        )
        if need + reserve > free:
            problems.append(detail)
    else:
        built = "every token shard is extracted" if any((root / "tokens").glob("*/*.safetensors")) else (
            "no token shards yet for an exact figure"
        )
        detail = f"{per_million}; {free / GB:.1f} GB free under {root} ({built})"
    if ctx.backend == "vllm":
        # The connector's files of the requests in flight and of those answered, waiting to be read (the
        # client reads file_threads() at once), each [T, 4, H] bf16.
        staging = Path(ctx.vllm.get("shared_storage_path") or root)
        max_length = ctx.max_length
        files = int(ctx.vllm["concurrency"]) + file_threads()
        burst = files * max_length * 4 * int(ctx.target_config["hidden_size"]) * 2
        staging_free = shutil.disk_usage(_existing_parent(staging)).free
        detail += (
            f"; connector staging up to {burst / GB:.2f} GB in {staging} ({staging_free / GB:.1f} GB free)"
        )
        if burst > staging_free:
            problems.append(
                f"extract.vllm.shared_storage_path {staging} has {staging_free / GB:.2f} GB free, "
                f"in-flight files need up to {burst / GB:.2f} GB"
            )
    if problems:
        return Check(
            name,
            "fail",
            "; ".join(problems),
            "free space, move output_root / extract.vllm.shared_storage_path, or use "
            "extract.storage_dtype: fp8 (about half the bytes)",
        )
    return Check(name, "ok", detail)
