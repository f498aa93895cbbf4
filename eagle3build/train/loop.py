"""Train the EAGLE-3 draft head on extracted hidden states (training-time test, see ttt.py).

`train(...)` is the stage function. One optimiser step consumes `grad_accum * world_size` packed
micro-batches of at most `batch_tokens` tokens each; the plan of every step is a pure function of the
seed and the samples' lengths, so a resumed or a multi-GPU run sees exactly the batches of an
uninterrupted single-process run. Losses are normalised by per-step row counts summed over the whole
optimiser step (all micro-batches, all ranks) before backward, so the gradient does not depend on how
the global batch is split.

State lives in `state_dir/<params hash>/ckpt-<step>.safetensors` (model, AdamW moments, RNG states as
tensors; step, scheduler and best score as JSON metadata), written atomically every
`checkpoint_every` steps. Calling `train` again with the same inputs and params resumes from the last
one; other params get another hash folder, so an incompatible state is never resumed and none is lost.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from eagle3build import FORMAT_VERSIONS
from eagle3build.atomic import atomic_path, save_safetensors_atomic, write_json_atomic
from eagle3build.attention.kernel import KERNELS, check_kernel
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.draft.target import TargetHead, load_target_head
from eagle3build.errors import ConfigError, UserError
from eagle3build.shards import HIDDEN_FORMAT, dequantize_fp8, read_meta
from eagle3build.ttt.core import (
    ATTENTION_IMPLS,
    PackedBatch,
    TargetScorer,
    TTTStats,
    make_attention,
    pack,
    pad_batch,
    step_weights,
    summarize,
    ttt_forward,
    weighted_loss,
    with_greedy_in_draft,
    with_loss_rows,
    with_step_rows,
)

DEFAULTS = {
    "lr": 1e-4,
    "min_lr_ratio": 0.1,  # cosine decays to lr * min_lr_ratio
    "warmup_ratio": 0.02,  # share of all steps spent warming up linearly
    "epochs": 2,
    "max_steps": None,  # cap on optimiser steps (None: epochs decide)
    "batch_tokens": 8192,  # tokens packed into one micro-batch (longer samples are truncated)
    "grad_accum": 1,  # micro-batches per rank per optimiser step
    "grad_clip": 0.5,
    "weight_decay": 0.0,
    "ttt_steps": 7,
    "step_weight": 0.8,  # loss weight of TTT step s is step_weight ** s
    "seed": 0,
    "val_fraction": 0.05,  # share of samples held out (deterministic by seed)
    "eval_every": None,  # validation every N steps (None: checkpoint_every) and at the end
    "checkpoint_every": 500,
    "keep_checkpoints": 2,
    "log_every": 10,
    "attention": "auto",  # auto (flex on GPU, sdpa on CPU) | flex | flash | cudnn | sdpa | reference
    "compile": "auto",  # auto (on GPU) | true | false: torch.compile the TTT step (flex, layer, loss)
    "fsdp": False,  # multi-process runs: shard weights, gradients and AdamW moments (FSDP2) instead of DDP
    "init_lm_head_from_target": True,
    # draft shape (None: the target's)
    "num_attention_heads": None,
    "num_key_value_heads": None,
    "head_dim": None,
    "intermediate_size": None,
    "rope_theta": None,
    "max_position_embeddings": None,
    "norm_before_residual": False,
    "hidden_size": None,
}
COMPILE_LENGTH_BUCKETS = 8  # compiled runs pad packed batches to one of this many lengths (each kernel
# compiles once per length, for training and validation: ttt.compiled), each a multiple of 1024 tokens at least


def compile_length_multiple(batch_tokens: int) -> int:
    per_bucket = -(-batch_tokens // COMPILE_LENGTH_BUCKETS)
    return max(1024, -(-per_bucket // 128) * 128)  # flex works in blocks of 128


LOSS_ROWS_MULTIPLE = 128  # compiled runs: loss rows padded to this (the loss is compiled for any count)

MIN_SAMPLE_TOKENS = 3  # x[t+1] input and x[t+2] prediction need at least 3 tokens


def resolve_params(params: dict | None) -> dict:
    params = dict(params or {})
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"train.{unknown[0]}", f"unknown key; known keys: {sorted(DEFAULTS)}")
    p = {**DEFAULTS, **params}
    for key in (
        "batch_tokens",
        "grad_accum",
        "ttt_steps",
        "epochs",
        "checkpoint_every",
        "log_every",
        "keep_checkpoints",
    ):
        if not isinstance(p[key], int) or p[key] < 1:
            raise ConfigError(f"train.{key}", f"must be a positive integer, got {p[key]!r}")
    if not 0 <= float(p["val_fraction"]) < 1:
        raise ConfigError("train.val_fraction", f"must be in [0, 1), got {p['val_fraction']!r}")
    if p["attention"] not in (*ATTENTION_IMPLS, "auto"):
        raise ConfigError(
            "train.attention", f"must be auto or one of {ATTENTION_IMPLS}, got {p['attention']!r}"
        )
    if p["max_steps"] is not None and int(p["max_steps"]) < 1:
        raise ConfigError("train.max_steps", f"must be a positive integer or null, got {p['max_steps']!r}")
    return p


# ============================================================================================ data
@dataclass(frozen=True)
class SampleRef:
    shard: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class HiddenDataset:
    """Samples of hidden shards, read lazily by slicing the memory-mapped safetensors files."""

    def __init__(self, paths: list[str], max_tokens: int):
        if not paths:
            raise UserError("train: no hidden-state shards given; run the extract stage first")
        self.paths = [str(p) for p in paths]
        self.max_tokens = max_tokens
        self.meta = [read_meta(p) for p in self.paths]
        first = self.meta[0]
        for path, meta in zip(self.paths, self.meta, strict=True):
            if meta.get("format") != HIDDEN_FORMAT:
                raise UserError(f"{path}: not a hidden-state shard (format {meta.get('format')!r})")
            for key in ("hidden_size", "layer_ids", "model"):
                if meta.get(key) != first.get(key):
                    raise UserError(
                        f"{path}: {key} {meta.get(key)!r} differs from {self.paths[0]}'s {first.get(key)!r}; "
                        "all shards must come from the same target and layers; rebuild the odd one"
                    )
        self.hidden_size = int(first["hidden_size"])
        self.layer_ids = list(first["layer_ids"])
        self._files: dict[int, object] = {}
        self._lock = threading.Lock()
        self.samples: list[SampleRef] = []
        for i, path in enumerate(self.paths):
            with self._guard(path):
                f = self._file(i)
                cu = f.get_tensor("cu_seqlens").tolist()
                mask = f.get_tensor("loss_mask").bool()
                if cu[-1] != int(f.get_slice("hidden").get_shape()[0]):
                    raise ValueError(
                        f"cu_seqlens ends at {cu[-1]} but hidden has {f.get_slice('hidden').get_shape()[0]} rows"
                    )
            for a, b in zip(cu[:-1], cu[1:], strict=True):
                b = min(b, a + max_tokens)
                if b - a >= MIN_SAMPLE_TOKENS and bool(mask[a + 2 : b].any()):
                    self.samples.append(SampleRef(i, a, b))

    @staticmethod
    def _guard(path):
        class Guard:
            def __enter__(self):
                return self

            def __exit__(self, et, ev, tb):
                if et is not None and not issubclass(et, UserError):
                    raise UserError(
                        f"{path}: corrupted hidden-state shard ({ev}); delete it and rerun extract"
                    ) from ev
                return False

        return Guard()

    def _file(self, shard: int):
        if shard not in self._files:
            self._files[shard] = safe_open(self.paths[shard], framework="pt")
        return self._files[shard]

    def load(self, ref: SampleRef, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the training loop's prefetch thread and the main thread (validation) both read
        with self._lock, self._guard(self.paths[ref.shard]):
            f = self._file(ref.shard)
            ids = f.get_slice("input_ids")[ref.start : ref.end]
            mask = f.get_slice("loss_mask")[ref.start : ref.end]
            hidden = f.get_slice("hidden")[ref.start : ref.end]
            if hidden.dtype == torch.float8_e4m3fn:
                hidden = dequantize_fp8(hidden, f.get_slice("hidden_scale")[ref.start : ref.end], dtype)
            return ids.long(), mask.bool(), hidden.to(dtype)


def split_samples(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/val split of sample indices; keeps at least one training sample."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = min(math.ceil(n * val_fraction), n - 1) if val_fraction > 0 else 0
    return sorted(order[n_val:]), sorted(order[:n_val])


def pack_greedily(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive samples into micro-batches of at most batch_tokens tokens."""
    batches, current, used = [], [], 0
    for i in indices:
        if current and used + lengths[i] > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        batches.append(current)
    return batches


