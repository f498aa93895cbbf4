"""How much GPU memory a training step needs: the estimate that plans long sequences (docs/TRAINING.md,
"Memory"), checked against the measured peaks of bench/train_throughput.py, and the advice training gives
when a configured step would not fit its device."""

from __future__ import annotations

import math

from eagle3build.draft.model import DraftConfig
from eagle3build.train.distributed import uses_fsdp
from eagle3build.ttt.recompute import checkpointed_steps

GIB = 2**30
FIT_SHARE = 0.92  # of the device's memory: the allocator's reserve and fragmentation take the rest


def shape_of(config: DraftConfig) -> dict:
    """The draft's shape in the estimate's terms."""
    return dict(hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim, intermediate=config.intermediate_size, vocab=config.vocab_size,
                draft_vocab=config.draft_vocab_size, aux_norm=config.norm_before_fc or config.fc_norm)


def trainable_weights(shape: dict) -> int:
    """P: fc, the layer (its q/k/v read the embedding and the stream, 2 H wide) and the lm_head."""
    H, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    return 3 * H * H + 2 * H * (q + 2 * kv) + q * H + 3 * H * shape["intermediate"] + shape["draft_vocab"] * H


def memory_estimate(
    shape: dict, T: int, ttt: int, loss_fraction: float = 1.0, checkpointing: bool | int = False, loss_chunk: int = 0,
    frozen_lm_head: bool = False, weight_shards: int = 1,
) -> dict:
    """Estimated peak GPU memory of one training step on one process (GiB, by part): the step under bf16
    autocast, compiled, as training and bench/train_throughput.py run it (docs/TRAINING.md, "Memory"). An
    estimate, to plan runs: the benchmark measures the peak. `shape`: shape_of(DraftConfig) or a preset.

    static: fp32 weights and AdamW moments of the P trainable weights (12 P bytes), their bf16 copy for
      the step (2 P), the frozen embedding (fp32, 4 V H), the scorer's bf16 lm_head (2 V H) and its draft
      rows (2 K H); of the fp32 gradients (4 P) only lm_head's (4 K H) exists at the peak, the start of
      backward: the others are allocated as backward frees activations (the step sets them to None). A
      frozen lm_head (train.freeze_lm_head) has neither AdamW moments nor that gradient. FSDP over
      `weight_shards` processes holds a shard of the trainable weights' share (the frozen ones whole).
    layers: per TTT step, what backward keeps: at each computed row (T at step 0, the M loss rows after)
      its input, attention output, residual sum and gate/up (2 (2 H + nh hd + 2 I) bytes), at every
      token q, output, k, v and the log-sum-exp (2 (2 nh hd + 2 nkv hd) + 4 nh); Inductor recomputes the
      norms, RoPE and SiLU, and the diagonal merge keeps only its inputs (attention.merge). A checkpointed
      step (all of them, or the first N: train.activation_checkpointing) keeps its output and keys/values
      (2 (H + 2 nkv hd)); one step's activations live while backward recomputes it, after the later,
      uncheckpointed steps' are freed. Beside them, backward accumulates the gradients of the keys and
      values that later steps read (step 0's at every token, each diagonal's at its rows: 4 nkv hd bytes
      per row) from the last step's backward until each step's own: with an MHA draft they outweigh what a
      step's rows keep (7.7 GiB at 40,960 tokens for the 64 KV heads × 112 that Kimi's config derives).
    loss: the [M, k, H] states and their normed copy (4 H per row and step) and the [rows, k, K] logits
      with their gradient, bf16 (4 K per row and step), over all M rows or one chunk of loss_chunk.
    data: aux and final states, the embedding half of q/k/v (bf16) and the target distribution (fp32 M K);
      a head with a norm before fc (`aux_norm`: norm_before_fc or fc_norm) adds what its backward keeps of
      the normed aux states, 4 bytes per value (12 H per token: measured 0.10 GiB at SmolLM2's shape and
      16,384 tokens, bench/results/quality_smollm2_ablations.json's train peaks).
    The peak is at the start of backward (the parts above) or at its end, where the k steps' bf16 gradients
    of the per-step weight aliases (ttt.weight_aliases: 2 k P_layer) are held until step 0's backward, beside
    step 0's activations (`backward_end`): with the switches on, at short lengths, the end is the peak.
    """
    H, nh, nkv, hd = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    inter, K, V = shape["intermediate"], shape["draft_vocab"], shape["vocab"]
    q, kv = nh * hd, nkv * hd
    params = trainable_weights(shape)
    trained = 14 * params + 4 * K * H - (12 * K * H if frozen_lm_head else 0)
    static = trained / weight_shards + 4 * V * H + 2 * (V + K) * H
    M = min(T, math.ceil(loss_fraction * T))
    row, token = 2 * (2 * H + q + 2 * inter), 2 * (2 * q + 2 * kv) + 4 * nh
    c = checkpointed_steps(checkpointing, ttt)
    step_rows = [T] + [M] * (ttt - 1)  # rows each step computes
    # Backward meets the steps last to first: the checkpointed first c recompute (one at a time, at most
    # step 0's T rows) after the later steps' activations are freed, so the larger of the two is live.
    kept = sum(step_rows[c:]) * row + (ttt - c) * T * token

    def kv_grads(j):  # bf16 gradients of the keys/values of steps 0..j, all live while step j's attention runs backward
        return 2 * 2 * kv * (T + j * M)

    # the last step's attention backward: its rows' part freed, the k/v gradients of every step there
    in_last = kept - step_rows[-1] * row + kv_grads(ttt - 1) if c < ttt else 0
    in_recomputed = T * (row + token) + kv_grads(c - 1) if c else 0
    layers = sum(step_rows[:c]) * 2 * (H + 2 * kv) + max(kept, in_last, in_recomputed)
    loss = M * ttt * 4 * H + min(M, loss_chunk or M) * ttt * 4 * K
    data = T * (8 * H + 2 * (q + 2 * kv) + (12 * H if shape.get("aux_norm") else 0)) + M * 4 * K
    parts = dict(static=static, layers=layers, loss=loss, data=data)
    aliased = H * (q + 2 * kv) + q * H + 3 * H * inter  # the weights every step's layer reads
    end = static + 2 * ttt * aliased + T * (row + token) + data
    gib = {k: round(v / 2**30, 2) for k, v in parts.items()}
    return {**gib, "backward_end": round(end / 2**30, 2), "total": round(max(sum(parts.values()), end) / 2**30, 2)}


