"""bench/train_throughput.py (and bench/train_vs_peers.sh, which runs it beside the peers): its CPU smoke run
with the memory switches, its --dry memory plan at the Kimi shape, and the memory estimate against the peaks
the GPU runs recorded; bench/loss_kernels.py's CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
import train_throughput as bench  # noqa: E402


def run_bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(BENCH / "train_throughput.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_smoke_run_with_both_memory_switches_trains_and_matches_the_dense_path(tmp_path):
    """The tiny head on CPU with checkpointed steps and a chunked loss: the step runs, the loss falls, the
    fast path with the switches gives the dense path's losses and gradients, and the result records them."""
    out = tmp_path / "r.json"
    run_bench(tmp_path, "--preset", "tiny", "--device", "cpu", "--seq", "64", "--warmup", "2", "--steps", "2",
              "--variants", "flex-only", "--check-seq", "64", "--activation-checkpointing",
              "--loss-chunk-tokens", "16", "--lr", "1e-2", "--out", str(out))
    (run,) = json.loads(out.read_text())["runs"]
    (result,) = run["results"]
    assert result["ok"] and result["activation_checkpointing"] and result["loss_chunk_tokens"] == 16
    assert result["losses"][-1] < result["losses"][0]
    check = result["check_vs_dense_sdpa"]
    assert check["max_step_loss_rel_diff"] < 1e-5 and check["max_grad_rel_diff"] < 1e-4
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"]
    assert set(result["peak_estimate_gib"]) == {"static", "layers", "loss", "data", "backward_end", "total"}


def test_a_frozen_lm_head_trains_the_rest_and_counts_its_flops_as_speculators_does(tmp_path):
    """--freeze-lm-head (train.freeze_lm_head): the step runs and learns without the lm_head's weight
    gradient, which the FLOPs count and the memory estimate leave out (peer-train-bench counts speculators'
    frozen lm_head the same way)."""
    out = tmp_path / "r.json"
    run_bench(tmp_path, "--preset", "tiny", "--device", "cpu", "--seq", "64", "--warmup", "2", "--steps", "2",
              "--variants", "flex-only", "--check-seq", "64", "--freeze-lm-head", "--lr", "1e-2", "--out", str(out))
    (result,) = json.loads(out.read_text())["runs"][0]["results"]
    assert result["ok"] and result["freeze_lm_head"] and result["losses"][-1] < result["losses"][0]
    assert result["check_vs_dense_sdpa"]["max_grad_rel_diff"] < 1e-4
    shape, ttt = bench.PRESETS["tiny"], result["ttt"]
    trained = bench.flops_per_token(shape, 64, ttt)
    assert result["flops"]["flops_per_token"] == trained["flops_per_token"] - ttt * trained["parts"]["lm_head_per_step"]
    kimi = bench.PRESETS["kimi"]
    saved = bench.memory_estimate(kimi, 4096, 7)["static"] - bench.memory_estimate(kimi, 4096, 7, frozen_lm_head=True)["static"]
    assert abs(saved - 12 * kimi["draft_vocab"] * kimi["hidden"] / 2**30) < 0.02  # AdamW moments, fp32 gradient


def test_dry_run_prints_the_kimi_memory_plan_without_running(tmp_path):
    proc = run_bench(tmp_path, "--preset", "kimi", "--seq", "4096", "8192", "16384", "--dry", "--device", "cpu")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["T"] for r in rows] == [4096, 8192, 16384]
    for r in rows:  # each switch lowers the estimate, both most, down to the backward's end (the gradients)
        assert r["estimate_both_gib"] <= min(r["estimate_checkpointing_gib"], r["estimate_chunked_loss_gib"])
        assert max(r["estimate_checkpointing_gib"], r["estimate_chunked_loss_gib"]) < r["estimate_plain_gib"]
        assert r["estimate_both_gib"] >= r["peak_estimate_gib"]["backward_end"]
    assert rows[-1]["estimate_both_gib"] < min(rows[-1]["estimate_checkpointing_gib"],
                                               rows[-1]["estimate_chunked_loss_gib"])
    assert rows[-1]["estimate_both_gib"] < 80e9 / 2**30 < bench.memory_estimate(bench.PRESETS["kimi"], 32768, 7)["total"]