def plan_steps(
    train_idx: list[int], lengths: list[int], p: dict, micro_per_step: int
) -> list[list[list[int]]]:
    """Every optimiser step's micro-batches (lists of sample indices), for all epochs.

    Each epoch reshuffles with seed+epoch; its micro-batches are cycled to fill the last step.
    """
    steps = []
    for epoch in range(p["epochs"]):
        g = torch.Generator().manual_seed(p["seed"] * 1000003 + epoch)
        order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=g).tolist()]
        micro = pack_greedily(order, lengths, p["batch_tokens"])
        n_steps = math.ceil(len(micro) / micro_per_step)
        micro = [micro[i % len(micro)] for i in range(n_steps * micro_per_step)]
        steps += [micro[i * micro_per_step : (i + 1) * micro_per_step] for i in range(n_steps)]
    if p["max_steps"] is not None:
        steps = steps[: int(p["max_steps"])]
    return steps


def read_mapping(path: str, target: TargetHead) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            d2t, t2d = f.get_tensor("d2t").long(), f.get_tensor("t2d").bool()
    except Exception as e:
        raise UserError(
            f"{path}: not a readable vocab mapping with 'd2t' and 't2d' ({e}); rerun the vocab stage"
        ) from e
    if len(t2d) != target.vocab_size:
        raise UserError(
            f"{path}: t2d covers {len(t2d)} ids but the target's vocab_size is {target.vocab_size}; "
            "the mapping was built for another tokenizer; rerun the vocab stage for this target"
        )
    kept = torch.arange(len(d2t)) + d2t
    if (
        len(d2t) == 0
        or kept.min() < 0
        or kept.max() >= len(t2d)
        or not bool(t2d[kept].all())
        or int(t2d.sum()) != len(d2t)
    ):
        raise UserError(
            f"{path}: d2t and t2d disagree (d2t must be offsets to the ids t2d marks); rerun the vocab stage"
        )
    return d2t, t2d


