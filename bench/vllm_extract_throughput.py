"""Extraction throughput of `extract.backend: vllm` against the HF backend and the disk roofline, in one run.

    python3 bench/vllm_extract_throughput.py --model models/SmolLM2-135M-Instruct --tokens 200000 \
        --vllm-arg=--enforce-eager --out bench/results/vllm_extract_throughput.json
    python3 bench/vllm_extract_throughput.py --smoke --work W --out W/vllm_extract_throughput.json  # CPU, fake

On one synthetic token shard (bench/extract_throughput.py's log-uniform 64-2,048 lengths, random ids):
  disk          the output disk's sequential write bandwidth (64 MiB blocks + fsync, the same probe as
                bench/extract_throughput.py); the bound is bandwidth / hidden_bytes_per_token(H, storage)
  hf            `eagle3build.extraction.hf_server.Extractor` (batch_tokens 65,536), bf16 and fp8 storage
  vllm          `eagle3build.extraction.vllm.extract_shard_vllm` (server manager, relay, client, shard
                writer) at each --concurrency, bf16 and fp8 storage; the server is started and warmed first
  vllm-bare     requests straight to the engine (past the relay) at the highest concurrency: wait for each
                connector file's lock, delete it; no read, no check, no shard. What the engine and its
                connector can deliver without the project's client.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import vllm_common as vc
from extract_throughput import disk_bandwidth, make_lengths

from eagle3build.config import default_aux_layer_ids
from eagle3build.engine.vllm_server import SERVED_MODEL_NAME
from eagle3build.extraction.hf_server import Extractor
from eagle3build.extraction.vllm import VllmServer, extract_shard_vllm, stop_servers
from eagle3build.shards import hidden_bytes_per_token, write_tokens

BENCH = "vllm_extract_throughput"


def bare_request(url: str, ids: list[int]) -> int:
    """One extraction request to the engine itself; waits for the connector's write, deletes the file."""
    body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return vc.wait_and_delete(json.loads(r.read())["kv_transfer_params"]["hidden_states_path"])


def hf_rows(args, tokens: Path, work: Path, bound: dict) -> list[dict]:
    n = vc.model_shape(args.model)[0]
    ex = Extractor(args.model, default_aux_layer_ids(n), args.device, "bfloat16")
    ex.extract_shard(str(tokens), str(work / "warm.safetensors"), "bf16", 65536, 64, progress=False)
    rows = []
    for storage in args.storage:
        out = work / f"hf-{storage}.safetensors"
        st = ex.extract_shard(str(tokens), str(out), storage, 65536, 64, progress=False)
        rows.append({"backend": "hf", "batch_tokens": 65536, "storage": storage, **st,
                     "share_of_disk_bound": st["tokens_per_s"] / bound[storage]})
        print(rows[-1], flush=True)
        out.unlink()
    (work / "warm.safetensors").unlink()
    del ex
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def vllm_rows(args, ids_list: list[torch.Tensor], tokens: Path, work: Path, bound: dict) -> list[dict]:
    run_dir = work / "run"
    total = sum(len(x) for x in ids_list)

    def params(storage: str, concurrency: int) -> dict:
        return vc.extract_params(args.model, storage, concurrency, fake=args.fake, max_length=args.max_len,
                                 gpu_memory_utilization=args.gpu_memory_utilization, extra_args=args.vllm_arg,
                                 connector_dir=args.connector_dir)

    small = work / "small.safetensors"
    write_tokens(small, ids_list[:16], [torch.ones(len(x)) for x in ids_list[:16]], {"tokenizer": "synthetic"})
    start = time.perf_counter()
    extract_shard_vllm(str(small), str(work / "small-out.safetensors"), params("bf16", 8), str(run_dir))
    rows = [{"backend": "vllm", "what": "start and warm-up (16 samples)", "seconds": time.perf_counter() - start}]
    for concurrency in args.concurrency:
        for storage in args.storage:
            out = work / f"vllm-{storage}-{concurrency}.safetensors"
            start = time.perf_counter()
            extract_shard_vllm(str(tokens), str(out), params(storage, concurrency), str(run_dir))
            dt = time.perf_counter() - start
            rows.append({"backend": "vllm", "concurrency": concurrency, "storage": storage, "tokens": total,
                         "seconds": dt, "tokens_per_s": total / dt, "share_of_disk_bound": total / dt / bound[storage]})
            print(rows[-1], flush=True)
            out.unlink()
    state = VllmServer(run_dir, params("bf16", 8)).read_state()
    url = f"http://127.0.0.1:{state.upstream_port}/v1/completions"
    concurrency = max(args.concurrency)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        sizes = list(pool.map(lambda ids: bare_request(url, ids.tolist()), ids_list))
    dt = time.perf_counter() - start
    rows.append({"backend": "vllm-bare", "concurrency": concurrency, "tokens": total, "seconds": dt,
                 "tokens_per_s": total / dt, "connector_bytes": sum(sizes), "connector_bytes_per_s": sum(sizes) / dt})
    print(rows[-1], flush=True)
    stop_servers(run_dir)
    return rows


