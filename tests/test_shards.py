"""Shard formats: streaming writer round trip, atomicity, fp8 layout, corrupted files."""

from __future__ import annotations

import pytest
import torch

from eagle3build.errors import UserError
from eagle3build.shards import HiddenShardWriter, read_hidden, read_meta, read_tokens, write_tokens


def _small():
    ids = torch.arange(12, dtype=torch.int32)
    mask = (ids % 2).to(torch.uint8)
    cu = torch.tensor([0, 5, 12])
    return ids, mask, cu


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_rows_written_in_any_order_round_trip(tmp_path, dtype):
    ids, mask, cu = _small()
    rows = torch.randn(12, 4, 8) * torch.tensor([1.0, 10.0, 100.0, 0.1]).view(1, 4, 1)
    with HiddenShardWriter(tmp_path / "h.safetensors", ids, mask, cu, 8, dtype, {"model": "m"}) as w:
        w.write(5, rows[5:])
        w.write(0, rows[:5])
    s = read_hidden(tmp_path / "h.safetensors")
    assert torch.equal(s.input_ids, ids) and torch.equal(s.loss_mask, mask) and torch.equal(s.cu_seqlens, cu)
    # per-(token, slot) scales keep the relative error small even when slots differ 1000x in magnitude
    rel = ((s.hidden - rows).norm(dim=-1) / rows.norm(dim=-1)).max()
    assert rel < (0.01 if dtype == "bf16" else 0.06)
    assert s.meta["storage_dtype"] == dtype and s.meta["num_tokens"] == 12
    assert list(tmp_path.iterdir()) == [tmp_path / "h.safetensors"]  # no temp file left behind


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_packed_batch_lands_at_each_samples_offset(tmp_path, dtype):
    """write_batch: one packed batch (samples in length order, as the extractor batches them) fills the
    rows of every sample at its own offset; wrong span totals are refused before anything is queued."""
    ids, mask, cu = _small()
    rows = torch.randn(12, 4, 8)
    packed = torch.cat([rows[5:12], rows[0:5]])  # the longer sample first
    with HiddenShardWriter(tmp_path / "h.safetensors", ids, mask, cu, 8, dtype, {}) as w:
        with pytest.raises(ValueError, match="spans cover 11 rows, the batch has 12"):
            w.write_batch([(5, 7), (0, 4)], packed)
        w.write_batch([(5, 7), (0, 5)], packed)
    s = read_hidden(tmp_path / "h.safetensors")
    assert ((s.hidden - rows).norm(dim=-1) / rows.norm(dim=-1)).max() < (0.01 if dtype == "bf16" else 0.06)


def test_incomplete_or_failed_writer_leaves_nothing(tmp_path):
    ids, mask, cu = _small()
    w = HiddenShardWriter(tmp_path / "h.safetensors", ids, mask, cu, 8, "bf16", {})
    w.write(0, torch.randn(5, 4, 8))
    with pytest.raises(RuntimeError, match="7 of 12 token rows were never written"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ZeroDivisionError), HiddenShardWriter(tmp_path / "h.safetensors", ids, mask, cu, 8, "bf16", {}) as w:
        w.write(0, torch.randn(5, 4, 8))
        raise ZeroDivisionError("a failure inside the with block")
    assert list(tmp_path.iterdir()) == []


def test_corrupted_shard_is_named(tmp_path):
    write_tokens(tmp_path / "t.safetensors", [torch.tensor([1, 2, 3])], [torch.tensor([0, 1, 1])], {})
    assert read_tokens(tmp_path / "t.safetensors").num_samples == 1
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "bad.safetensors").write_bytes(data[:20])
    with pytest.raises(UserError, match=r"bad\.safetensors: not a readable safetensors shard"):
        read_meta(tmp_path / "bad.safetensors")
    with pytest.raises(UserError, match="expected a 'eagle3build.hidden' shard"):
        read_hidden(tmp_path / "t.safetensors")