# ============================================================================================ state
def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def params_hash(
    p: dict,
    hidden_paths: list[str],
    mapping_path: str,
    target_config: dict,
    micro_per_step: int,
    target_revision,
) -> str:
    """Identity of a run: what it trains on and how. A resumed run must match it exactly."""
    identity = {
        "format_version": FORMAT_VERSIONS["train"],
        "params": p,
        "micro_batches_per_step": micro_per_step,
        "shards": [[str(x), os.path.getsize(x)] for x in hidden_paths],
        "mapping": _file_digest(mapping_path),
        "target": {k: target_config.get(k) for k in sorted(target_config) if not k.startswith("_")},
        "target_revision": target_revision,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = state
    return out


def save_checkpoint(
    path: Path, step: int, model: Eagle3Draft, optimizer, scheduler, extra: dict, full_state=None
) -> None:
    """Write a checkpoint. `full_state` (FSDP2): the (model tensors, optimiser state) pair that
    `fsdp_full_state` gathered on rank 0; without it the state is read from `model` and `optimizer`."""
    model_tensors, opt_state = full_state or local_full_state(model, optimizer)
    tensors = {f"model.{n}": t.float() for n, t in model_tensors.items()}
    for name, state in opt_state["state"].items():
        for key, value in state.items():
            tensors[f"optim.{name}.{key}"] = value.detach().cpu()
    tensors.update(_rng_tensors())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt_state["param_groups"]]
    sched = scheduler.state_dict()  # lr_lambdas are plain functions: stored as nulls, rebuilt by train()
    meta = {"step": step, "optimizer_groups": groups, "scheduler": sched, **extra}
    save_safetensors_atomic(path, {k: v.contiguous() for k, v in tensors.items()}, meta)


def local_full_state(model: Eagle3Draft, optimizer) -> tuple[dict, dict]:
    """Trainable weights and the optimiser state keyed by parameter name (single process or DDP)."""
    names = {id(p): n for n, p in model.named_parameters()}
    opt_state = optimizer.state_dict()
    param_names = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {param_names[idx]: value for idx, value in opt_state["state"].items()}
    return model.trainable_state_dict(), {"state": state, "param_groups": opt_state["param_groups"]}


FSDP_PREFIX = "draft."  # FSDP2 shards the TTTModule: its parameter names are the draft's behind this


