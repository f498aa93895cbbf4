"""The shards of a run: every (token shard, hidden shard) pair the workflow lists at its start
(`write_shard_plan`, in the run dir), and which of them the rest of the run will still extract: what the
disk check (`eagle3build.extraction.disk`) must find room for. Imports no torch (shard jobs read it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from eagle3build.atomic import write_json_atomic

SHARD_PLAN = "extract-shards.json"  # in the run dir: every (token shard, hidden shard) of the run


def write_shard_plan(run_dir: str | os.PathLike, tokens: list[str], hidden: list[str]) -> None:
    """Record every token shard of the run with the hidden shard extracted from it (the workflow's list,
    written at the start of each run)."""
    write_json_atomic(Path(run_dir) / SHARD_PLAN, [list(pair) for pair in zip(tokens, hidden, strict=True)],
                      indent=None)


def planned_shards(run_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """(token shard, hidden shard) of every shard of the run; none when the run recorded no plan."""
    try:
        return [(t, h) for t, h in json.loads((Path(run_dir) / SHARD_PLAN).read_text())]
    except FileNotFoundError:
        return []


def mirrored_shards(tokens_dir: str | os.PathLike, hidden_dir: str | os.PathLike) -> list[tuple[str, str]]:
    """(token shard, hidden shard) for every `<ds>/<shard>.safetensors` under tokens_dir, whose hidden shard
    has the same relative path under hidden_dir."""
    tokens_dir = Path(tokens_dir)
    return [(str(t), str(Path(hidden_dir) / t.relative_to(tokens_dir)))
            for t in tokens_dir.glob("*/*.safetensors")]


def pending_token_shards(shards: Iterable[tuple[str, str]], this_shard: str | None = None) -> list[str]:
    """The token shards (of (token shard, hidden shard) pairs) that exist and whose hidden shard does not
    yet, with this_shard: what the rest of the run will write."""
    pending = {os.path.normpath(this_shard)} if this_shard else set()
    pending.update(os.path.normpath(t) for t, h in shards if not os.path.exists(h) and os.path.exists(t))
    return sorted(pending)


def untokenized_shards(shards: Iterable[tuple[str, str]]) -> int:
    """How many of the run's shards have neither tokens nor hidden states yet (the tokens stage runs beside
    extraction): the disk check counts them at the tokenized shards' mean size."""
    return sum(1 for t, h in shards if not os.path.exists(t) and not os.path.exists(h))
