"""Per-job overhead of extraction through the workflow: what a shard job costs beyond the extraction itself.

    python3 bench/job_overhead.py --random-shape smollm2-135m --tokenizer ../shared/assets/tokenizers/llama3_1 \
        --shards 7 --shard-size 2000 --out bench/results/job_overhead.json               # H200, default shard size
    python3 bench/job_overhead.py --model ../shared/assets/models/stories260K --shards 9 --shard-size 8 \
        --out bench/results/job_overhead.json                                             # CPU

A synthetic chat dataset (one user turn, one answer of log-uniform 64–2048 tokens, as in §1's extraction
benchmark) is cut into shards and prepared by the workflow itself; then one `snakemake` run extracts every
shard on one device, jobs one after the other (`--resources gpu=1`), as `make run` does per GPU. The first
job starts the extraction server (model load, first kernels); from the moment its hidden shard appears to the
moment the last one does, the run is in its steady state, and each job's log holds the server's own extraction
seconds for its shard, so

    per-job overhead = (last shard's mtime - first shard's mtime - extraction seconds of the other jobs) / their number

is what a job adds around the GPU work: Snakemake's job bookkeeping, the job's Python start-up, imports and
checks, and the request; and the overhead share = overhead / (overhead + extraction seconds per shard).
--random-shape builds random weights of a real model's shape (extraction speed depends on the shape only)
with the tokenizer given.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from workflow_util import copy_workflow  # noqa: E402

SHAPES = {  # random-weight targets of real models' shapes (vocab: the tokenizer's)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
}
TEMPLATE = ROOT / "tests" / "data" / "chat_template.jinja"


def random_model(shape: str, tokenizer: Path, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def vocab_size(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def synthetic_dataset(model: Path, path: Path, conversations: int, seed: int = 0) -> None:
    """OpenAI-messages JSONL: answers of log-uniform 64–2048 tokens (decoded random ids re-tokenize to about as many)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    with path.open("w") as f:
        for _ in range(conversations):
            n = int(math.exp(rng.uniform(math.log(64), math.log(2048))))
            answer = tok.decode(rng.choices(ids, k=n), skip_special_tokens=True)
            f.write(json.dumps({"messages": [{"role": "user", "content": "Tell me something."},
                                             {"role": "assistant", "content": answer}]}) + "\n")


def snakemake(wd: Path, targets: list[str], cores: int) -> float:
    cmd = [sys.executable, "-m", "snakemake", *targets, "--configfile", "config.yaml", "--cores", str(cores),
           "--resources", "gpu=1"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=wd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return time.perf_counter() - t0


def job_stats(log: Path) -> dict:
    """The extraction server's reply, printed by the job (`{'ok': True, 'tokens': …, 'seconds': …}`)."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{") and "'seconds'" in line:
            return ast.literal_eval(line)
    raise SystemExit(f"{log}: no extraction stats in the job log")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="HF model dir (with its tokenizer)")
    src.add_argument("--random-shape", choices=sorted(SHAPES))
    p.add_argument("--tokenizer", type=Path, help="tokenizer dir for --random-shape")
    p.add_argument("--shards", type=int, default=7, help="jobs timed in the steady state (one more starts the server)")
    p.add_argument("--shard-size", type=int, default=2000, help="conversations per shard (2000: the default)")
    p.add_argument("--cores", type=int, default=2, help="Snakemake's --cores (extract jobs run one at a time)")
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (on the disk to write to)")
    p.add_argument("--out", type=Path,
                   help="results file (bench/results/ format: this run replaces its device's entry)")
    args = p.parse_args()
    if args.random_shape and not args.tokenizer:
        p.error("--random-shape needs --tokenizer")

    work = Path(tempfile.mkdtemp(dir=args.work))
    try:
        wd = copy_workflow(work / "wf")
        if args.random_shape:
            model, name = random_model(args.random_shape, args.tokenizer, work / "model"), f"random {args.random_shape}"
        else:
            model, name = args.model.resolve(), args.model.name
        total = (args.shards + 1) * args.shard_size
        synthetic_dataset(model, wd / "chat.jsonl", total)
        cfg = {"output_root": "build", "target": {"model": str(model), "chat_template": str(TEMPLATE)},
               "datasets": [{"name": "chat", "path": "chat.jsonl"}],
               "prepare": {"shard_size": args.shard_size},
               "extract": {"batch_tokens": args.batch_tokens, "server_idle_s": 900},
               "vocab": {"draft_vocab_size": min(32000, vocab_size(model) // 2)}, "evaluate": {"sets": []}}
        (wd / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        hidden = [f"build/hidden/chat/{i:05d}.safetensors" for i in range(args.shards + 1)]
        t0 = time.perf_counter()
        snakemake(wd, [h.replace("hidden", "tokens") for h in hidden], args.cores)
        prepare_s = time.perf_counter() - t0
        wall = snakemake(wd, hidden, args.cores)  # the first job starts the server; the others find it loaded
        done = sorted((wd / h).stat().st_mtime for h in hidden)
        steady = done[-1] - done[0]
        stats = [job_stats(wd / "build" / "logs" / "extract" / "chat" / f"{i:05d}.log") for i in range(args.shards + 1)]
        first = min(range(args.shards + 1), key=lambda i: (wd / hidden[i]).stat().st_mtime)
        stats = [s for i, s in enumerate(stats) if i != first]
        extract_s = sum(s["seconds"] for s in stats)
        tokens = sum(s["tokens"] for s in stats)
        overhead = (steady - extract_s) / args.shards
        per_shard = extract_s / args.shards
        import torch
        from results import cpu_device, record

        row = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_device(),
            "model": name, "command": " ".join(sys.argv), "shard_size": args.shard_size, "jobs": args.shards,
            "tokens_per_shard": tokens / args.shards, "prepare_s": prepare_s, "wall_s": wall,
            "steady_state_s": steady, "extraction_s": extract_s,
            "extraction_tokens_per_s": tokens / extract_s, "extraction_s_per_shard": per_shard,
            "overhead_s_per_job": overhead, "overhead_share": overhead / (overhead + per_shard),
            "jobs_stats": stats,
        }
        print(json.dumps({k: v for k, v in row.items() if k != "jobs_stats"}, indent=1))
        if args.out:
            record("job_overhead", row["device"], row, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