def run(args) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    _, hidden, vocab = vc.model_shape(args.model)
    lengths = make_lengths(args.tokens, args.max_len)
    g = torch.Generator().manual_seed(1)
    ids_list = [torch.randint(10, vocab, (n,), generator=g) for n in lengths]
    tokens = work / "tokens.safetensors"
    write_tokens(tokens, ids_list, [torch.ones(n) for n in lengths], {"tokenizer": "synthetic"})
    disk = disk_bandwidth(work, args.disk_gb)
    dd = subprocess.run(["dd", "if=/dev/zero", f"of={work}/dd.bin", "bs=64M", f"count={max(1, int(args.disk_gb * 16))}",
                         "conv=fdatasync"], capture_output=True, text=True)
    (work / "dd.bin").unlink(missing_ok=True)
    bound = {s: disk / hidden_bytes_per_token(hidden, s) for s in ("bf16", "fp8")}
    result = {"command": " ".join(sys.argv), "engine": "fake" if args.fake else "vllm", "model": Path(args.model).name,
              "hidden_size": hidden, "shard": {"tokens": sum(lengths), "samples": len(lengths)},
              "bytes_per_token": {s: hidden_bytes_per_token(hidden, s) for s in ("bf16", "fp8")},
              "disk_bytes_per_s": disk, "dd": (dd.stderr.strip().splitlines() or [""])[-1],
              "disk_bound_tokens_per_s": bound, "connector_dir": args.connector_dir or "run folder (the disk)",
              "rows": []}
    print(f"disk {disk / 1e9:.2f} GB/s -> bound {bound['bf16']:,.0f} tok/s bf16; dd: {result['dd']}", flush=True)
    if not args.skip_hf:
        result["rows"] += hf_rows(args, tokens, work, bound)
    result["rows"] += vllm_rows(args, ids_list, tokens, work, bound)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF target dir")
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny random Llama, the fake engine, a few tokens")
    p.add_argument("--fake", action="store_true", help="tests/fake_vllm_server.py instead of vLLM")
    p.add_argument("--tokens", type=int, default=200_000)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--storage", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 64], help="the last one also runs vllm-bare")
    p.add_argument("--disk-gb", type=float, default=3.0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeat)")
    p.add_argument("--connector-dir", help="the connector's folder (extract.vllm.shared_storage_path), e.g. "
                   "/dev/shm/eagle3build-hs: its per-request files in RAM; default the run folder, on the disk")
    p.add_argument("--work", help="scratch folder on the disk to measure")
    p.add_argument("--out", help="results file (default bench/results/vllm_extract_throughput.json)")
    args = p.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="vllm-throughput-")
    if args.smoke:
        args.model = str(vc.tiny_llama(Path(args.work) / "target"))
        args.fake, args.tokens, args.max_len, args.disk_gb, args.concurrency = True, 3000, 256, 0.07, [2, 8]
    elif not args.model:
        p.error("--model (or --smoke) is required")
    result = run(args)
    from results import record

    print("recorded in", record(BENCH, vc.device_name(), result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
