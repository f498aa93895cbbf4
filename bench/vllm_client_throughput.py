"""Tokens/s of the vLLM extraction client path alone, before and after a change, on CPU, in one run.

    python3 bench/vllm_client_throughput.py                      # HEAD's package vs the working tree
    python3 bench/vllm_client_throughput.py --baseline REF       # any other commit as "before"
    python3 bench/vllm_client_throughput.py --no-baseline        # the working tree only

`extract_shard_vllm` (server manager, relay, HTTP client, connector-file read and checks, hidden-shard
writer) runs against tests/fake_vllm_server.py in its fast mode (FAKE_VLLM_FAST_STATES=1: states gathered
from a precomputed table; FAKE_VLLM_WRITE_DELAY_S=0), so the engine costs a file write per request and the
rest is the client's. Shapes: SmolLM2-135M (H=576) and Llama-3.1-8B (H=4096), 4 ids each; bf16 and fp8
storage; one synthetic token shard per shape (bench/extract_throughput.py's log-uniform 64-2,048 lengths).

"before" is the package of --baseline (default HEAD) exported with `git archive` into the work folder
(the repository is not touched); both sides use the working tree's fake engine and run in separate
processes, each with its own server (started and warmed before the timed shard). The hidden shards of
the two sides must be byte-identical: the run fails otherwise. The engine alone ("bare": requests straight
to the fake, wait for each file's lock, delete it) is measured too, as the ceiling of this machine.
Each row gives wall tokens/s (the client, the relay and the engine share this machine's cores) and
tokens per CPU second of the client's own process (user + system time of all its threads: HTTP, reads,
checks, fp8 conversion, writes, deletes; the relay and the engine are other processes), the figure that
does not depend on what else the machine runs.
Results go to bench/results/vllm_client_throughput.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = "vllm_client_throughput"
FAKE = ROOT / "tests" / "fake_vllm_server.py"
SHAPES = {"smollm2": {"hidden": 576, "layers": [2, 15, 27, 30]},
          "llama8b": {"hidden": 4096, "layers": [2, 16, 29, 32]}}
DEFAULT_TOKENS = {"smollm2": 100_000, "llama8b": 16_000}


# ---------------------------------------------------------------- one side, in its own process
def run_side(args) -> None:
    """Import the package under test from --package-root, warm its server, time one shard, print JSON."""
    sys.path.insert(0, args.package_root)
    import torch

    from eagle3build.extraction.vllm import VllmServer, extract_shard_vllm, stop_servers

    shape = SHAPES[args.shape]
    env = {"FAKE_VLLM_HIDDEN_SIZE": str(shape["hidden"]), "FAKE_VLLM_FAST_STATES": "1",
           "FAKE_VLLM_WRITE_DELAY_S": "0", "FAKE_VLLM_MAX_RUNNING": "256"}
    vllm = {"executable": [sys.executable, str(FAKE)], "env": env, "startup_timeout_s": 60,
            "request_timeout_s": 600, "idle_timeout_s": 600, "retries": 0}
    if args.concurrency:
        vllm["concurrency"] = args.concurrency
    params = {"model": "org/fake-target", "revision": None, "trust_remote_code": False,
              "layer_ids": shape["layers"], "hidden_size": shape["hidden"], "storage_dtype": args.dtype,
              "image": "", "vllm": vllm}
    run_dir, work = Path(args.run_dir), Path(args.work)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    try:
        extract_shard_vllm(args.warmup, str(work / f"warm-{args.label}.safetensors"), params, str(run_dir))
        seconds = cpu_seconds = float("inf")
        for _ in range(args.repeat):  # best of: the machine is shared, a slow pass measures the others
            start, cpu_start = time.perf_counter(), time.process_time()
            extract_shard_vllm(args.tokens, args.output, params, str(run_dir))
            seconds = min(seconds, time.perf_counter() - start)
            # this process's CPU (all its threads, user + system): the client path's own cost; the relay
            # and the engine are other processes
            cpu_seconds = min(cpu_seconds, time.process_time() - cpu_start)
        concurrency = VllmServer(run_dir, params).cfg["concurrency"]
        bare = bare_engine(run_dir, params, args.tokens, concurrency) if args.bare else None
    finally:
        stop_servers(run_dir)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "concurrency": concurrency,
                      "bare_seconds": bare}))


def bare_engine(run_dir: Path, params: dict, tokens: str, concurrency: int) -> float:
    """Seconds for the engine alone: every sample straight to the fake (past the relay), each file's lock
    waited for, the file deleted; nothing read."""
    import fcntl
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from eagle3build.extraction.vllm import VllmServer
    from eagle3build.shards import read_tokens

    state = VllmServer(run_dir, params).read_state()
    url = f"http://127.0.0.1:{state.upstream_port}/v1/completions"
    shard = read_tokens(tokens)

    def one(i: int) -> None:
        ids = shard.sample(i)[0].tolist()
        body = json.dumps({"model": "eagle3build-target", "prompt": ids, "max_tokens": 1}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            path = json.loads(r.read())["kv_transfer_params"]["hidden_states_path"]
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
        os.unlink(path)
        os.unlink(path + ".lock")

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(shard.num_samples)))
    return time.perf_counter() - start


# ---------------------------------------------------------------- the driver
def export_package(ref: str, dest: Path) -> Path:
    """eagle3build/ (and schemas/, where its defaults lived before they moved into the package) of commit `ref`, written under dest with `git archive` (no worktree, no checkout)."""
    dest.mkdir(parents=True, exist_ok=True)
    parts = ["eagle3build"] + (["schemas"] if subprocess.run(["git", "cat-file", "-e", f"{ref}:schemas"], cwd=ROOT, capture_output=True).returncode == 0 else [])
    archive = subprocess.run(["git", "archive", ref, *parts], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def write_shards(work: Path, shape: str, tokens: int) -> tuple[Path, Path, int]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from extract_throughput import make_lengths

    from eagle3build.shards import write_tokens

    lengths = make_lengths(tokens, 2048, seed=1)
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 32000, (n,), generator=g, dtype=torch.int32) for n in lengths]
    masks = [torch.ones(n, dtype=torch.uint8) for n in lengths]
    shard, warm = work / f"tokens-{shape}.safetensors", work / f"warm-{shape}.safetensors"
    write_tokens(shard, ids, masks, {"tokenizer": "synthetic"})
    write_tokens(warm, ids[:8], masks[:8], {"tokenizer": "synthetic"})
    return shard, warm, sum(lengths)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def side(args, label: str, root: Path, shape: str, dtype: str, tokens: Path, warm: Path, work: Path,
         concurrency: int | None, bare: bool) -> dict:
    out = work / f"hidden-{label}-{shape}-{dtype}.safetensors"
    cmd = [sys.executable, __file__, "_side", "--package-root", str(root), "--shape", shape, "--dtype", dtype,
           "--tokens", str(tokens), "--warmup", str(warm), "--output", str(out), "--label", label,
           "--run-dir", str(work / f"run-{label}"), "--work", str(work)]
    if concurrency:
        cmd += ["--concurrency", str(concurrency)]
    cmd += ["--repeat", str(args.repeat)]
    if bare:
        cmd.append("--bare")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    if proc.returncode:
        sys.exit(f"{label} {shape} {dtype} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"out": out, **result}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="HEAD", help="the commit whose package is 'before' (default HEAD)")
    p.add_argument("--no-baseline", action="store_true", help="measure the working tree only")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--tokens", type=int, help="tokens per shard (default: 100k for smollm2, 16k for llama8b)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[0],
                   help="extract.vllm.concurrency values to run (0 = each side's schema default)")
    p.add_argument("--repeat", type=int, default=3, help="timed passes per side and setting; the best counts")
    p.add_argument("--work", help="work folder (default: a temp folder under /tmp, removed after)")
    p.add_argument("--out", help="results file or folder (default bench/results/)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-client-bench-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        sides = [("after", ROOT)]
        if not args.no_baseline:
            sides.insert(0, ("before", export_package(args.baseline, work / "before")))
        rows = []
        for shape in args.shapes:
            tokens, warm, total = write_shards(work, shape, args.tokens or DEFAULT_TOKENS[shape])
            for concurrency in args.concurrency:
                for dtype in args.dtypes:
                    outs = {}
                    for label, root in sides:
                        bare = label == "after" and dtype == args.dtypes[0]
                        r = side(args, label, root, shape, dtype, tokens, warm, work, concurrency or None, bare)
                        outs[label] = r["out"]
                        row = {"side": label, "shape": shape, "hidden_size": SHAPES[shape]["hidden"],
                               "storage": dtype, "concurrency": r["concurrency"], "tokens": total,
                               "seconds": round(r["seconds"], 3), "tokens_per_s": round(total / r["seconds"]),
                               "client_cpu_seconds": round(r["cpu_seconds"], 3),
                               "tokens_per_client_cpu_second": round(total / r["cpu_seconds"])}
                        if r["bare_seconds"]:
                            row["bare_engine_tokens_per_s"] = round(total / r["bare_seconds"])
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    digests = {label: sha256(path) for label, path in outs.items()}
                    if len(set(digests.values())) != 1:
                        sys.exit(f"{shape} {dtype}: the hidden shards differ between sides: {digests}")
                    rows[-1]["identical_to_before"] = len(digests) > 1
                    for path in outs.values():
                        path.unlink()
    sys.path.insert(0, str(ROOT / "bench"))
    from results import cpu_device, record

    baseline = None
    if not args.no_baseline:
        baseline = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout.strip()
    result = {"baseline": baseline, "after": "the working tree", "repeat": args.repeat, "rows": rows}
    print("recorded in", record(BENCH, cpu_device(), result, args.out))
    return 0


def parse_side(argv: list[str]):
    p = argparse.ArgumentParser()
    for name in ("--package-root", "--shape", "--dtype", "--tokens", "--warmup", "--output", "--label",
                 "--run-dir", "--work"):
        p.add_argument(name, required=True)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--bare", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_side"]:
        run_side(parse_side(sys.argv[2:]))
        sys.exit(0)
    sys.exit(main())
