"""Train the EAGLE-3 draft head on extracted hidden states (training-time test, see eagle3build/ttt/).

`train(...)` is the stage function: set up, then one optimiser step after another. A step consumes
`grad_accum * world_size` packed micro-batches of at most `batch_tokens` tokens each (train/data.py).
Losses are normalised by per-step row counts summed over the whole optimiser step (all micro-batches,
all ranks) before backward, so the gradient does not depend on how the global batch is split. Every
`checkpoint_every` steps the state is saved (train/checkpoint.py); calling `train` again with the same
inputs and params resumes from it.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eagle3build.attention.factory import ATTENTION_IMPLS, make_attention
from eagle3build.attention.kernel import KERNELS, check_kernel
from eagle3build.config import TRAIN_MEMORY_KEYS, resolve_section, section_defaults, train_progress_keys
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.errors import ConfigError, UserError
from eagle3build.train.checkpoint import (
    own_state_dir,
    params_hash,
    release_state_dir,
    resume,
    save_best,
    save_checkpoint,
    write_outputs,
)
from eagle3build.train.data import (
    BatchLoader,
    Prefetcher,
    load_inputs,
    pack_greedily,
    plan_steps,
    split_samples,
)
from eagle3build.train.distributed import (
    Dist,
    TTTModule,
    fsdp_full_state,
    init_distributed,
    shard_fsdp2,
    uses_fsdp,
)
from eagle3build.train.memory import GIB, memory_note
from eagle3build.train.metrics import TrainLog, log
from eagle3build.train.optim import make_optimizer, make_scheduler, optimizer_step
from eagle3build.train.warm_start import head_identity, warm_start
from eagle3build.ttt.batch import PackedBatch
from eagle3build.ttt.forward import ttt_forward
from eagle3build.ttt.loss import Objective, step_loss_weights, summarize, weighted_loss
from eagle3build.ttt.recompute import Recompute
from eagle3build.ttt.scorer import TargetScorer

# The head variants and the loss (docs/TRAINING.md); norm_before_residual is older and always hashed.
HEAD_VARIANT_KEYS = ("norm_before_fc", "fc_norm", "norm_output", "loss", "lk_eta", "freeze_lm_head")


def resolve_params(params: dict | None) -> dict:
    """The `train` config section as the trainer uses it: the keys given over the schema's defaults.
    (`gpus` is the launcher's, train/launch.py.)"""
    p = resolve_section("train", params)
    del p["gpus"]
    if p["attention"] not in (*ATTENTION_IMPLS, "auto"):
        raise ConfigError(
            "train.attention", f"must be auto or one of {ATTENTION_IMPLS}, got {p['attention']!r}"
        )
    return p


def hashed_params(p: dict, fsdp: bool) -> dict:
    """The params a run's identity (its params hash) records. A key at its off value hashes as before
    it existed, so older runs still resume: fsdp off (or one process), init_from unset. A warm start
    records its head's path and file digests: a replaced head starts afresh instead of resuming."""
    # The memory switches change no weight (ttt.recompute): a run resumes across them.
    hashed = {k: v for k, v in p.items() if k not in ("fsdp", "init_from", *TRAIN_MEMORY_KEYS)}
    # Logging and resume-point knobs change no weight: a run resumes across them. They hash at their
    # defaults, so runs that always had the defaults keep their identity.
    defaults = section_defaults("train")
    hashed.update({k: defaults[k] for k in train_progress_keys(p)})
    for key in HEAD_VARIANT_KEYS:  # at the plain head's values: hashed as before the keys existed
        if hashed[key] == defaults[key]:
            del hashed[key]
    if fsdp:
        hashed["fsdp"] = p["fsdp"]
    if p["init_from"]:
        hashed["init_from"] = head_identity(p["init_from"])
    return hashed


def starting_weights(draft: Eagle3Draft, p: dict, d: Dist) -> dict | None:
    """The head `train.init_from` names copied into the draft (a warm start: its report, else None), then
    its lm_head frozen where `train.freeze_lm_head` says."""
    warm = warm_start(draft, p["init_from"]) if p["init_from"] else None
    if warm:
        log(f"warm start from {warm['init_from']}: lm_head {warm['lm_head']}", d)
    if p["freeze_lm_head"]:
        freeze_lm_head(draft, p["init_lm_head_from_target"] or warm is not None)
    return warm


def note_memory(config: DraftConfig, p: dict, device: torch.device, d: Dist) -> None:
    """On a GPU: the step's estimated peak beside the device's memory, and what would fit (train.memory)."""
    if device.type == "cuda":
        device_gib = torch.cuda.get_device_properties(device).total_memory / GIB
        log(memory_note(config, p, device_gib, d.world_size), d)


def gpu_memory_peaks(device: torch.device, d: Dist) -> dict:
    """This process's peak GPU memory over the run (GiB), logged and kept in the summary: what the estimate
    logged before the first step is checked against."""
    peaks = {"peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 2),
             "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 2)}
    log(f"peak GPU memory {peaks['peak_memory_gib']} GiB allocated, {peaks['peak_reserved_gib']} GiB reserved "
        "(rank 0)", d)
    return peaks


def freeze_lm_head(draft: Eagle3Draft, initialised: bool) -> None:
    """train.freeze_lm_head: the draft's lm_head keeps the rows it starts from (set before the optimiser
    and FSDP2 see the parameters: frozen, it gets no AdamW state and stays replicated)."""
    if not initialised:
        raise ConfigError("train.freeze_lm_head", "a frozen lm_head must start from trained rows: set "
                          "train.init_lm_head_from_target: true or train.init_from (a random one would stay random)")
    draft.lm_head.weight.requires_grad_(False)


def choose_attention(name: str, device: torch.device) -> str:
    """The TTT attention `train.attention` names (auto: flex on GPU, sdpa on CPU), checked to run here."""
    cuda = device.type == "cuda"
    impl = name if name != "auto" else ("flex" if cuda else "sdpa")
    if impl == "flex" and not cuda:
        raise ConfigError(
            "train.attention", "flex attention has no backward on CPU in torch; use sdpa or auto"
        )
    if impl in KERNELS:  # torch's private kernel ops: checked against the math before anything loads
        try:
            check_kernel(impl, device)
        except RuntimeError as e:
            raise ConfigError("train.attention", str(e)) from e
    return impl


def forward_backward(
    module: nn.Module,
    batches: list[PackedBatch],
    scorer: TargetScorer,
    weights: torch.Tensor,
    d: Dist,
    fsdp: bool,
    autocast,
) -> torch.Tensor:
    """Accumulate the gradients of one optimiser step's micro-batches on this rank; returns their
    (loss, correct, count) sums per TTT step, [3, k]. `module`: the TTTModule, DDP-wrapped or FSDP2-sharded
    over several processes; `weights` [k]: the TTT steps' loss weights."""
    total_count = d.all_sum(sum(b.loss_weight.sum(1) for b in batches).float())
    sums = torch.zeros(3, len(weights), device=weights.device)
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
    return sums


def check_finite_step(
    step: int, sums: torch.Tensor, grad_norm: torch.Tensor | None, data, sample_ids: list[list[int]], d: Dist
) -> None:
    """Stop at the first optimiser step whose loss or gradient norm is not finite: after one such step
    every weight is NaN, and it would be trained on, saved as the best step and exported. All ranks decide
    alike (the flags are summed over ranks; FSDP2's collectives follow). The error names the hidden shards
    of this rank's batches that hold non-finite states (bit rot: delete and re-extract them), or else says
    the inputs were finite (the run diverged)."""
    bad = (~torch.isfinite(sums)).any().float().reshape(1)
    if grad_norm is not None:
        bad = bad + (~torch.isfinite(grad_norm.detach().float())).float().reshape(1)
    if not d.all_sum(bad).item():
        return
    refs = [data.samples[i] for batch in sample_ids for i in batch]
    rotten = sorted({data.shards[r.shard].path for r in refs
                     if not torch.isfinite(data.load(r, torch.float32)[2]).all()})
    where = f"step {step}: the loss or the gradients are not finite (NaN/inf)"
    if rotten:
        shards = ", ".join(str(x) for x in rotten)
        raise UserError(f"train {where}; hidden shard(s) {shards} hold non-finite hidden states (a corrupted "
                        "file): delete them and run `make run` to extract them again")
    if d.world_size > 1:
        raise UserError(f"train {where} (rank {d.rank}: its batches' hidden states are finite; another "
                        "rank's log names a corrupted shard, if one is)")
    raise UserError(f"train {where}, from finite hidden states: the run diverged; lower train.lr, or set "
                    "train.grad_clip if it is 0")


def evaluate(
    ttt: TTTModule,
    scorer: TargetScorer,
    loader: BatchLoader,
    val_batches: list[list[int]],
    weights: torch.Tensor,
    d: Dist,
    fsdp: bool,
    autocast,
) -> dict | None:
    """Metrics on the held-out samples (each rank takes every world_size-th batch; collective)."""
    if not val_batches:
        return None
    ttt.draft.eval()
    if fsdp:
        ttt.unshard()  # ttt_forward below bypasses the FSDP2 hooks: gather the weights for it
    sums = torch.zeros(3, len(weights), device=weights.device)
    # Gradients stay enabled (none is taken): the training step's compiled kernels serve validation as they
    # are, where under no_grad each would compile again for every batch length (dynamo guards the grad mode).
    with autocast:
        for sample_ids in val_batches[d.rank :: d.world_size]:
            batch = loader.to_device(sample_ids)
            probs = scorer.draft_probs(batch.loss_final)
            stats = ttt_forward(ttt.draft, batch, probs, ttt.steps, ttt.attention, ttt.compile, ttt.objective)
            sums += torch.stack([stats.loss_sum.detach().float(), stats.correct, stats.count])
            del stats  # its autograd graph holds the batch's activations: one batch's at a time, as in training
    if fsdp:
        ttt.reshard()
    ttt.draft.train()
    d.all_sum(sums)
    return summarize(sums[0], sums[1], sums[2], weights)


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
    recompute = Recompute.from_params(p)  # a bad train.activation_checkpointing stops here, before any load
    d = init_distributed()
    own_state_dir(state_dir, d)  # one trainer per state folder: a second one stops here, before it uses it
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{d.local_rank}" if cuda else "cpu")
    data_dtype = torch.bfloat16 if cuda else torch.float32
    attention_impl = choose_attention(p["attention"], device)
    compiled = cuda if p["compile"] == "auto" else bool(p["compile"])

    # ---- data and the plan of every step
    target, data, d2t, t2d = load_inputs(hidden_paths, mapping_path, target_path, target_revision,
                                         p["batch_tokens"])
    train_idx, val_idx = split_samples(len(data.samples), float(p["val_fraction"]), p["seed"])
    micro_per_step = p["grad_accum"] * d.world_size
    plan = plan_steps(train_idx, data.lengths, p, micro_per_step)
    total_steps = len(plan)
    fsdp = uses_fsdp(p, d.world_size)
    run_hash = params_hash(
        hashed_params(p, fsdp), hidden_paths, mapping_path, target.config, micro_per_step, target_revision
    )
    run_dir, out = Path(state_dir) / run_hash, Path(out_dir)

    # ---- model, optimiser, schedule
    torch.manual_seed(p["seed"])
    config = DraftConfig.from_target(
        target, len(d2t), data.layer_ids[:3], {k: p[k] for k in DraftConfig.OVERRIDABLE}
    )
    note_memory(config, p, device, d)  # before the first step and its compilations
    draft = Eagle3Draft.from_target(config, target, d2t, t2d, p["init_lm_head_from_target"]).to(device)
    warm = starting_weights(draft, p, d)  # train.init_from, train.freeze_lm_head
    scorer = TargetScorer(target, d2t, t2d, device, data_dtype, compile=compiled)
    del target
    objective = Objective.from_params(p)
    attention = make_attention(attention_impl, compiled)
    ttt = TTTModule(draft, p["ttt_steps"], attention, compiled, objective, recompute)
    if fsdp:
        ttt = shard_fsdp2(ttt, device)
    optimizer, trainable = make_optimizer(draft, p["lr"], p["weight_decay"], fused=cuda)
    scheduler = make_scheduler(optimizer, total_steps, p["warmup_ratio"], p["min_lr_ratio"])
    module = ttt
    if d.world_size > 1 and not fsdp:
        module = nn.parallel.DistributedDataParallel(ttt, device_ids=[d.local_rank] if cuda else None)
    start_step, best = resume(run_dir, draft, optimizer, scheduler, ttt if fsdp else None, total_steps, d)
    log(f"{torch.get_num_threads()} host thread(s) per rank (OMP_NUM_THREADS; a workflow job's threads)", d)

    # ---- the loop
    weights = step_loss_weights(p["ttt_steps"], p["step_weight"], device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    loader = BatchLoader(data, scorer, device, data_dtype, p["ttt_steps"], compiled, p["batch_tokens"])
    val_batches = pack_greedily(val_idx, data.lengths, p["batch_tokens"])
    report = TrainLog(out, run_dir, start_step, total_steps, d)
    prefetch = Prefetcher(loader, plan, d.rank, p["grad_accum"], start_step)
    eval_every = p["eval_every"] or p["checkpoint_every"]
    for step in range(start_step, total_steps):
        sample_ids, batches = prefetch.step(step)
        sums = forward_backward(module, batches, scorer, weights, d, fsdp, autocast)
        grad_norm = optimizer_step(optimizer, scheduler, trainable, p["grad_clip"])
        report.step_done(sum(data.lengths[i] for b in sample_ids for i in b), device)
        done = step + 1
        check_finite_step(done, sums, grad_norm, data, sample_ids, d)
        if done % p["log_every"] == 0 or done == total_steps:
            report.train(done, sums, weights, scheduler.get_last_lr()[0], grad_norm)
        if done % eval_every == 0 or done == total_steps:
            val = evaluate(ttt, scorer, loader, val_batches, weights, d, fsdp, autocast)
            report.val(done, val)
            # the best step: the highest validation acceptance length (no val split: the last step)
            score = val["acceptance_length"] if val is not None else float(done)
            if best["score"] is None or score > best["score"]:
                best = {"score": score, "step": done, "val": val}
                # FSDP2: every rank takes part in gathering the weights, rank 0 writes them
                gathered = fsdp_full_state(ttt, optimizer, with_optimizer=False)[0] if fsdp else None
                if d.main:
                    save_best(run_dir, draft, config, done, val, gathered)
        if done % p["checkpoint_every"] == 0 or done == total_steps:
            full_state = fsdp_full_state(ttt, optimizer) if fsdp else None  # collective
            if d.main:
                extra = {"params_hash": run_hash, "best": best}
                save_checkpoint(
                    run_dir, done, draft, optimizer, scheduler, extra, p["keep_checkpoints"], full_state
                )
    report.close()
    prefetch.close()

    summary = {
        "params_hash": run_hash,
        "steps": total_steps,
        "resumed_from_step": start_step,
        "best_step": best["step"],
        "best_val": best["val"],
        "last_train": report.last_train,
        "train_samples": len(train_idx),
        "val_samples": len(val_idx),
        "tokens_this_run": report.tokens_seen,
        "world_size": d.world_size,
        "attention": attention_impl,
        "draft_config": config.to_dict(),
        "params": p,
        **({"warm_start": warm} if warm else {}),
        **(gpu_memory_peaks(device, d) if cuda else {}),
    }
    if d.main:
        write_outputs(out, run_dir, summary)
        release_state_dir(state_dir)
    if d.world_size > 1:
        dist.barrier()
    return summary
