"""Cheap fingerprints of what the jobs read but Snakemake cannot track well, computed once per DAG build.

Snakemake reruns a job when a param changes, when an input is newer than its outputs (unless the input is
under 1 MB and its checksum did not change) or when its *set* of input files changes. Three things the
jobs read escape that: the target's weights and tokenizer files (the jobs get the folder's path, and a
weight edited in place keeps its path), and the content of a dataset (a touched file over 1 MB looks
changed, a file edited inside a folder input does not).

Each is fingerprinted here, cheaply at any shard count (once per DAG build, never per job), by content, so
that a copy with new mtimes (a build moved to another host, the model downloaded again) plans nothing:
tokenizer files and datasets by a hash of their content, weight files by name, size, a hash of their
safetensors header and a hash of blocks sampled evenly over their data (`WEIGHT_SAMPLES`; never all of a
600 GB target's gigabytes). Dataset and weight hashes are cached by path, size and mtime, so a file is read
again only after a touch or an edit.

How a fingerprint reaches the rules without rebuilding existing trees: the first fingerprint seen for a
target folder or dataset is recorded as its baseline (under output_root/.fingerprints); while the
fingerprint equals it, the rules get no extra param (their params are what they always were, so a tree
built before fingerprints existed plans nothing). Once it differs, its digest becomes a param of the rules
that read it, which reruns them and all that follows; going back to the baseline content reruns them again
(their outputs were made from the other content). Adding the fingerprint as an input file instead would
change the recorded set of inputs of every existing output, and Snakemake's `input` trigger would then redo
every extraction once.

A dataset's content reaches its split rule shard by shard (`shard_changes`): the baseline also records the
content digest of each shard, and once the dataset differs only the shards whose records differ get their
own digest as a param. Appending a record re-splits (and re-extracts) the last shard, not all of them.

`shard_image` reads back what a hidden shard records of the engine image that made it, for a run that
names no image of its own (rules/common.smk `extract_image`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

from eagle3build.atomic import write_json_atomic

# What a tokenizer is made of on disk (transformers' file names, tiktoken/sentencepiece models, the chat
# template files and the remote code of tokenizers loaded with trust_remote_code).
TOKENIZER_PATTERNS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "tiktoken.model",
    "*.tiktoken",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenization_*.py",
)
# What else decides the hidden states besides the weights: the model's config and its remote code.
MODEL_PATTERNS = ("config.json", "configuration_*.py", "modeling_*.py")
_CHUNK = 1 << 20
# A weight file's data is sampled as this many blocks of WEIGHT_BLOCK bytes spread evenly over it (16 MiB per
# file; a file's whole data where it is smaller): a copy reads 1 GiB of a 64-shard target, once. An in-place
# rewrite with new values (a fine-tune, another quantization) changes the samples; an edit confined to the
# bytes between two samples (a few MB apart in a 5 GB shard) is not seen (docs/DESIGN.md, "Staleness").
WEIGHT_SAMPLES, WEIGHT_BLOCK = 1024, 16 << 10


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes | str:
    """The header (tensor names, dtypes, shapes, offsets, metadata): kilobytes, whatever the file's size;
    "short" or "invalid" where the file has none."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return "short"
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * _CHUNK:  # not a safetensors header: the size and mtime still fingerprint the file
            return "invalid"
        return f.read(size)


def _safetensors_header_hash(path: Path) -> str:
    header = _safetensors_header(path)
    return header if isinstance(header, str) else hashlib.sha256(header).hexdigest()


def _sampled_hash(path: Path) -> str:
    """A hash of WEIGHT_SAMPLES blocks spread evenly over the file (all of it where it is smaller)."""
    size = path.stat().st_size
    if size <= WEIGHT_SAMPLES * WEIGHT_BLOCK:
        return _sha256_file(path)
    h, stride = hashlib.sha256(), (size - WEIGHT_BLOCK) / (WEIGHT_SAMPLES - 1)
    with open(path, "rb") as f:
        for i in range(WEIGHT_SAMPLES):  # the first block and the last included
            f.seek(int(i * stride))
            h.update(f.read(WEIGHT_BLOCK))
    return h.hexdigest()


def _cached_hashes(files: list[Path], cache_dir: str | None, compute: Callable[[Path], str]) -> list[str]:
    """compute(f) of each file, cached by path, size and mtime in cache_dir (None: no cache), so that a file
    is read again only after it was touched or rewritten."""
    cache_file = Path(cache_dir) / "content-digests.json" if cache_dir else None
    cache: dict = {}
    if cache_file:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            cache = json.loads(cache_file.read_text())
    result, changed = [], False
    for f in files:
        st = f.stat()
        key = f"{f}\0{st.st_size}\0{st.st_mtime_ns}"
        if key not in cache:
            for stale in [k for k in cache if k.startswith(f"{f}\0")]:  # the file's earlier versions
                del cache[stale]
            cache[key], changed = compute(f), True
        result.append(cache[key])
    if changed and cache_file:
        with contextlib.suppress(OSError):  # a read-only tree still plans, just without the cache
            os.makedirs(cache_file.parent, exist_ok=True)
            write_json_atomic(cache_file, cache, indent=None)
    return result


def shard_image(path: str) -> str:
    """The engine image a hidden shard records in its metadata (`image`, written by the job that extracted
    it): "" where it records none, or where there is no readable shard. One header read per shard."""
    try:
        header = _safetensors_header(Path(path))
        meta = json.loads(header).get("__metadata__") if isinstance(header, bytes) else None
    except (OSError, ValueError, AttributeError):  # absent, unreadable or not a JSON object
        return ""
    image = meta.get("image") if isinstance(meta, dict) else None
    return image if isinstance(image, str) else ""