@pytest.mark.parametrize("preset, T, switches, measured_gib, stacks", [
    ("llama8b", 2048, (False, 0), 12.5, True),  # H200, c8c489b (in git's history of train_throughput.json)
    ("llama8b", 4096, (False, 0), 16.21, True),
    ("llama8b", 4096, (False, 0), 15.84, False),  # H200, bench/results/train_throughput.json
    ("kimi", 4096, (False, 0), 29.5, True),  # H200, 2026-12-05 (docs/TRAINING.md, Memory)
    ("kimi", 8192, (False, 0), 39.31, True),  # H100 and H200, bench/results/train_throughput_kimi.json
    ("kimi_derived", 4096, (False, 0), 35.14, True),  # H200, bench/results/train_throughput_kimi_derived.json
    ("kimi_derived", 8192, (False, 0), 48.36, True),
    ("kimi", 8192, (False, 0), 38.58, False),  # H100, bench/results/train_throughput_kimi_same_attention.json
    ("kimi_derived", 8192, (False, 0), 43.73, False),  # H100, bench/results/train_throughput_kimi_derived.json
    ("kimi_derived", 40960, (7, 2048), 70.7, False),
    ("kimi", 65536, (True, 2048), 65.62, False),  # H100, bench/results/train_throughput_kimi_long.json
])
def test_the_estimate_is_within_five_percent_of_the_recorded_peaks(preset, T, switches, measured_gib, stacks):
    """The older peaks were measured while the diagonal merge kept its stacked keys and values for backward
    (attention.merge keeps none now): 4 s kv bytes per row at step s, added to the estimate for them."""
    shape = bench.PRESETS[preset]
    kept = 4 * T * shape["kv_heads"] * shape["head_dim"] * 7 * 6 // 2 / 2**30 if stacks else 0
    estimate = bench.memory_estimate(shape, T, 7, 1.0, *switches)["total"] + kept
    assert abs(estimate - measured_gib) < 0.05 * measured_gib, estimate


def test_recorded_llama_peaks_are_the_ones_the_estimate_is_checked_against():
    results = json.loads((BENCH / "results" / "train_throughput.json").read_text())["runs"]
    h200 = {r["T"]: round(r["peak_mem_gib"], 2) for run in results if run["device"] == "NVIDIA H200"
            and run.get("preset") == "llama8b" for r in run["results"] if r.get("ok") and r["variant"] == "compiled"}
    assert h200 == {4096: 15.84}


def test_recorded_kimi_run_holds_what_benchmarks_md_states():
    runs = json.loads((BENCH / "results" / "train_throughput_kimi.json").read_text())["runs"]
    run = next(r for r in runs if r["device"] == "NVIDIA H100 80GB HBM3")
    rows = {(r["T"], r["activation_checkpointing"], r["freeze_lm_head"]): r for r in run["results"]}
    assert run["preset"] == "kimi" and (run["date"], run["commit"]) == ("2026-12-06", "17abe2a")
    # the same trainable weights as speculators (lm_head frozen): 1.3x at T = 4096
    assert rows[4096, False, True]["ratio_vs_speculators"] == 1.335
    assert set(rows[8192, False, False]["peers"]) == {"specforge", "speculators"}
    assert rows[8192, False, False]["ratio_vs_faster_peer"] == 1.07
    sf = rows[8192, False, False]["peers"]["specforge"]["tokens_per_s"]
    assert round(rows[8192, False, False]["tokens_per_s"] / sf, 2) == 1.25  # SpecForge trains its lm_head too
    assert round(rows[8192, False, False]["peak_mem_gib"], 2) == 39.31
    assert rows[32768, True, False]["loss_chunk_tokens"] == 2048
    assert max(r["peak_mem_gib"] for r in rows.values()) < 80e9 / 2**30  # 80 GB: a 96 GB card with headroom
    assert rows[16384, True, False]["peak_mem_gib"] < 0.6 * rows[16384, False, False]["peak_mem_gib"]
    for r in rows.values():  # every step trained: its loss fell from the first step
        first, last = r.get("loss_first_last") or (r["losses"][0], r["losses"][-1])
        assert 40 < last < first


def test_recorded_derived_kimi_run_shows_what_the_merge_no_longer_keeps():
    """The derived head on one H100: the merge that keeps its stacks (a4bdf37), recomputes them (cf9a533) and
    reads the steps one by one (now), at T = 8192 (the same losses, 4.6 GiB less), and the longest length
    with both switches that fits (40,960; 49,152 ran out of memory, as the estimate says)."""
    runs = json.loads((BENCH / "results" / "train_throughput_kimi_derived.json").read_text())["runs"]
    run = next(r for r in runs if r["device"] == "NVIDIA H100 80GB HBM3")
    rows = {(r["T"], r["commit"]): r for r in run["results"]}
    kept, now = rows[8192, "a4bdf37"], rows[8192, run["commit"]]
    for r in (kept, rows[8192, "cf9a533"]):  # the same step: its losses to fp32 rounding over the 8 steps
        assert max(abs(a - b) for a, b in zip(r["losses"], now["losses"], strict=True)) < 1e-3
    assert kept["peak_mem_gib"] - now["peak_mem_gib"] > 4.5 and now["tokens_per_s"] >= kept["tokens_per_s"]
    assert rows[40960, run["commit"]]["ok"] and rows[40960, run["commit"]]["peak_mem_gib"] < 80e9 / 2**30
    assert not rows[49152, run["commit"]]["ok"] and "OutOfMemoryError" in rows[49152, run["commit"]]["error"]
    for r in (now, rows[40960, run["commit"]]):
        assert abs(r["peak_estimate_gib"]["total"] - r["peak_mem_gib"]) < 1.0


