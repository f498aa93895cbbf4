"""What the trainer reads: the samples of the hidden shards, the vocab mapping, the train/val split, the
plan of every optimiser step's micro-batches, and the batches themselves.

The plan is a pure function of the seed and the samples' lengths, so a resumed or a multi-GPU run sees
exactly the batches of an uninterrupted single-process run. Batches are read and packed on the host one
step ahead of the GPU (`Prefetcher`).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from eagle3build.compilation import COMPILE_LENGTH_BUCKETS
from eagle3build.draft.target import TargetHead, load_target_head
from eagle3build.draft.vocab import read_mapping
from eagle3build.errors import UserError
from eagle3build.shards import HiddenShardReader
from eagle3build.ttt.batch import (
    PackedBatch,
    pack,
    pad_batch,
    with_greedy_in_draft,
    with_loss_rows,
    with_step_rows,
)
from eagle3build.ttt.scorer import TargetScorer

MIN_SAMPLE_TOKENS = 3  # x[t+1] input and x[t+2] prediction need at least 3 tokens
LOSS_ROWS_MULTIPLE = 128  # compiled runs: loss rows padded to this (the loss is compiled for any count)


def compile_length_multiple(batch_tokens: int) -> int:
    per_bucket = -(-batch_tokens // COMPILE_LENGTH_BUCKETS)
    return max(1024, -(-per_bucket // 128) * 128)  # flex works in blocks of 128


# ============================================================================================ samples
@dataclass(frozen=True)
class SampleRef:
    shard: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class HiddenDataset:
    """The trainable samples of hidden shards (eagle3build/shards.py reads them), each cut to `max_tokens`."""

    def __init__(self, paths: list[str], max_tokens: int):
        if not paths:
            raise UserError("train: no hidden-state shards given; run the extract stage first")
        self.shards = [HiddenShardReader(p) for p in paths]
        first = self.shards[0]
        for shard in self.shards:
            for key in ("hidden_size", "layer_ids", "model"):
                if shard.meta.get(key) != first.meta.get(key):
                    raise UserError(
                        f"{shard.path}: {key} {shard.meta.get(key)!r} differs from {first.path}'s "
                        f"{first.meta.get(key)!r}; all shards must come from the same target and layers; "
                        "rebuild the odd one"
                    )
        self.meta = first.meta
        self.hidden_size = int(first.meta["hidden_size"])
        self.layer_ids = list(first.meta["layer_ids"])
        self.samples: list[SampleRef] = []
        for i, shard in enumerate(self.shards):
            cu, mask = shard.cu_seqlens().tolist(), shard.loss_mask().bool()
            for a, b in zip(cu[:-1], cu[1:], strict=True):
                b = min(b, a + max_tokens)
                if b - a >= MIN_SAMPLE_TOKENS and bool(mask[a + 2 : b].any()):
                    self.samples.append(SampleRef(i, a, b))
        self.lengths = [s.length for s in self.samples]

    def load(self, ref: SampleRef, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids int64 [n], loss_mask bool [n], hidden [n, 4, H] in `dtype`) of one sample."""
        ids, mask, hidden = self.shards[ref.shard].rows(ref.start, ref.end, dtype)
        return ids.long(), mask.bool(), hidden

    def load_stored(self, ref: SampleRef) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input_ids, loss_mask, hidden [n, 4, H] as stored, fp32 scales [n, 4] of fp8 rows or None)."""
        ids, mask, hidden, scale = self.shards[ref.shard].stored_rows(ref.start, ref.end)
        return ids.long(), mask.bool(), hidden, scale


def load_inputs(
    hidden_paths: list[str], mapping_path: str, target_path: str, target_revision, max_tokens: int
) -> tuple[TargetHead, HiddenDataset, torch.Tensor, torch.Tensor]:
    """The target's head, the samples and the vocab mapping (d2t, t2d), checked against each other."""
    target = load_target_head(target_path)
    data = HiddenDataset(hidden_paths, max_tokens)
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
    shard_revision = data.meta.get("revision")
    if target_revision and shard_revision and shard_revision != target_revision:
        raise UserError(
            f"{hidden_paths[0]}: extracted from revision {shard_revision}, training against {target_revision}"
        )
    d2t, t2d = read_mapping(mapping_path, target.vocab_size)
    if not data.samples:
        raise UserError(
            f"train: no sample in {len(hidden_paths)} shard(s) (first: {hidden_paths[0]}) has an "
            f"assistant token to predict ({MIN_SAMPLE_TOKENS}+ tokens with loss_mask after position 2)"
        )
    return target, data, d2t, t2d


