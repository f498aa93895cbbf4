"""Draft vocabulary: top-K by loss-masked counts, ties by id, padding, d2t offsets, identity, coverage."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3build.draft.vocab import build_mapping, count_shard, select_vocab
from eagle3build.errors import UserError
from eagle3build.shards import write_tokens


def test_select_vocab_top_k_ties_by_lower_id_sorted():
    counts = torch.tensor([0, 5, 3, 5, 0, 3, 9, 1])
    # top-4 by count: 6 (9), then 1 and 3 (5, tie -> lower id first), then 2 (3; ties with 5 -> 2 wins)
    assert select_vocab(counts, 4).tolist() == [1, 2, 3, 6]


def test_select_vocab_pads_with_lowest_unused_ids():
    counts = torch.tensor([0, 0, 7, 0, 2, 0])
    assert select_vocab(counts, 4).tolist() == [0, 1, 2, 4]


def test_k_at_least_vocab_is_identity():
    assert select_vocab(torch.tensor([1, 0, 2]), 10).tolist() == [0, 1, 2]


def test_counts_only_loss_masked_tokens_and_mapping_semantics(tmp_path):
    v = 20
    ids = [torch.tensor([1, 2, 2, 7, 7, 7]), torch.tensor([3, 9, 9, 4])]
    masks = [torch.tensor([0, 0, 1, 1, 1, 1]), torch.tensor([1, 1, 1, 0])]  # 1, 3 (partly), 4 are prompt tokens
    write_tokens(tmp_path / "a.safetensors", ids[:1], masks[:1], {})
    write_tokens(tmp_path / "b.safetensors", ids[1:], masks[1:], {})
    for name in "ab":
        count_shard(str(tmp_path / f"{name}.safetensors"), str(tmp_path / f"{name}.counts.safetensors"), v)
    report = build_mapping([str(tmp_path / f"{n}.counts.safetensors") for n in "ab"], str(tmp_path / "map.safetensors"),
                           str(tmp_path / "cov.json"), draft_vocab_size=3, vocab_size=v)
    m = load_file(tmp_path / "map.safetensors")
    kept = [7, 9, 2]  # counts 7:3, 9:2, 2:1, 3:1 -> tie between 2 and 3 goes to 2
    assert m["d2t"].dtype == torch.int64 and m["t2d"].dtype == torch.bool
    draft_ids = torch.arange(3)
    assert (draft_ids + m["d2t"]).tolist() == sorted(kept)  # target_id = draft_id + d2t[draft_id]
    assert torch.nonzero(m["t2d"]).flatten().tolist() == sorted(kept)
    assert report["tokens_counted"] == 7 and report["coverage"] == pytest.approx(6 / 7)
    assert json.loads((tmp_path / "cov.json").read_text())["draft_vocab_size"] == 3


def test_empty_training_set_is_a_clear_error(tmp_path):
    write_tokens(tmp_path / "a.safetensors", [torch.tensor([1, 2])], [torch.tensor([0, 0])], {})
    count_shard(str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors"), 8)
    with pytest.raises(UserError, match="training set is empty"):
        build_mapping([str(tmp_path / "c.safetensors")], str(tmp_path / "m.safetensors"), str(tmp_path / "r.json"), 4, 8)
    assert not (tmp_path / "m.safetensors").exists()


def test_shard_from_another_model_is_named(tmp_path):
    write_tokens(tmp_path / "a.safetensors", [torch.tensor([1, 300])], [torch.tensor([1, 1])], {})
    with pytest.raises(UserError, match=r"a\.safetensors: token id 300 is outside the target vocab of 128"):
        count_shard(str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors"), 128)
    count_shard(str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors"), 512)
    with pytest.raises(UserError, match="counts over a vocab of 512"):
        build_mapping([str(tmp_path / "c.safetensors")], str(tmp_path / "m.safetensors"), str(tmp_path / "r.json"), 4, 128)