def test_recorded_same_attention_run_holds_what_benchmarks_md_states():
    """T = 8192 at the Kimi shape with every trainer computing the whole causal attention (speculators'
    sliding window off): ours against the peer that trains the same weights."""
    (run,) = json.loads((BENCH / "results" / "train_throughput_kimi_same_attention.json").read_text())["runs"]
    trained, frozen = sorted(run["results"], key=lambda r: r["freeze_lm_head"])
    assert trained["peers"]["speculators"]["sliding_window"] == 0 and trained["T"] == frozen["T"] == 8192
    assert (trained["ratio_vs_specforge"], frozen["ratio_vs_speculators"]) == (1.265, 1.275)
    assert trained["ratio_vs_faster_peer"] == 1.168 and round(trained["peak_mem_gib"], 1) == 38.6


def test_peers_attach_by_their_length_and_k_whatever_their_tag(tmp_path):
    lines = [
        {"peer": "specforge", "tag": "sf_kimi_T4096", "seq": 4096, "ttt": 7, "ok": True, "tokens_per_s": 12000.0},
        {"peer": "speculators", "tag": "spec_kimi_T4096", "seq": 4096, "ttt": 7, "ok": True, "tokens_per_s": 13000.0},
        {"peer": "speculators", "tag": "spec_kimi_T8192", "seq": 8192, "ttt": 7, "ok": False, "error": "timed out"},
        {"peer": "specforge", "tag": "sf_T4096_ttt3", "ok": True, "tokens_per_s": 1.0},  # an old line: by its tag
    ]
    path = tmp_path / "anchor_results.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    ours = [{"T": 4096, "ttt": 7, "ok": True, "tokens_per_s": 15600.0},
            {"T": 8192, "ttt": 7, "ok": True, "tokens_per_s": 15500.0}]
    bench.attach_peers(ours, path)
    assert set(ours[0]["peers"]) == {"specforge", "speculators"} and ours[0]["ratio_vs_faster_peer"] == 1.2
    assert "peers" not in ours[1] and ours[1]["peers_not_finished"] == {"spec_kimi_T8192": "timed out"}


def test_the_derived_kimi_preset_builds_the_head_the_kimi_config_trains():
    """kimi_derived is configs/kimi-k2.5.yaml's head: 64 KV heads x 112 and its norm before fc, built here at
    the tiny preset's size (the norm is on the preset, not the width)."""
    import torch
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "kimi-k2.5.yaml").read_text())
    assert config["train"]["norm_before_fc"] is bench.PRESETS["kimi_derived"]["aux_norm"] is True
    shape = {**bench.PRESETS["tiny"], "aux_norm": True}
    draft = bench.build(shape, 32, torch.device("cpu"))[0]
    assert draft.config.norm_before_fc and hasattr(draft, "input_norm")
    assert not bench.build(bench.PRESETS["tiny"], 32, torch.device("cpu"))[0].config.norm_before_fc


def test_recorded_derived_kimi_peaks_are_the_ones_the_estimate_is_checked_against():
    """The head configs/kimi-k2.5.yaml trains (64 query and 64 KV heads x 112, a norm before fc), beside the
    GQA preset measured on the same H200 while it was held (one machine, one commit)."""
    runs = json.loads((BENCH / "results" / "train_throughput_kimi_derived.json").read_text())["runs"]
    derived = next(r for r in runs if r["device"] == "NVIDIA H200")
    assert derived["preset"] == "kimi_derived"
    assert derived["shape"]["kv_heads"] == 64 and derived["shape"]["head_dim"] == 112 and derived["shape"]["aux_norm"]
    peaks = {r["T"]: round(r["peak_mem_gib"], 2) for r in derived["results"] if r["ok"]}
    assert peaks == {4096: 35.14, 8192: 48.36}
    kimi = next(r for r in json.loads((BENCH / "results" / "train_throughput_kimi.json").read_text())["runs"]
                if r["device"] == "NVIDIA H200")
    (k8192,) = [r for r in kimi["results"] if r["T"] == 8192]
    (d8192,) = [r for r in derived["results"] if r["T"] == 8192]
    assert round(k8192["peak_mem_gib"], 2) == 39.3 and 0.8 < d8192["tokens_per_s"] / k8192["tokens_per_s"] < 0.9


