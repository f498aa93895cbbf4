"""What an extraction server does when requests are aborted while queued, and when a shard job is killed.

    python3 bench/vllm_abort_probe.py --model models/SmolLM2-135M-Instruct --vllm-arg=--enforce-eager \
        --out bench/results/vllm_abort_probe.json
    python3 bench/vllm_abort_probe.py --smoke --work W --out W/vllm_abort_probe.json   # CPU, fake engine

vLLM 0.25 / 0.26 crash (by their code: the hidden-states connector's `request_finished` pops an entry made only
when a request is first scheduled) when a request that waits in the scheduler's queue is aborted, and a client's
disconnect aborts its request. The project's clients therefore talk to a relay (`eagle3build.engine.relay`) that
keeps every request open until vLLM answers. The server is started as a shard job starts it
(`eagle3build.extraction.vllm.extract_shard_vllm`), then:
  relay-flood   N requests of L tokens on raw sockets to the relay's port; the last M closed with RST after
                --abort-after-s (long enough for vLLM to have admitted them to its queue); then /health of relay
                and engine, crash markers in the server log, a fresh request, and the connector files left
                once everything settled (the relay deletes the files of requests whose client left)
  engine-flood  the same straight to vLLM's own port (what a client without the relay does): a crash here and
                none through the relay is the relay's reason to exist
  recovery      the seconds a shard job then takes to get a working server (a crashed one is replaced)
  killed-job    a shard job (concurrency 64) SIGKILLed once its first connector file appeared; the server's
                health, crash markers, orphaned connector files and the job's partial outputs afterwards
A reset request that the server had answered already leaves its file to its client: such files count in
connector_files_left. A flood whose aborted requests never reached the engine's queue shows nothing: `queued_when_aborted` reads the
engine's `vllm:num_requests_waiting` gauge at the moment of the abort (None where /metrics is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
import vllm_common as vc

from eagle3build.engine import process
from eagle3build.engine.vllm_server import SERVED_MODEL_NAME
from eagle3build.extraction.vllm import VllmServer, extract_shard_vllm, stop_servers
from eagle3build.shards import write_tokens

BENCH = "vllm_abort_probe"
# What a dying engine core logs. Not "Traceback": the relay's HTTP server prints one for every client that
# resets a kept-alive connection, which is what the probe does on purpose.
CRASH_MARKERS = ("KeyError", "EngineDeadError", "EngineCore encountered", "AssertionError")


def get(port: int, path: str, timeout: float = 3.0) -> tuple[int | str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError) as e:
        return type(e).__name__, ""


def waiting_requests(port: int) -> float | None:
    status, text = get(port, "/metrics")
    if status != 200:
        return None
    values = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith("vllm:num_requests_waiting")]
    return sum(values) if values else None


def one_request(port: int, ids: list[int]) -> str:
    body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            path = json.loads(r.read())["kv_transfer_params"]["hidden_states_path"]
        vc.wait_and_delete(path)
        return str(r.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except (OSError, ValueError, KeyError) as e:
        return type(e).__name__


def settled_files(folder: Path, quiet_s: float = 2.0, limit_s: float = 120.0) -> dict:
    """The connector folder once nothing has changed in it for quiet_s."""
    last, since, deadline = None, time.time(), time.time() + limit_s
    while time.time() < deadline:
        now = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet_s:
            break
        time.sleep(0.1)
    return {"safetensors": sum(n.endswith(".safetensors") for n in last),
            "locks": sum(n.endswith(".lock") for n in last)}


def crash_markers(log: Path, since: int) -> dict:
    text = log.read_text(errors="replace")[since:] if log.exists() else ""
    return {k: text.count(k) for k in CRASH_MARKERS if k in text}


def flood(port: int, metrics_port: int, args, seed: int) -> dict:
    """N raw-socket requests, the last M reset after --abort-after-s; the others read to the end."""
    g = torch.Generator().manual_seed(seed)
    socks, start = [], time.time()
    for _ in range(args.requests):
        ids = torch.randint(10, args.vocab, (args.prompt_tokens,), generator=g).tolist()
        body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0}).encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close"
                  + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        socks.append(s)
    out = {"requests": args.requests, "aborted": args.abort, "prompt_tokens": args.prompt_tokens,
           "send_s": time.time() - start}
    time.sleep(args.abort_after_s)
    out["queued_when_aborted"] = waiting_requests(metrics_port)
    for s in socks[args.requests - args.abort:]:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST: an abrupt disconnect
        s.close()
    out["aborted_at_s"] = time.time() - start
    statuses: dict[str, int] = {}
    for s in socks[: args.requests - args.abort]:
        s.settimeout(300)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
            code = data.split(b" ", 2)[1].decode() if data else "empty"
            if code == "200":
                vc.wait_and_delete(json.loads(data.split(b"\r\n\r\n", 1)[1])["kv_transfer_params"]["hidden_states_path"])
        except (OSError, ValueError, KeyError, IndexError) as e:
            code = type(e).__name__
        statuses[code] = statuses.get(code, 0) + 1
        s.close()
    out["answered"] = statuses
    out["done_s"] = time.time() - start
    return out


def after(server: VllmServer, state, log_start: int) -> dict:
    time.sleep(1.0)
    return {"relay_health": get(state.port, "/health")[0], "engine_health": get(state.upstream_port, "/health")[0],
            "relay_alive": process.alive(state.pid, state.start_ticks), "crash_markers": crash_markers(server.log_path, log_start),
            "fresh_request": one_request(state.port, list(range(20, 84))),
            "connector_files_left": settled_files(server.storage_path)}


def killed_job(server: VllmServer, state, args, work: Path) -> dict:
    big = work / "big.safetensors"
    g = torch.Generator().manual_seed(3)
    write_tokens(big, [torch.randint(10, args.vocab, (args.job_tokens,), generator=g) for _ in range(args.job_samples)],
                 [torch.ones(args.job_tokens)] * args.job_samples, {"tokenizer": "synthetic"})
    log_start = server.log_path.stat().st_size if server.log_path.exists() else 0
    before = set(server.storage_path.iterdir())
    job = subprocess.Popen([sys.executable, __file__, "_job", json.dumps(vars(args)), str(big), str(work / "killed")])
    start, seen = time.time(), None
    while time.time() - start < args.kill_after_s and job.poll() is None:
        if set(server.storage_path.iterdir()) - before:
            seen = time.time() - start
            break
        time.sleep(0.005)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    out = {"killed_after_s": time.time() - start, "first_connector_file_at_s": seen}
    state = server.read_state() or state
    out.update(after(server, state, log_start))
    out["partial_outputs"] = sorted(p.name for p in work.glob("killed*"))
    return out


def params_of(args) -> dict:
    env = dict(json.loads(args.engine_env)) if args.engine_env else {}
    return vc.extract_params(args.model, "bf16", 64, fake=args.fake, max_length=max(args.prompt_tokens, args.job_tokens, 64),
                             gpu_memory_utilization=args.gpu_memory_utilization, extra_args=args.vllm_arg, env=env)


def run(args) -> dict:
    work = Path(args.work)
    run_dir = work / "run"
    args.run_dir = str(run_dir)
    args.vocab = vc.model_shape(args.model)[2]
    warm = work / "warm.safetensors"
    write_tokens(warm, [list(range(20, 84))] * 2, [[1] * 64] * 2, {"tokenizer": "synthetic"})
    extract_shard_vllm(str(warm), str(work / "warm-out.safetensors"), params_of(args), str(run_dir))
    server = VllmServer(run_dir, params_of(args))
    result = {"command": " ".join(sys.argv), "engine": "fake" if args.fake else "vllm"}
    try:
        for phase, seed in (("relay_flood", 7), ("engine_flood", 8)):
            state = server.read_state()
            log_start = server.log_path.stat().st_size
            port = state.port if phase == "relay_flood" else state.upstream_port
            result[phase] = flood(port, state.upstream_port, args, seed)
            result[phase].update(after(server, state, log_start))
            print(phase, json.dumps(result[phase]), flush=True)
        start = time.time()  # a crashed server is replaced by the next job that needs it
        extract_shard_vllm(str(warm), str(work / "warm-out.safetensors"), params_of(args), str(run_dir))
        result["recovery"] = {"seconds": time.time() - start, "same_server": server.read_state().pid == state.pid}
        result["killed_job"] = killed_job(server, server.read_state(), args, work)
        print("killed_job", json.dumps(result["killed_job"]), flush=True)
    finally:
        stop_servers(run_dir)
    return result


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "_job":  # the shard job that killed-job kills
        args = argparse.Namespace(**json.loads(sys.argv[2]))
        extract_shard_vllm(sys.argv[3], sys.argv[4] + ".safetensors", params_of(args), args.run_dir)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF target dir")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--abort", type=int, default=100, help="the last ones of --requests, reset")
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--abort-after-s", type=float, default=2.5)
    p.add_argument("--job-samples", type=int, default=600)
    p.add_argument("--job-tokens", type=int, default=1500)
    p.add_argument("--kill-after-s", type=float, default=60.0, help="at the latest; else at the first file")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeat)")
    p.add_argument("--engine-env", help="JSON of extra server environment")
    p.add_argument("--fake", action="store_true", help="tests/fake_vllm_server.py instead of vLLM")
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny Llama, the fake engine with a queue")
    p.add_argument("--work")
    p.add_argument("--out", help="results file (default bench/results/vllm_abort_probe.json)")
    args = p.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="vllm-abort-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.smoke:  # one request runs at a time, each 0.5 s: the flood queues
        control = Path(args.work) / "control.json"
        control.write_text(json.dumps({"fault": "slow:0.5", "remaining": -1}))
        args.model, args.fake = str(vc.tiny_llama(Path(args.work) / "target")), True
        args.engine_env = json.dumps({"FAKE_VLLM_MAX_RUNNING": "1", "FAKE_VLLM_CONTROL": str(control)})
        args.requests, args.abort, args.prompt_tokens, args.abort_after_s = 8, 3, 32, 0.3
        args.job_samples, args.job_tokens, args.kill_after_s = 16, 32, 10.0
    elif not args.model:
        p.error("--model (or --smoke) is required")
    result = run(args)
    from results import record

    print("recorded in", record(BENCH, vc.device_name(), result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
