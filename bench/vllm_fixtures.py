"""Record a real vLLM's HTTP answers and connector file layout as the small fixtures of tests/fixtures/.

    python3 bench/vllm_fixtures.py --model models/SmolLM2-135M-Instruct --draft build/export/eagle3 \
        --vllm-arg=--enforce-eager --out $OUT/fixtures        # then copy the files into tests/fixtures/
    python3 bench/vllm_fixtures.py --smoke --work W --out W/fixtures                   # CPU, the fake engines

Files are named vllm_<version>_<name> (the version from the server's /version). From the extraction server the
project starts (`eagle3build.extraction.vllm`, asked on vLLM's own port, past the relay): health, models,
version, completions_extract (one 17-token extraction request: status, headers, body), connector_layout (the
file and its .lock right after the answer, once written and 1 s later; the safetensors header), max_tokens_2,
err_too_long / err_empty_prompt / err_wrong_model / err_bad_token_id, metrics_extract_server (its spec-decode
families) and metric_names_and_types (every family of the version). With --draft, from the EAGLE-3 server
(`eagle3build.evaluate.vllm.serving`) after a few greedy chat requests: metrics (the spec-decode families, the
running / waiting gauges and a few neighbours: what `evaluate.vllm.parse_metrics` reads), models_spec_server,
health_spec_server.
"""

from __future__ import annotations

import argparse
import fcntl
import http.client
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

import vllm_common as vc

from eagle3build.engine.vllm_server import SERVED_MODEL_NAME, server_config
from eagle3build.evaluate.vllm import serving
from eagle3build.extraction.vllm import VllmServer, extract_shard_vllm, stop_servers
from eagle3build.shards import write_tokens

NEIGHBOURS = ("python_gc_objects_collected_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:request_success_total", "vllm:e2e_request_latency_seconds")


