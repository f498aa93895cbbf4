#!/usr/bin/env bash
# The training step of both peers and of ours at one shape and length, in one call on one GPU: the peers
# first (peer-train-bench: SpecForge, then speculators), then ours with the lm_head trained (SpecForge's
# work) and frozen (speculators'), each with the peers' numbers and our ratio beside it (BENCHMARKS.md §2).
#
#   PEER_BENCH=path/to/peer-train-bench bash bench/train_vs_peers.sh kimi 8192 [peer-bench args...]
#
# The extra arguments go to every peer run: `--sliding-window 0` gives speculators the whole causal attention
# that SpecForge and ours compute (its default window is 2048). With TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1
# in the environment our step compiles with Inductor's coordinate-descent tuning (docs/TRAINING.md).
# ATTENTION="flex flash": ours with each attention kernel (train.attention; default flex alone).
# Writes under $OUT (default ./bench-out): peers.jsonl, train_throughput.json (lm_head trained),
# train_throughput_frozen.json (flash: train_throughput_flash[_frozen].json) and logs.tgz. STEPS, WARMUP:
# timed and warm-up steps of every run (8, 2).
set -euo pipefail
preset=${1:?usage: PEER_BENCH=DIR bash bench/train_vs_peers.sh PRESET SEQ [peer-bench args...]}
seq=${2:?the sequence length}
shift 2
peers=${PEER_BENCH:?set PEER_BENCH to the folder of peer-train-bench, with its wheels (its README)}
out=${OUT:-bench-out}
steps=${STEPS:-8}
warmup=${WARMUP:-2}
mkdir -p "$out/sf" "$out/spec"
export PYTHONUNBUFFERED=1
extra="--preset $preset --seq $seq $*"
# run.sh names its configs by its default shape (sf_T4096_ttt7, spec_T4096_ttt7); ANCHOR_EXTRA's --preset and
# --seq win over it, and the results carry the length they ran at. Each peer in its own folder: run.sh
# starts its results file afresh.
for peer in sf spec; do
    OUT="$out/$peer" ANCHOR_STEPS=$steps ANCHOR_WARMUP=$warmup ANCHOR_BUDGET_S=${PEER_BUDGET_S:-300} \
        ANCHOR_ONLY="${peer}_T4096_ttt7" ANCHOR_EXTRA="$extra" bash "$peers/run.sh" >"$out/$peer/stdout.txt" 2>&1 || true
done
cat "$out/sf/anchor_results.jsonl" "$out/spec/anchor_results.jsonl" >"$out/peers.jsonl"
ours=(python3 bench/train_throughput.py --preset "$preset" --seq "$seq" --steps "$steps" --warmup "$warmup"
      --variants "${VARIANTS:-compiled}" --no-check --peers "$out/peers.jsonl")
for attention in ${ATTENTION:-flex}; do  # flex's files unsuffixed, another kernel's with its name
    sfx=$([ "$attention" = flex ] || echo "_$attention")
    "${ours[@]}" --attention "$attention" --out "$out/train_throughput$sfx.json" >"$out/ours$sfx.txt" 2>&1 || true
    "${ours[@]}" --attention "$attention" --freeze-lm-head --out "$out/train_throughput${sfx}_frozen.json" \
        >"$out/ours${sfx}_frozen.txt" 2>&1 || true
done
python3 - "$out" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("train_throughput*.json")):
    name = path.name
    for r in (r for run in json.loads(path.read_text())["runs"] for r in run["results"]):
        if not r["ok"]:
            print(f"T={r['T']} {name}: {r.get('error')}")
            continue
        peers = {k: round(v["tokens_per_s"]) for k, v in r.get("peers", {}).items()}
        same = "speculators" if r["freeze_lm_head"] else "specforge"  # the peer that trains the same weights
        ratio = round(r["tokens_per_s"] / r["peers"][same]["tokens_per_s"], 3) if same in r.get("peers", {}) else None
        peak = f", peak {r['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in r else ""  # a GPU's
        print(f"T={r['T']} {r['attention']}, lm_head {'frozen' if r['freeze_lm_head'] else 'trained'}: {r['tokens_per_s']:,.0f} "
              f"tokens/s{peak}; peers {peers}; same work: {ratio}x {same}")
PY
(cd "$out" && tar czf logs.tgz sf spec ours*.txt && rm -rf sf spec ours*.txt)
