"""Draft vocabulary: count loss-masked token ids per shard, merge, keep the top K.

Counting runs per token shard (cheap, parallel, and independent of K), so changing the draft vocab
size only reruns the merge. The mapping follows EAGLE-3 exactly: top K ids by count (ties by lower id),
padded with the lowest unused ids when fewer than K ids were seen, sorted ascending;
`d2t[i] = kept[i] - i` (an offset: target_id = draft_id + d2t[draft_id]), `t2d[v]` true for kept ids.
K >= V gives the identity mapping.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from eagle3build.atomic import save_safetensors_atomic, write_json_atomic
from eagle3build.errors import UserError
from eagle3build.shards import read_counts, read_tokens, write_counts


def count_shard(tokens_path: str, out_path: str, vocab_size: int) -> int:
    shard = read_tokens(tokens_path)
    ids = shard.input_ids[shard.loss_mask.bool()].long()
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise UserError(f"{tokens_path}: token id {int(ids.max())} is outside the target vocab of {vocab_size}; "
                        f"the shard was tokenized for another model — delete it and rerun")
    counts = torch.bincount(ids, minlength=vocab_size)
    write_counts(out_path, counts, {"tokens": tokens_path})
    return int(ids.numel())


def select_vocab(counts: torch.Tensor, k: int) -> torch.Tensor:
    """Kept target ids, ascending: top-k by count (ties by id), padded with the lowest unused ids."""
    v = counts.numel()
    if k >= v:
        return torch.arange(v)
    # Stable sort on -count keeps the lower id first among equal counts.
    order = torch.sort(-counts, stable=True).indices
    seen = order[counts[order] > 0][:k]
    if seen.numel() < k:
        unused = torch.ones(v, dtype=torch.bool)
        unused[seen] = False
        seen = torch.cat([seen, torch.nonzero(unused).flatten()[: k - seen.numel()]])
    return torch.sort(seen).values


def build_mapping(count_paths: list[str], out_mapping: str, out_report: str, draft_vocab_size: int,
                  vocab_size: int) -> dict:
    total = torch.zeros(vocab_size, dtype=torch.int64)
    for path in count_paths:
        counts, meta = read_counts(path)
        if counts.numel() != vocab_size:
            raise UserError(f"{path}: counts over a vocab of {counts.numel()}, but the target's vocab is "
                            f"{vocab_size}; the shard belongs to another model — delete it and rerun")
        total += counts
    if int(total.sum()) == 0:
        raise UserError(f"no loss-masked tokens in {len(count_paths)} shard(s): the training set is empty "
                        f"(see the tokens/*.json reports for why samples were dropped)")
    k = min(draft_vocab_size, vocab_size)
    kept = select_vocab(total, k)
    d2t = kept - torch.arange(k)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    covered = int(total[kept].sum())
    report = {"draft_vocab_size": k, "vocab_size": vocab_size, "identity": k == vocab_size,
              "tokens_counted": int(total.sum()), "distinct_tokens_seen": int((total > 0).sum()),
              "coverage": covered / int(total.sum()), "shards": len(count_paths)}
    save_safetensors_atomic(out_mapping, {"d2t": d2t.to(torch.int64), "t2d": t2d},
                            {"format": "eagle3build.vocab", "draft_vocab_size": str(k), "vocab_size": str(vocab_size),
                             "coverage": f"{report['coverage']:.6f}"})
    write_json_atomic(out_report, report)
    return report


def read_mapping(path: str, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mapping `build_mapping` wrote: (d2t int64 [K], t2d bool [V]), checked against each other and,
    when given, against the target's vocab size."""
    try:
        with safe_open(str(path), framework="pt") as f:
            d2t, t2d = f.get_tensor("d2t").long(), f.get_tensor("t2d").bool()
    except Exception as e:
        raise UserError(
            f"{path}: not a readable vocab mapping with 'd2t' and 't2d' ({e}); rerun the vocab stage"
        ) from e
    if vocab_size is not None and len(t2d) != vocab_size:
        raise UserError(
            f"{path}: t2d covers {len(t2d)} ids but the target's vocab_size is {vocab_size}; "
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