def call(port: int, method: str, path: str, body: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    reply = conn.getresponse()
    raw = reply.read()
    conn.close()
    record = {"request": {"method": method, "path": path, "body": body}, "status": reply.status,
              "reason": reply.reason, "headers": dict(reply.getheaders())}
    try:
        record["json"] = json.loads(raw)
    except ValueError:
        record["text"] = raw.decode("utf-8", "replace")
    return record


def families(page: str, keep) -> str:
    """The `# HELP` blocks of a Prometheus page whose family name `keep` accepts, in page order."""
    blocks, current = [], []
    for line in page.splitlines():
        if line.startswith("# HELP") and current:
            blocks.append(current)
            current = []
        current.append(line)
    blocks.append(current)
    kept = [b for b in blocks if b and b[0].startswith("# HELP") and keep(b[0].split()[2])]
    return "".join("\n".join(b) + "\n" for b in kept)


def names_and_types(page: str) -> str:
    return "".join(f"{line.split()[2]} {line.split()[3]}\n" for line in page.splitlines() if line.startswith("# TYPE"))


def lock_state(lock: Path) -> str:
    if not lock.exists():
        return "absent"
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return "exists, free"
        except BlockingIOError:
            return "exists, held (LOCK_EX by the writer)"


def connector_layout(port: int, storage: Path, ids: list[int]) -> tuple[dict, dict]:
    """One extraction request, and what its connector file looks like from the answer on."""
    record = call(port, "POST", "/v1/completions", {"model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1,
                                                    "temperature": 0.0})
    path = Path(record["json"]["kv_transfer_params"]["hidden_states_path"])
    lock = Path(f"{path}.lock")
    layout = {"right_after_response": {"file_exists": path.exists(), "lock": lock_state(lock)}}
    start = time.time()
    while not path.exists() and time.time() - start < 10:
        time.sleep(0.001)
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
    layout["write_complete_after_s"] = time.time() - start
    layout["after_write"] = {"file_exists": path.exists(), "lock": lock_state(lock), "file_bytes": path.stat().st_size}
    with open(path, "rb") as f:
        layout["safetensors_header"] = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    time.sleep(1.0)
    layout["lock_after_1s"] = lock_state(lock)
    layout["response_id"], layout["file_name"] = record["json"].get("id"), path.name
    record["json"]["kv_transfer_params"]["hidden_states_path"] = "<storage>/" + path.name
    path.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    return record, layout


def extraction_fixtures(args, work: Path) -> dict[str, object]:
    max_len = 256
    params = vc.extract_params(args.model, fake=args.fake, max_length=max_len - 1, extra_args=args.vllm_arg,
                               gpu_memory_utilization=args.gpu_memory_utilization)
    warm = work / "warm.safetensors"
    write_tokens(warm, [list(range(20, 37))], [[1] * 17], {"tokenizer": "synthetic"})
    run_dir = work / "run"
    extract_shard_vllm(str(warm), str(work / "warm-out.safetensors"), params, str(run_dir))
    server = VllmServer(run_dir, params)
    port = server.read_state().upstream_port
    body = {"model": SERVED_MODEL_NAME, "prompt": list(range(20, 37)), "max_tokens": 1, "temperature": 0.0}
    try:
        out: dict[str, object] = {name: call(port, "GET", path) for name, path in
                                  (("health", "/health"), ("models", "/v1/models"), ("version", "/version"))}
        out["completions_extract"], out["connector_layout"] = connector_layout(port, server.storage_path,
                                                                               body["prompt"])
        out["err_too_long"] = call(port, "POST", "/v1/completions", {**body, "prompt": [20] * max_len})
        out["err_too_long"]["request"]["body"]["prompt"] = f"<{max_len} token ids, stripped>"
        out["err_empty_prompt"] = call(port, "POST", "/v1/completions", {**body, "prompt": []})
        out["err_wrong_model"] = call(port, "POST", "/v1/completions", {**body, "model": "nope"})
        out["err_bad_token_id"] = call(port, "POST", "/v1/completions", {**body, "prompt": [10**7]})
        out["max_tokens_2"] = call(port, "POST", "/v1/completions", {**body, "max_tokens": 2})
        page = call(port, "GET", "/metrics").get("text", "")
        out["metrics_extract_server"] = families(page, lambda n: n.startswith("vllm:spec_decode_"))
        out["metric_names_and_types"] = names_and_types(page)
    finally:
        stop_servers(run_dir)
    for f in server.storage_path.iterdir():  # the files of the extra requests
        f.unlink(missing_ok=True)
    return out


def spec_fixtures(args, work: Path) -> dict[str, object]:
    cfg = server_config("evaluate.vllm", {
        "executable": vc.engine_executable(vc.FAKE_SPEC if args.fake else None), "extra_args": args.vllm_arg,
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": 4096, "startup_timeout_s": 900})
    spec = {"method": "eagle3", "model": str(Path(args.draft).resolve()), "num_speculative_tokens": 3}
    target = {"model": str(Path(args.model).resolve())}
    with serving(cfg, target, ["--speculative-config", json.dumps(spec)], work / "spec.log", 64) as server:
        for text in ("Write a haiku about the sea.", "What is 17 times 23?", "Name three prime numbers."):
            server.chat([{"role": "user", "content": text}])
        port = int(server.http.base_url.rsplit(":", 1)[1])
        page = server.http.get_text("/metrics")
        return {"metrics": families(page, lambda n: n.startswith("vllm:spec_decode_") or n in NEIGHBOURS),
                "models_spec_server": call(port, "GET", "/v1/models"),
                "health_spec_server": call(port, "GET", "/health")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF target dir")
    p.add_argument("--draft", help="an exported eagle3/ folder: also record the speculative server's fixtures")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeat)")
    p.add_argument("--fake", action="store_true", help="the fake engines of tests/ instead of vLLM")
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny Llama and the fake engines")
    p.add_argument("--work")
    p.add_argument("--out", required=True, help="folder for the fixture files")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-fixtures-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.model, args.fake = str(vc.tiny_llama(work / "target")), True
        args.draft = str(work / "draft")
        Path(args.draft).mkdir(exist_ok=True)
        (Path(args.draft) / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
        (Path(args.draft) / "model.safetensors").write_bytes(b"")
    elif not args.model:
        p.error("--model (or --smoke) is required")
    fixtures = extraction_fixtures(args, work)
    if args.draft:
        fixtures.update(spec_fixtures(args, work))
    version = (fixtures["version"].get("json") or {}).get("version", "unknown")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, value in fixtures.items():
        path = out / f"vllm_{version}_{name}.{'txt' if isinstance(value, str) else 'json'}"
        path.write_text(value if isinstance(value, str) else json.dumps(value, indent=1) + "\n")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
