"""Shard formats: streaming writer round trip, atomicity, fp8 layout, corrupted files."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from eagle3build.errors import UserError
from eagle3build.shards import (
    HiddenShardReader,
    HiddenShardWriter,
    read_hidden,
    read_meta,
    read_tokens,
    write_tokens,
)


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


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_sample_reader_reads_what_the_whole_shard_holds(tmp_path, dtype):
    """HiddenShardReader (the trainer reads each sample through it, memory-mapped) gives a sample's rows
    with the values and dtypes read_hidden gives for the whole shard."""
    ids, mask, cu = _small()
    with HiddenShardWriter(tmp_path / "h.safetensors", ids, mask, cu, 8, dtype, {"model": "m"}) as w:
        w.write(0, torch.randn(12, 4, 8))
    whole = read_hidden(tmp_path / "h.safetensors", dtype=torch.bfloat16)
    reader = HiddenShardReader(tmp_path / "h.safetensors")
    assert reader.meta == whole.meta
    assert torch.equal(reader.cu_seqlens(), cu) and torch.equal(reader.loss_mask(), whole.loss_mask)
    sample = reader.rows(5, 12, torch.bfloat16)
    for got, expected in zip(sample, (whole.input_ids[5:], whole.loss_mask[5:], whole.hidden[5:]), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_samples_past_the_shards_rows_are_a_corrupted_shard(tmp_path):
    """cu_seqlens must end at the shard's last row: a shard whose samples run past it is named corrupted."""
    ids, mask, cu = _small()
    path = tmp_path / "h.safetensors"
    with HiddenShardWriter(path, ids, mask, cu, 8, "bf16", {}) as w:
        w.write(0, torch.randn(12, 4, 8))
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    start = 8 + header_len + json.loads(data[8 : 8 + header_len])["cu_seqlens"]["data_offsets"][0]
    data[start + 16 : start + 24] = struct.pack("<q", 13)  # cu_seqlens [0, 5, 13]: one row more than written
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"h\.safetensors: corrupted hidden-state shard \(cu_seqlens ends at 13"):
        HiddenShardReader(path).cu_seqlens()


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


def test_metadata_text_that_reads_as_json_comes_back_as_text(tmp_path):
    """A params hash of digits and one 'e' ("1436699310444e26") is a number to json.loads: once stored raw it
    read back as 1.4e38 and a resumed trainer refused its own checkpoint. Such text is stored quoted; plain
    text stays raw (transformers reads "format": "pt" as is); other values round-trip as JSON."""
    from safetensors import safe_open

    from eagle3build.atomic import save_safetensors_atomic
    from eagle3build.shards import read_meta

    meta = {"params_hash": "1436699310444e26", "flag": "true", "quoted": '"x"', "format": "pt", "step": 3,
            "val": {"tau": 2.5}, "none": None}
    path = tmp_path / "m.safetensors"
    save_safetensors_atomic(path, {"x": torch.zeros(1)}, meta)
    assert read_meta(path) == meta
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
