"""The run-wide disk check of extraction: before a shard job writes, the disk must hold every shard of
the run not yet extracted (both backends; `eagle3build.extraction.plan.pending_token_shards` lists them).
A shard whose tokens are not written yet (the tokens stage still runs beside extraction) counts at the
mean size of the tokenized ones, so a run that cannot fit stops at its first extraction job, not halfway.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from eagle3build.errors import UserError
from eagle3build.shards import hidden_bytes_per_token, read_meta


def check_disk(out_path: str, tokens_paths: list[str], hidden_size: int, storage_dtype: str,
               reserve_gb: float, untokenized: int = 0) -> int:
    """Refuse (UserError) unless the disk holds every listed, not yet extracted shard, and `untokenized`
    more at the listed ones' mean token count. Returns the bytes needed."""
    per_token = hidden_bytes_per_token(hidden_size, storage_dtype)
    need = tokens_to_extract(tokens_paths, untokenized) * per_token
    folder = Path(out_path).parent
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    reserve = int(reserve_gb * 1e9)
    if need + reserve > free:
        estimated = f", {untokenized} of them not tokenized yet and estimated" if untokenized else ""
        raise UserError(f"{folder}: extraction needs {need / 1e9:.2f} GB for {len(tokens_paths) + untokenized} "
                        f"shard(s){estimated} ({per_token} bytes/token, {storage_dtype}) + {reserve_gb} GB "
                        f"reserve, but only {free / 1e9:.2f} GB is free. Free space, move output_root, or set "
                        f"extract.storage_dtype: fp8 (halves the bytes)")
    return need


def tokens_to_extract(tokens_paths: list[str], untokenized: int = 0) -> int:
    """The tokens of the listed token shards, plus `untokenized` more shards at their mean count: what the
    rest of the run extracts (the doctor's disk row and the jobs' check read the same figure)."""
    tokens = sum(_num_tokens(p, *_version(p)) for p in tokens_paths)
    if tokens_paths and untokenized:
        tokens += untokenized * tokens // len(tokens_paths)
    return tokens


def _version(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


@functools.cache
def _num_tokens(path: str, mtime_ns: int, size: int) -> int:
    """A token shard's token count, read once per version of the file: the server checks the disk for every
    pending shard before each job's shard (a stat per shard once cached, instead of a header read)."""
    return int(read_meta(path)["num_tokens"])
