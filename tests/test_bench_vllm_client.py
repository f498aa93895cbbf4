"""bench/vllm_client_throughput.py end to end on a tiny shard: both sides run, their shards are compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_client_bench_runs_head_and_the_tree_and_finds_their_shards_identical(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm_client_throughput.py"), "--shapes", "smollm2", "--tokens", "2000",
         "--repeat", "1", "--concurrency", "4", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = json.loads(out.read_text())["runs"][0]
    rows = {(r["side"], r["storage"]): r for r in run["rows"]}
    assert set(rows) == {(side, dtype) for side in ("before", "after") for dtype in ("bf16", "fp8")}
    assert all(r["tokens_per_s"] > 0 and r["concurrency"] == 4 for r in rows.values())
    assert rows["after", "bf16"]["identical_to_before"] and rows["after", "fp8"]["identical_to_before"]
    assert rows["after", "bf16"]["bare_engine_tokens_per_s"] > 0
    assert not list((tmp_path / "work").glob("hidden-*"))  # the compared shards are removed