def _matching(folder: Path, patterns: tuple[str, ...]) -> list[Path]:
    return sorted({p for pattern in patterns for p in folder.glob(pattern) if p.is_file()})


def tokenizer_fingerprint(model: str) -> dict | None:
    """Content hashes of a local target folder's tokenizer files (None for a hub id: its revision pins it)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    return {p.name: _sha256_file(p) for p in _matching(folder, TOKENIZER_PATTERNS)}


def weights_fingerprint(model: str, cache_dir: str | None = None) -> dict | None:
    """A local target folder's weights: name, size, header hash and sampled-data hash of each safetensors
    file (the last cached in cache_dir by size and mtime), and the content hash of its config and modeling
    code. None for a hub id (its revision pins it)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    paths = sorted(folder.glob("*.safetensors"))
    sampled = _cached_hashes(paths, cache_dir, _sampled_hash)
    weights = {p.name: [p.stat().st_size, _safetensors_header_hash(p), h] for p, h in zip(paths, sampled, strict=True)}
    files = {p.name: _sha256_file(p) for p in _matching(folder, MODEL_PATTERNS)}
    return {"weights": weights, "files": files}


def dataset_fingerprint(path: str, cache_dir: str) -> dict | None:
    """Content hashes of a local dataset file or of every file of a dataset folder (None for hf: ids).

    Hashes are cached by path, size and mtime, so a dataset is read again only after it was touched."""
    source = Path(path)
    if str(path).startswith("hf:") or not source.exists():
        return None
    files = sorted(f for f in source.rglob("*") if f.is_file()) if source.is_dir() else [source]
    hashes = _cached_hashes(files, cache_dir, _sha256_file)
    return {str(f.relative_to(source)) if source.is_dir() else f.name: h for f, h in zip(files, hashes, strict=True)}


def digest(fingerprint) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def _record(state_dir: str, kind: str, key: str) -> Path:
    return Path(state_dir) / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _record_baseline(record: Path, kind: str, key: str, fingerprint) -> None:
    """Write `fingerprint` as the baseline of (kind, key); a read-only tree plans as if it were written."""
    with contextlib.suppress(OSError):
        os.makedirs(record.parent, exist_ok=True)
        write_json_atomic(record, {"kind": kind, "key": key, "digest": digest(fingerprint), "fingerprint": fingerprint})


def change_since_baseline(state_dir: str, kind: str, key: str, fingerprint) -> str | None:
    """None while `fingerprint` is the first one recorded for (kind, key) (recording it if none was);
    otherwise its digest, for the params of the rules that read what it fingerprints."""
    if fingerprint is None:
        return None
    current = digest(fingerprint)
    record = _record(state_dir, kind, key)
    try:
        baseline = json.loads(record.read_text())["digest"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        _record_baseline(record, kind, key, fingerprint)
        return None
    return None if baseline == current else current


def weights_change(state_dir: str, model: str, cache_dir: str) -> str | None:
    """change_since_baseline of the target's weights_fingerprint. A baseline of the earlier form (each file's
    size, mtime and header hash: a tree built before weights were sampled) that the folder still matches
    file for file is the same content: it is recorded again in the sampled form rather than taken as a
    change, so such a tree plans nothing."""
    fingerprint = weights_fingerprint(model, cache_dir)
    if fingerprint is None:
        return None
    record = _record(state_dir, "weights", model)
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, AttributeError, OSError):
        old = json.loads(record.read_text())["fingerprint"]
        legacy = old["weights"] and all(isinstance(v[1], int) for v in old["weights"].values())
        if legacy and old["files"] == fingerprint["files"] and old["weights"] == {
            p.name: [p.stat().st_size, p.stat().st_mtime_ns, _safetensors_header_hash(p)]
            for p in sorted(Path(model).glob("*.safetensors"))
        }:
            _record_baseline(record, "weights", model, fingerprint)
    return change_since_baseline(state_dir, "weights", model, fingerprint)


def _padded(digests: list[str], count: int) -> list[str]:
    return digests + [""] * (count - len(digests))  # a shard without records (an empty dataset's one shard)


def shard_changes(state_dir: str, key: str, settings: dict, changed: bool, count: int,
                  digests: Callable[[], list[str]]) -> tuple[int, dict[int, str]]:
    """(the shard count recorded with the baseline, {shard: content digest} of the shards that differ from it).

    `changed`: whether the dataset's fingerprint differs from its baseline (`change_since_baseline`);
    `digests()` the current per-shard digests, called only when they are needed: to record the baseline
    (once per dataset and `settings`, the shard size and sample limit) or while the dataset differs. While it
    is its baseline, no shard differs and the count is the current one. A dataset that changed before its
    shards had a baseline has every shard differ."""
    record = Path(state_dir) / f"shards-{hashlib.sha256(json.dumps([key, settings]).encode()).hexdigest()[:16]}.json"
    try:
        baseline = json.loads(record.read_text())
        base_count, base_digests = int(baseline["count"]), list(baseline["digests"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        baseline = None
    if not changed:
        if baseline is None:
            with contextlib.suppress(OSError):  # a read-only tree plans as if this were the baseline
                os.makedirs(state_dir, exist_ok=True)
                write_json_atomic(record, {"key": key, "settings": settings, "count": count,
                                           "digests": _padded(digests(), count)}, indent=None)
        return count, {}
    current = _padded(digests(), count)
    if baseline is None:
        return count, dict(enumerate(current[:count]))
    return base_count, {
        i: d for i, d in enumerate(current[:count]) if i >= len(base_digests) or base_digests[i] != d
    }