# ============================================================================================ the plan
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


# ============================================================================================ batches
class BatchLoader:
    """The PackedBatch of a micro-batch (a list of sample indices).

    `load` is the host side (the prefetch thread runs it): read (hidden states as stored), pack, pad, lay
    out the loss and step rows, pin on GPU runs. Nothing shaped there needs a GPU value, so loading a batch
    never waits for the GPU. `to_device` moves it, casts (fp8: dequantizes) the states on the device, and
    adds the target's greedy flags: a full-vocab argmax, computed once per
    sample and kept on the host for later epochs. Compiled kernels are specialised to the length, so
    compiled runs pad batches to a few length buckets and round their step rows to the same buckets.
    """

    def __init__(
        self,
        data: HiddenDataset,
        scorer: TargetScorer,
        device: torch.device,
        dtype: torch.dtype,
        ttt_steps: int,
        compiled: bool,
        batch_tokens: int,
    ):
        self.data, self.scorer, self.device, self.dtype = data, scorer, device, dtype
        self.ttt_steps = ttt_steps
        self.length_multiple = compile_length_multiple(batch_tokens) if compiled else 1
        self.loss_rows_multiple = LOSS_ROWS_MULTIPLE if compiled else 1
        self.greedy: dict[int, torch.Tensor] = {}  # sample index -> bool [length], after its first batch

    def load(self, sample_ids: list[int]) -> PackedBatch:
        stored = [self.data.load_stored(self.data.samples[i]) for i in sample_ids]
        scales = [s for *_, s in stored]
        batch = pack([sample[:3] for sample in stored], None if scales[0] is None else scales)
        if all(i in self.greedy for i in sample_ids):  # after the first epoch: travels with the batch
            batch.greedy_in_draft = torch.cat([self.greedy[i] for i in sample_ids])
        batch = pad_batch(batch, self.length_multiple)
        batch = with_loss_rows(batch, self.ttt_steps, self.loss_rows_multiple)
        batch = with_step_rows(batch, self.length_multiple)
        return batch.pin_memory() if self.device.type == "cuda" else batch

    def to_device(self, sample_ids: list[int], loaded: PackedBatch | None = None) -> PackedBatch:
        batch = (loaded if loaded is not None else self.load(sample_ids)).to(self.device, self.dtype)
        if batch.greedy_in_draft is None:  # target argmax over the full vocab: once per sample
            lengths = [self.data.lengths[i] for i in sample_ids]
            real = sum(lengths)  # rows after these are padding
            greedy = self.scorer.greedy_in_draft(batch.final[:real]).cpu()
            for i, part in zip(sample_ids, greedy.split(lengths), strict=True):
                self.greedy[i] = part
            padding = greedy.new_zeros(batch.num_tokens - real)
            batch = with_greedy_in_draft(batch, torch.cat([greedy, padding]).to(self.device))
        return batch


class Prefetcher:
    """This rank's micro-batches of each planned step, loaded one step ahead: the next step's batches are
    read and packed on the host while this one runs on the GPU (otherwise the GPU waits for the host
    every step). Rank r takes micro-batches [r * grad_accum, (r + 1) * grad_accum) of each step."""

    def __init__(self, loader: BatchLoader, plan: list, rank: int, grad_accum: int, start_step: int):
        self.loader, self.plan, self.rank, self.grad_accum = loader, plan, rank, grad_accum
        if loader.device.type == "cuda":
            # its thread pins memory: on this rank's GPU, not on a context it would open on GPU 0
            self.pool = ThreadPoolExecutor(1, initializer=torch.cuda.set_device, initargs=(loader.device,))
        else:
            self.pool = ThreadPoolExecutor(1)
        self.next = self.pool.submit(self._load, start_step) if start_step < len(plan) else None

    def micro_batches(self, step: int) -> list[list[int]]:
        return self.plan[step][self.rank * self.grad_accum : (self.rank + 1) * self.grad_accum]

    def _load(self, step: int) -> list[PackedBatch]:
        return [self.loader.load(b) for b in self.micro_batches(step)]

    def step(self, step: int) -> tuple[list[list[int]], list[PackedBatch]]:
        """Step `step`'s micro-batches: their sample indices, and the batches on the device."""
        sample_ids = self.micro_batches(step)
        loaded = self.next.result()
        if step + 1 < len(self.plan):
            self.next = self.pool.submit(self._load, step + 1)
        return sample_ids, [self.loader.to_device(b, pre) for b, pre in zip(sample_ids, loaded, strict=True)]

    def close(self) -> None:
        self.pool.shutdown()