def _fsdp_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def fsdp_full_state(module: nn.Module, optimizer, with_optimizer: bool = True) -> tuple[dict, dict]:
    """Gather the full trainable weights (and optimiser state) of an FSDP2-sharded TTTModule.

    Collective: every rank must call it. Rank 0 gets CPU tensors keyed like `local_full_state`;
    the other ranks get empty dicts.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    full = get_model_state_dict(module, options=_fsdp_options(cpu_offload=True))
    tensors = {n.removeprefix(FSDP_PREFIX): t for n, t in full.items() if n in trainable}
    opt_state = {"state": {}, "param_groups": []}
    if with_optimizer:
        osd = get_optimizer_state_dict(module, optimizer, options=_fsdp_options(cpu_offload=True))
        if osd:
            opt_state = {
                "state": {n.removeprefix(FSDP_PREFIX): v for n, v in osd["state"].items()},
                "param_groups": osd["param_groups"],
            }
    return tensors, opt_state


def load_checkpoint(
    path: Path, model: Eagle3Draft, optimizer, scheduler, expected_hash: str, fsdp_module=None
) -> dict:
    """Restore a checkpoint into `model` and `optimizer`; with `fsdp_module` (the FSDP2-sharded
    TTTModule around `model`; collective, every rank reads the file) each rank keeps its shards."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = {k: _json_or_str(v) for k, v in f.metadata().items()}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise UserError(
            f"{path}: unreadable checkpoint ({e}); delete it to resume from the one before"
        ) from e
    if meta.get("params_hash") != expected_hash:
        raise UserError(
            f"{path}: checkpoint of params hash {meta.get('params_hash')!r}, expected {expected_hash!r}; "
            "it was moved here from another run; delete it"
        )
    trainable = model.trainable_state_dict()
    for name, value in trainable.items():
        stored = tensors.get(f"model.{name}")
        if stored is None or stored.shape != value.shape:
            raise UserError(
                f"{path}: tensor model.{name} is missing or has shape "
                f"{None if stored is None else tuple(stored.shape)} != {tuple(value.shape)}; delete it"
            )
    names = {id(p): n for n, p in model.named_parameters()}
    param_names = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for name in param_names:
        entry = {
            k.rsplit(".", 1)[1]: v
            for k, v in tensors.items()
            if k.startswith(f"optim.{name}.") and k.count(".") == name.count(".") + 2
        }
        if entry:
            state[name] = entry
    if fsdp_module is not None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        # every rank holds the full tensors: each keeps its own shards (no broadcast)
        full = {FSDP_PREFIX + n: tensors[f"model.{n}"] for n in trainable}
        set_model_state_dict(fsdp_module, full, options=_fsdp_options(strict=False))
        groups, start = [], 0
        for group, saved in zip(optimizer.param_groups, meta["optimizer_groups"], strict=True):
            group_names = param_names[start : start + len(group["params"])]
            groups.append({**saved, "params": [FSDP_PREFIX + n for n in group_names]})
            start += len(group["params"])
        osd = {"state": {FSDP_PREFIX + n: v for n, v in state.items()}, "param_groups": groups}
        set_optimizer_state_dict(fsdp_module, optimizer, osd, options=_fsdp_options())
    else:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in trainable:
                    p.copy_(tensors[f"model.{name}"])
        index = {name: i for i, name in enumerate(param_names)}
        groups, start = [], 0
        for group, saved in zip(optimizer.param_groups, meta["optimizer_groups"], strict=True):
            groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        optimizer.load_state_dict({"state": {index[n]: v for n, v in state.items()}, "param_groups": groups})
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.cpu"])
    if torch.cuda.is_available():
        cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    return meta


def _json_or_str(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(run_dir.glob("ckpt-*.safetensors"))
    return found[-1] if found else None


# ============================================================================================ distributed
@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t)
        return t


def init_distributed() -> Dist:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; without them this is one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    return Dist(dist.get_rank(), dist.get_world_size(), local)


class TTTModule(nn.Module):
    """The draft under TTT as one forward(), so DistributedDataParallel can wrap it, and so FSDP2
    (sharding this module as its root) gathers the draft's weights in its pre-forward hook: ttt_forward
    calls the draft's methods (fused_weights, embed_qkv, qkv, finish, logits), never draft.forward."""

    def __init__(self, draft: Eagle3Draft, steps: int, attention, compile: bool = False):
        super().__init__()
        self.draft, self.steps, self.attention, self.compile = draft, steps, attention, compile

    def forward(self, batch: PackedBatch, target_probs: torch.Tensor) -> TTTStats:
        _check_unsharded(self.draft)
        return ttt_forward(self.draft, batch, target_probs, self.steps, self.attention, compile=self.compile)


def _check_unsharded(draft: Eagle3Draft) -> None:
    """Refuse to compute with FSDP2 shards: the weights must be whole (unsharded) inside a step."""
    from torch.distributed.tensor import DTensor

    if isinstance(draft.fc.weight, DTensor):
        raise RuntimeError(
            "the draft's weights are FSDP2 shards here; call the FSDP-wrapped TTTModule "
            "(its forward gathers them) or unshard() it first"
        )


