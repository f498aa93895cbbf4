"""Several processes: who this one is (`Dist`), the draft under TTT as one module DDP or FSDP2 can wrap
(`TTTModule`), and FSDP2's sharding and the gathering of its shards for checkpoints.

torchrun starts one process per GPU (train/launch.py); the sums every rank contributes (loss rows,
metrics, tokens) go through `Dist.all_sum`, so one process is the same code with nothing to sum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from eagle3build.draft.model import Eagle3Draft
from eagle3build.ttt.batch import PackedBatch
from eagle3build.ttt.forward import ttt_forward
from eagle3build.ttt.loss import TTTStats

FSDP_PREFIX = "draft."  # FSDP2 shards the TTTModule: its parameter names are the draft's behind this


@dataclass
class Dist:
    """This process's place among the workers (the defaults: the only one)."""

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


def uses_fsdp(p: dict, world_size: int) -> bool:
    """Whether training shards its weights with FSDP: train.fsdp, where more than one process trains (one
    process keeps plain weights)."""
    return bool(p["fsdp"]) and world_size > 1


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

    def __init__(
        self, draft: Eagle3Draft, steps: int, attention, compile: bool = False, objective=None, recompute=None
    ):
        super().__init__()
        self.draft, self.steps, self.attention, self.compile = draft, steps, attention, compile
        self.objective = objective  # ttt.loss.Objective (train.loss); None: forward KL
        self.recompute = recompute  # ttt.recompute.Recompute (train's memory switches); None: keep all

    def forward(self, batch: PackedBatch, target_probs: torch.Tensor) -> TTTStats:
        check_unsharded(self.draft)
        return ttt_forward(
            self.draft, batch, target_probs, self.steps, self.attention, self.compile, self.objective,
            self.recompute,
        )


def check_unsharded(draft: Eagle3Draft) -> None:
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


def _full_state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def fsdp_full_state(module: nn.Module, optimizer, with_optimizer: bool = True) -> tuple[dict, dict]:
    """Gather the full trainable weights (and optimiser state) of an FSDP2-sharded TTTModule.

    Collective: every rank must call it. Rank 0 gets CPU tensors keyed like
    `checkpoint.local_full_state`; the other ranks get empty dicts.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    full = get_model_state_dict(module, options=_full_state_options(cpu_offload=True))
    tensors = {n.removeprefix(FSDP_PREFIX): t for n, t in full.items() if n in trainable}
    opt_state = {"state": {}, "param_groups": []}
    if with_optimizer:
        osd = get_optimizer_state_dict(module, optimizer, options=_full_state_options(cpu_offload=True))
        if osd:
            opt_state = {
                "state": {n.removeprefix(FSDP_PREFIX): v for n, v in osd["state"].items()},
                "param_groups": osd["param_groups"],
            }
    return tensors, opt_state


def load_fsdp_state(
    module: nn.Module, optimizer, weights: dict, state: dict, groups: list[tuple[dict, list[str]]]
) -> None:
    """Load full tensors into an FSDP2-sharded TTTModule: each rank keeps its own shards (every rank
    holds the full tensors, so nothing is broadcast). `weights` and `state` (the optimiser's) are keyed
    by the draft's parameter names; `groups` pairs each optimiser group's saved settings with its names."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    full = {FSDP_PREFIX + n: t for n, t in weights.items()}
    set_model_state_dict(module, full, options=_full_state_options(strict=False))
    param_groups = [{**saved, "params": [FSDP_PREFIX + n for n in names]} for saved, names in groups]
    osd = {"state": {FSDP_PREFIX + n: v for n, v in state.items()}, "param_groups": param_groups}
    set_optimizer_state_dict(module, optimizer, osd, options=_full_state_options())