def test_train_vs_peers_runs_both_peers_then_ours_trained_and_frozen_in_one_call(tmp_path):
    """bench/train_vs_peers.sh with a stand-in for peer-train-bench's run.sh (one result line per config, as
    the real one writes): each peer is asked for its own config with the shape and the extra arguments, and
    ours runs twice with the peers' numbers beside it; what comes back is a few files, no working folders."""
    peers = tmp_path / "peer-train-bench"
    peers.mkdir()
    (peers / "run.sh").write_text(
        'mkdir -p "$OUT"; peer=specforge; case $ANCHOR_ONLY in spec*) peer=speculators;; esac\n'
        'printf \'{"tag": "%s", "peer": "%s", "seq": 64, "ttt": 7, "ok": true, "tokens_per_s": 5.0, '
        '"extra": "%s"}\\n\' "$ANCHOR_ONLY" "$peer" "$ANCHOR_EXTRA" > "$OUT/anchor_results.jsonl"\n'
    )
    out = tmp_path / "out"
    env = {**os.environ, "PEER_BENCH": str(peers), "OUT": str(out), "STEPS": "1", "WARMUP": "1",
           "VARIANTS": "flex-only", "ATTENTION": "flex flash"}
    proc = subprocess.run(["bash", str(BENCH / "train_vs_peers.sh"), "tiny", "64", "--sliding-window", "0"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "peers.jsonl").read_text().splitlines()]
    assert [(p["tag"], p["extra"]) for p in lines] == [
        ("sf_T4096_ttt7", "--preset tiny --seq 64 --sliding-window 0"),
        ("spec_T4096_ttt7", "--preset tiny --seq 64 --sliding-window 0")]
    assert sorted(p.name for p in out.iterdir()) == [
        "logs.tgz", "peers.jsonl", "train_throughput.json", "train_throughput_flash.json",
        "train_throughput_flash_frozen.json", "train_throughput_frozen.json"]
    for attention in ("flex", "flash"):
        for frozen in (False, True):
            name = f"train_throughput{'_flash' if attention == 'flash' else ''}{'_frozen' if frozen else ''}.json"
            (run,) = json.loads((out / name).read_text())["runs"]
            (r,) = run["results"]
            assert r["ok"] and r["freeze_lm_head"] == frozen and r["attention"] == attention
            assert set(r["peers"]) == {"specforge", "speculators"}
    assert "flash, lm_head trained" in proc.stdout and "x specforge" in proc.stdout and "x speculators" in proc.stdout


def test_loss_bench_alternative_gives_the_step_loss_sums(tmp_path):
    """bench/loss_kernels.py on CPU at the tiny preset: every variant runs, and the gather-based top-1 count and
    the dynamic-rows compilation give the sums of the loss the step trains with."""
    out = tmp_path / "loss.json"
    proc = subprocess.run([sys.executable, str(BENCH / "loss_kernels.py"), "--preset", "tiny", "--seq", "64",
                           "--iters", "1", "--no-tuning", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["runs"][0]["rows"]}
    assert set(rows) == {"matmul", "as trained", "max gather", "as trained, rows dynamic"}
    for variant in ("max gather", "as trained, rows dynamic"):
        assert rows[variant]["loss_sum_max_rel_err"] < 1e-6 and rows[variant]["correct_diff"] == 0


def test_recorded_loss_run_holds_what_benchmarks_md_states():
    """loss_kernels_kimi.json's H100 run: BENCHMARKS §2's table, and its reading that the best variant saves
    under 0.5% of the frozen Kimi step (495 ms)."""
    runs = json.loads((BENCH / "results" / "loss_kernels_kimi.json").read_text())["runs"]
    (run,) = [r for r in runs if r["device"] == "NVIDIA H100 80GB HBM3"]
    assert (run["date"], run["commit"], run["lm_head"]) == ("2026-12-07", "dbfc1d0", "frozen")
    ms = {r["variant"]: r["fwd_bwd_ms"] for r in run["rows"]}
    assert [round(ms[v], 2) for v in ("matmul", "as trained", "max gather", "as trained, tuned", "max gather, tuned")] \
        == [77.81, 86.10, 85.36, 85.74, 84.88]
    assert (ms["as trained"] - min(v for k, v in ms.items() if k != "matmul")) / 495 < 0.005