def shard_fsdp2(module: TTTModule, device: torch.device) -> TTTModule:
    """FSDP2 (per-parameter DTensor sharding over all ranks) with the TTTModule as the one root group.

    The root's forward hook all-gathers the trainable weights; they stay whole through backward (FSDP2
    does not reshard the root after forward), then gradients are reduce-scattered (averaged over ranks,
    like DDP) and AdamW updates its shard only. Frozen tensors (the target's embedding) are left
    replicated: sharding them would all-gather them every micro-batch for no optimiser saving.
    Parameters are replaced by DTensors: build the optimiser afterwards.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    frozen = {q for q in module.parameters() if not q.requires_grad}
    return fully_shard(module, mesh=mesh, ignored_params=frozen or None)


# ============================================================================================ training
def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


_GRAD_SCALE_READ: dict[str, bool] = {}


def fused_adamw_reads_grad_scale(device: torch.device) -> bool:
    """Whether a fused AdamW on `device` divides every gradient by `optimizer.grad_scale` before its
    update (the attribute GradScaler unscales through). Checked once per device type on a two-number
    problem: a torch that stopped reading it would clip nothing silently, so there the fold is off and
    clipping runs the usual way."""
    if device.type not in _GRAD_SCALE_READ:
        try:
            # eps = 1 keeps the first update g / (|g| + 1) sensitive to the gradient's scale
            scaled, reference = (torch.ones(2, device=device, requires_grad=True) for _ in range(2))
            for param, grad, scale in ((scaled, [4.0, -2.0], 4.0), (reference, [1.0, -0.5], None)):
                param.grad = torch.tensor(grad, device=device)
                optimizer = torch.optim.AdamW([param], lr=1.0, eps=1.0, weight_decay=0.0, fused=True)
                if scale is not None:
                    optimizer.grad_scale = torch.tensor(scale, device=device)
                optimizer.step()
            _GRAD_SCALE_READ[device.type] = bool(torch.allclose(scaled, reference, rtol=0, atol=1e-6))
        except (RuntimeError, TypeError, ValueError):  # no fused AdamW on this device
            _GRAD_SCALE_READ[device.type] = False
    return _GRAD_SCALE_READ[device.type]


def clipped_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float | None):
    """optimizer.step() with the gradients scaled to a global norm of at most max_norm (none if it is
    0 or None); returns the norm before clipping (None without clipping).

    With a fused AdamW and plain tensors the clip coefficient rides in the optimizer's own pass over the
    gradients (it divides them by `grad_scale` as it reads them), instead of clip_grad_norm_'s separate
    read and write of every gradient: ≈ 1 ms of a 125 ms step at the Llama-8B head shape on an H200.
    FSDP2's sharded gradients (DTensors) and other optimizers clip the usual way.
    """
    if not max_norm:
        optimizer.step()
        return None
    grads = [q.grad for q in params if q.grad is not None]
    fold = (
        optimizer.defaults.get("fused")
        and grads
        and not any(hasattr(g, "full_tensor") for g in grads)
        and fused_adamw_reads_grad_scale(grads[0].device)
    )
    if not fold:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm
    norm = torch.nn.utils.get_total_norm(grads)
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)  # 1 / clip_grad_norm_'s coefficient
    optimizer.step()
    return norm


def _log(msg: str, d: Dist) -> None:
    if d.main:
        print(f"[train] {msg}", file=sys.stderr, flush=True)


def train(
    hidden_paths: list[str],
    mapping_path: str,
    target_path: str,
    out_dir: str,
    state_dir: str,
    params: dict | None = None,
    target_revision=None,
) -> dict:
    """Train a draft head; writes out_dir/{draft.safetensors, summary.json, metrics.jsonl, tb/}.

    Returns the summary. Resumes from state_dir when a checkpoint of the same run exists.
    """
    p = resolve_params(params)
    d = init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{d.local_rank}" if cuda else "cpu")
    data_dtype = torch.bfloat16 if cuda else torch.float32
    attention_impl = p["attention"] if p["attention"] != "auto" else ("flex" if cuda else "sdpa")
    if attention_impl == "flex" and not cuda:
        raise ConfigError(
            "train.attention", "flex attention has no backward on CPU in torch; use sdpa or auto"
        )
    if attention_impl == "cudnn" and not cuda:
        raise ConfigError("train.attention", "cudnn attention needs a GPU; use auto, sdpa or flash")
    if attention_impl in KERNELS:  # torch's private kernel ops: checked against the math before anything loads
        try:
            check_kernel(attention_impl, device)
        except RuntimeError as e:
            raise ConfigError("train.attention", str(e)) from e
    compile_flex = cuda if p["compile"] == "auto" else bool(p["compile"])
    # compiled kernels are specialised to the length: batches padded to a few length buckets, and their
    # step rows rounded to the same buckets
    length_multiple = compile_length_multiple(p["batch_tokens"]) if compile_flex else 1

    # ---- inputs, checked against each other
    target = load_target_head(target_path)
    data = HiddenDataset(hidden_paths, p["batch_tokens"])
    if data.hidden_size != target.hidden_size:
        raise UserError(
            f"{hidden_paths[0]}: hidden_size {data.hidden_size} != the target's {target.hidden_size} "
            f"({target_path}); the shards come from another model; rerun extract"
        )
    if data.layer_ids[-1] != target.num_hidden_layers or len(data.layer_ids) != 4:
        raise UserError(
            f"{hidden_paths[0]}: layer_ids {data.layer_ids} do not end with the target's "
            f"{target.num_hidden_layers} layers ({target_path}); the shards come from another model"
        )
    shard_revision = data.meta[0].get("revision")
    if target_revision and shard_revision and shard_revision != target_revision:
        raise UserError(
            f"{hidden_paths[0]}: extracted from revision {shard_revision}, training against {target_revision}"
        )
    d2t, t2d = read_mapping(mapping_path, target)
    if not data.samples:
        raise UserError(
            f"train: no sample in {len(hidden_paths)} shard(s) (first: {hidden_paths[0]}) has an "
            f"assistant token to predict ({MIN_SAMPLE_TOKENS}+ tokens with loss_mask after position 2)"
        )
    lengths = [s.length for s in data.samples]
    train_idx, val_idx = split_samples(len(data.samples), float(p["val_fraction"]), p["seed"])
    micro_per_step = p["grad_accum"] * d.world_size
    plan = plan_steps(train_idx, lengths, p, micro_per_step)
    total_steps = len(plan)

    fsdp = bool(p["fsdp"]) and d.world_size > 1
    # fsdp off (or one process) hashes as before it existed: older runs still resume
    hashed = p if fsdp else {k: v for k, v in p.items() if k != "fsdp"}
    run_hash = params_hash(hashed, hidden_paths, mapping_path, target.config, micro_per_step, target_revision)
    run_dir = Path(state_dir) / run_hash
    out = Path(out_dir)

    # ---- model, optimiser, schedule
    torch.manual_seed(p["seed"])
    overrides = {k: p[k] for k in DraftConfig.OVERRIDABLE}
    config = DraftConfig.from_target(target, len(d2t), data.layer_ids[:3], overrides)
    draft = Eagle3Draft.from_target(config, target, d2t, t2d, p["init_lm_head_from_target"]).to(device)
    scorer = TargetScorer(target, d2t, t2d, device, data_dtype, compile=compile_flex)
    del target
    attention = make_attention(attention_impl, compile_flex)
    module = TTTModule(draft, p["ttt_steps"], attention, compile_flex)
    if fsdp:
        module = shard_fsdp2(module, device)
    trainable = [q for q in draft.parameters() if q.requires_grad]
    decay = [q for q in trainable if q.dim() >= 2]
    no_decay = [q for q in trainable if q.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": p["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=p["lr"],
        betas=(0.9, 0.95),
        fused=cuda,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total_steps, p["warmup_ratio"], p["min_lr_ratio"])
    )
    if d.world_size > 1 and not fsdp:
        module = nn.parallel.DistributedDataParallel(module, device_ids=[d.local_rank] if cuda else None)

    # ---- resume
    start_step, best = 0, {"score": None, "step": None, "val": None}
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        meta = load_checkpoint(ckpt, draft, optimizer, scheduler, run_hash, module if fsdp else None)
        start_step, best = int(meta["step"]), meta["best"]
        _log(f"resuming {run_dir} at step {start_step}/{total_steps}", d)
    else:
        others = (
            sorted(x.name for x in Path(state_dir).glob("*") if x.is_dir() and x.name != run_hash)
            if Path(state_dir).is_dir()
            else []
        )
        note = f" (checkpoints of other params kept in {state_dir}: {', '.join(others)})" if others else ""
        _log(f"starting fresh: params hash {run_hash}{note}", d)
    metrics_path = run_dir / "metrics.jsonl"
    if d.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(metrics_path, start_step)

    weights = step_weights(p["ttt_steps"], p["step_weight"], device)
    greedy_cache: dict[int, torch.Tensor] = {}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()

    def load_batch(sample_ids: list[int]) -> PackedBatch:
        """Host side of a batch (the prefetch thread runs it): read, pack, pad, pin on GPU runs.

        Everything shaped here needs no GPU value, so making a batch never waits for the GPU.
        """
        batch = pack([data.load(data.samples[i], data_dtype) for i in sample_ids])
        if all(i in greedy_cache for i in sample_ids):  # after the first epoch: travels with the batch
            batch.greedy_in_draft = torch.cat([greedy_cache[i] for i in sample_ids])
        batch = pad_batch(batch, length_multiple)
        batch = with_loss_rows(batch, p["ttt_steps"], LOSS_ROWS_MULTIPLE if compile_flex else 1)
        batch = with_step_rows(batch, length_multiple)
        return batch.pin_memory() if cuda else batch

    def make_batch(sample_ids: list[int], loaded: PackedBatch | None = None) -> PackedBatch:
        batch = (loaded if loaded is not None else load_batch(sample_ids)).to(device)
        if batch.greedy_in_draft is None:  # target argmax over the full vocab: once per sample
            real = sum(lengths[i] for i in sample_ids)  # rows after these are padding
            greedy = scorer.greedy_in_draft(batch.final[:real]).cpu()
            for i, part in zip(sample_ids, greedy.split([lengths[i] for i in sample_ids]), strict=True):
                greedy_cache[i] = part
            padding = greedy.new_zeros(batch.num_tokens - real)
            batch = with_greedy_in_draft(batch, torch.cat([greedy, padding]).to(device))
        return batch

    def evaluate() -> dict | None:
        if not val_idx:
            return None
        draft.eval()
        if fsdp:
            module.unshard()  # ttt_forward below bypasses the FSDP2 hooks: gather the weights for it
        sums = torch.zeros(3, p["ttt_steps"], device=device)
        val_batches = pack_greedily(val_idx, lengths, p["batch_tokens"])
        with torch.no_grad(), autocast:
            for b in val_batches[d.rank :: d.world_size]:
                batch = make_batch(b)
                stats = ttt_forward(
                    draft,
                    batch,
                    scorer.draft_probs(batch.loss_final),
                    p["ttt_steps"],
                    attention,
                    compile=compile_flex,
                )
                sums += torch.stack([stats.loss_sum.float(), stats.correct, stats.count])
        if fsdp:
            module.reshard()
        draft.train()
        d.all_sum(sums)
        return summarize(sums[0], sums[1], sums[2], weights)

    # ---- loop
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    writer = SummaryWriter(str(out / "tb"), purge_step=start_step + 1) if d.main else None
    bar = tqdm(total=total_steps, initial=start_step, desc="train", disable=not d.main, dynamic_ncols=True)
    eval_every = p["eval_every"] or p["checkpoint_every"]
    tokens_seen, window_tokens, window_start = 0, 0, time.perf_counter()
    last = None

    def micro_batches(step: int) -> list[list[int]]:
        return plan[step][d.rank * p["grad_accum"] : (d.rank + 1) * p["grad_accum"]]

    def load_step(step: int) -> list[PackedBatch]:
        return [load_batch(b) for b in micro_batches(step)]

    # One step ahead: the next step's batches are read and packed on the host while this one runs on
    # the GPU (otherwise the GPU waits for the host every step).
    # (its thread pins memory: on this rank's GPU, not on a context it would open on GPU 0)
    prefetch = ThreadPoolExecutor(1, initializer=torch.cuda.set_device, initargs=(device,)) if cuda else ThreadPoolExecutor(1)
    next_loaded = prefetch.submit(load_step, start_step) if start_step < total_steps else None
    for step in range(start_step, total_steps):
        my_micro = micro_batches(step)
        loaded = next_loaded.result()
        if step + 1 < total_steps:
            next_loaded = prefetch.submit(load_step, step + 1)
        batches = [make_batch(b, pre) for b, pre in zip(my_micro, loaded, strict=True)]
        total_count = d.all_sum(sum(b.loss_weight.sum(1) for b in batches).float())
        sums = torch.zeros(3, p["ttt_steps"], device=device)
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1 or d.world_size == 1
            if fsdp:  # FSDP2's no_sync: keep unsharded gradients, reduce-scatter after the last one
                module.set_requires_gradient_sync(sync)
            with nullcontext() if sync or fsdp else module.no_sync(), autocast:
                stats = module(batch, scorer.draft_probs(batch.loss_final))
                # DDP and FSDP average gradients over ranks; the loss is already normalised globally
                loss = weighted_loss(stats, total_count, weights) * d.world_size
            loss.backward()
            sums += torch.stack([stats.loss_sum.detach().float(), stats.correct, stats.count])
        grad_norm = clipped_step(optimizer, trainable, p["grad_clip"])
        if grad_norm is not None and hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        real_tokens = sum(lengths[i] for b in my_micro for i in b)  # padding (compiled runs) not counted
        # one process: no device tensor, so no wait for the GPU here (the host runs ahead into the next step)
        step_tokens = real_tokens if d.world_size == 1 else int(d.all_sum(torch.tensor(float(real_tokens), device=device)))
        tokens_seen += step_tokens
        window_tokens += step_tokens
        bar.update(1)
        done = step + 1
        if done % p["log_every"] == 0 or done == total_steps:
            d.all_sum(sums)
            now = time.perf_counter()
            last = {
                "step": done,
                "split": "train",
                **summarize(sums[0], sums[1], sums[2], weights),
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
            }
            window_tokens, window_start = 0, now
            if d.main:
                _record(last, metrics_path, writer)
                bar.set_postfix(
                    loss=f"{last['loss']:.3f}",
                    acc0=f"{last['step_acc'][0]:.3f}",
                    tau=f"{last['acceptance_length']:.2f}",
                )
        if done % eval_every == 0 or done == total_steps:
            val = evaluate()
            if val is not None and d.main:
                _record({"step": done, "split": "val", **val}, metrics_path, writer)
            score = (
                val["acceptance_length"] if val is not None else float(done)
            )  # no val split: the last step
            if best["score"] is None or score > best["score"]:
                best = {"score": score, "step": done, "val": val}
                # FSDP2: every rank takes part in gathering the weights, rank 0 writes them
                full = fsdp_full_state(module, optimizer, with_optimizer=False)[0] if fsdp else None
                if d.main:
                    save_safetensors_atomic(
                        run_dir / "best.safetensors",
                        _export_tensors(draft, full),
                        {"draft_config": config.to_dict(), "step": done, "val": val},
                    )
        checkpoint = done % p["checkpoint_every"] == 0 or done == total_steps
        full_state = fsdp_full_state(module, optimizer) if checkpoint and fsdp else None  # collective
        if checkpoint and d.main:
            save_checkpoint(
                run_dir / f"ckpt-{done:08d}.safetensors",
                done,
                draft,
                optimizer,
                scheduler,
                {"params_hash": run_hash, "best": best},
                full_state,
            )
            for old in sorted(run_dir.glob("ckpt-*.safetensors"))[: -p["keep_checkpoints"]]:
                old.unlink()
    bar.close()
    prefetch.shutdown()

    summary = {
        "params_hash": run_hash,
        "steps": total_steps,
        "resumed_from_step": start_step,
        "best_step": best["step"],
        "best_val": best["val"],
        "last_train": last,
        "train_samples": len(train_idx),
        "val_samples": len(val_idx),
        "tokens_this_run": tokens_seen,
        "world_size": d.world_size,
        "attention": attention_impl,
        "draft_config": config.to_dict(),
        "params": p,
    }
    if d.main:
        if writer is not None:
            writer.close()
        with atomic_path(out / "draft.safetensors") as tmp:
            shutil.copyfile(run_dir / "best.safetensors", tmp)
        with atomic_path(out / "metrics.jsonl") as tmp:
            shutil.copyfile(metrics_path, tmp)
        write_json_atomic(out / "summary.json", summary)
    if d.world_size > 1:
        dist.barrier()
    return summary


def _export_tensors(draft: Eagle3Draft, trainable: dict | None = None) -> dict[str, torch.Tensor]:
    """Trainable weights (`trainable`: gathered ones, FSDP2) plus d2t/t2d under the EAGLE-3 names, fp32."""
    trainable = draft.trainable_state_dict() if trainable is None else trainable
    tensors = {n: t.float().cpu() for n, t in trainable.items()}
    tensors["d2t"], tensors["t2d"] = draft.d2t.cpu(), draft.t2d.cpu()
    return tensors


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines a killed run wrote after its last checkpoint (they will be written again)."""
    if not path.exists():
        return
    keep = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
    ]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in keep))


def _record(entry: dict, path: Path, writer) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
    if writer is None:
        return
    split, step = entry["split"], entry["step"]
    writer.add_scalar(f"{split}/loss", entry["loss"], step)
    writer.add_scalar(f"{split}/acceptance_length", entry["acceptance_length"], step)
    for s, (loss, acc) in enumerate(zip(entry["step_loss"], entry["step_acc"], strict=True)):
        writer.add_scalar(f"{split}/loss_step{s}", loss, step)
        writer.add_scalar(f"{split}/acc_step{s}", acc, step)
    for key in ("lr", "tokens_per_s", "grad_norm"):
        if entry.get(key) is not None:
            writer.add_scalar(f"{split}/{key}", entry[key], step)