def fitting_switches(shape: dict, T: int, ttt: int, budget_gib: float, frozen_lm_head: bool = False,
                     weight_shards: int = 1, plain: bool = False) -> dict | None:
    """The memory switches (train keys) whose estimate at T tokens, every row with a loss, is within
    `budget_gib`, at the least recomputation: a checkpointed step costs one more forward of the layer, the
    chunked loss one more lm_head forward per step (their FLOPs per row order the options); `plain`: none
    of them is an option too ({} when the step fits as it is). None when nothing fits."""
    H, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    layer = 2 * H * (q + 2 * kv) + q * H + 3 * H * shape["intermediate"]  # multiply-adds per row, one step
    lm_head = ttt * H * shape["draft_vocab"]
    options = [(n * layer + chunk * lm_head, n, chunk) for n in range(ttt) for chunk in (0, 1) if n or chunk or plain]
    for _, n, chunk in sorted(options):
        total = memory_estimate(shape, T, ttt, 1.0, n, 2048 * chunk, frozen_lm_head, weight_shards)["total"]
        if total <= budget_gib:
            switches = {"activation_checkpointing": n} if n else {}
            return switches | ({"loss_chunk_tokens": 2048} if chunk else {}) | {"estimate_gib": total}
    return None


def memory_check(config: DraftConfig, p: dict, device_gib: float, world_size: int = 1) -> tuple[bool, str]:
    """Whether the step's estimated peak at train.batch_tokens fits FIT_SHARE of the device, and the note
    training logs before its first step (the preflight reports it too): the estimate beside the device's
    memory, and, where it would not fit, the train keys that would (or a smaller batch). `world_size`
    processes train with DDP (its gradient buckets on each), or with FSDP (train.fsdp: a shard each); where
    no switch makes a DDP step fit, FSDP is proposed, with the switches it still needs."""
    fsdp = uses_fsdp(p, world_size)
    ddp, fsdp_shards = world_size > 1 and not fsdp, world_size if fsdp else 1
    shape, T, ttt, frozen = shape_of(config), int(p["batch_tokens"]), int(p["ttt_steps"]), p["freeze_lm_head"]
    ddp_gib = 4 * trainable_weights(shape) / GIB if ddp else 0.0  # DDP's gradient buckets exist from the start
    total = memory_estimate(shape, T, ttt, 1.0, p["activation_checkpointing"], p["loss_chunk_tokens"],
                            frozen, fsdp_shards)["total"] + ddp_gib
    note = (f"estimated peak of a step {total:.1f} GiB at train.batch_tokens {T}, every row with a loss (an upper "
            f"bound; docs/TRAINING.md, Memory); the device has {device_gib:.1f} GiB")
    budget = FIT_SHARE * device_gib
    if total <= budget:
        return True, note
    fit = fitting_switches(shape, T, ttt, budget - ddp_gib, frozen, fsdp_shards)
    if fit is None and ddp:  # FSDP's shards of the trained weights' state, with the switches it still needs
        sharded = fitting_switches(shape, T, ttt, budget, frozen, world_size, plain=True)
        fit = None if sharded is None else {"fsdp": "true", **sharded}
    if fit is None:
        return False, f"{note}: it may run out of memory; lower train.batch_tokens"
    keys = ", ".join(f"train.{k}: {v}" for k, v in fit.items() if k != "estimate_gib")
    how = ["the weights' state sharded over the processes"] if "fsdp" in fit else []
    how += ["some recomputation in backward"] if set(fit) - {"fsdp", "estimate_gib"} else []
    estimate = fit["estimate_gib"] + (0.0 if "fsdp" in fit else ddp_gib)  # FSDP has no DDP gradient buckets
    return False, (f"{note}: it may run out of memory; set {keys} (estimate {estimate:.1f} GiB: "
                   f"the same weights, {' and '.join(how)}) or lower train.batch_tokens")


def memory_note(config: DraftConfig, p: dict, device_gib: float, world_size: int = 1) -> str:
    """What training logs before its first step (memory_check's note)."""
    return memory_check(config, p, device_gib, world_size)[1]
