"""How many shards each dataset has, known when the DAG is built (so `snakemake -n` lists every job).

Counting a large JSONL takes seconds, and the Snakefile is parsed on every `make` call, so counts are
cached under output_root, keyed by the file's path, size and mtime (and format/split). So are the per-shard
content digests (`shard_digests`): what lets an appended record re-split only the shard it lands in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from pathlib import Path

from eagle3build.atomic import write_json_atomic


def _fingerprint(path: str, fmt: str, split: str | None, revision: str | None = None) -> str:
    key = {"path": path, "format": fmt, "split": split, **({"revision": revision} if revision else {})}
    p = Path(path)
    if p.exists():
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        key["files"] = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return json.dumps(key, sort_keys=True)


def record_count(path: str, fmt: str, split: str | None, cache_dir: str, revision: str | None = None) -> int:
    from eagle3build.data.formats import count_records

    cache_file = Path(cache_dir) / "record-counts.json"
    cache = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        cache = json.loads(cache_file.read_text())
    key = _fingerprint(path, fmt, split, revision)
    if key not in cache:
        cache[key] = count_records(path, fmt, split, revision)
        with contextlib.suppress(OSError):  # a read-only tree still plans, just without the cache
            os.makedirs(cache_dir, exist_ok=True)
            write_json_atomic(cache_file, cache, indent=None)
    return int(cache[key])


def plan_shards(count: int, shard_size: int, max_samples: int | None) -> int:
    """Split shards for a source of `count` records: ceil(min(count, max_samples) / shard_size), and at
    least one, so a source without records still has an (empty) shard for every stage to run on."""
    return max(1, math.ceil((count if max_samples is None else min(count, max_samples)) / shard_size))


def _digests(path: str, split: str | None, shard_size: int, limit: int | None, revision: str | None) -> list[str]:
    """One pass over the records: shard i's digest covers records [i * shard_size, (i + 1) * shard_size)
    below `limit`, each with its index (the split stage numbers records by position)."""
    from eagle3build.data.formats import iter_raw_records

    hashes: list = []
    for index, record in iter_raw_records(path, split, 0, revision):
        if limit is not None and index >= limit:
            break
        while len(hashes) <= index // shard_size:
            hashes.append(hashlib.sha256())
        text = json.dumps(record.data, sort_keys=True, default=str)  # hub rows may hold dates
        hashes[index // shard_size].update(f"{index}\0{text}\n".encode())
    return [h.hexdigest()[:16] for h in hashes]


def shard_digests(path: str, fmt: str, split: str | None, shard_size: int, limit: int | None, cache_dir: str,
                  revision: str | None = None) -> list[str]:
    """Content digests of a dataset's shards (as many as it has records for; a shard without records has
    none). Cached like the counts, one entry per dataset: computed again only after the file changed."""
    cache_file = Path(cache_dir) / "shard-digests.json"
    cache: dict = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        cache = json.loads(cache_file.read_text())
    key = json.dumps([_fingerprint(path, fmt, split, revision), shard_size, limit])
    entry = cache.get(path)
    if not isinstance(entry, dict) or entry.get("key") != key:
        cache[path] = entry = {"key": key, "digests": _digests(path, split, shard_size, limit, revision)}
        with contextlib.suppress(OSError):  # a read-only tree still plans, just without the cache
            os.makedirs(cache_dir, exist_ok=True)
            write_json_atomic(cache_file, cache, indent=None)
    return list(entry["digests"])
