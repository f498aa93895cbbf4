"""A stand-in for `vllm serve` with the extract_hidden_states method and ExampleHiddenStatesConnector.

Run as `python tests/fake_vllm_server.py serve MODEL --port P ...` (what VllmServer launches when
extract.vllm.executable is [python, this file]). It answers as vLLM 0.25.0 does (recorded from the
real engine: tests/fixtures/vllm_0.25.0_*.json, checked in tests/test_vllm_backend.py): GET /health (200,
empty body), /version, /v1/models; POST /v1/completions with prompt token ids, answered with the top-level
`kv_transfer_params.hidden_states_path` naming `{shared_storage_path}/{internal request id}.safetensors`
(`cmpl-<16 hex>-0-<8 hex>`, not the response id; `token_ids` int64 [T] then `hidden_states` bf16
[T, n_ids, H]), written just after the response while `<file>.lock` is held with LOCK_EX, and the .lock
left behind, like the real connector; errors as `{"error": {"message", "type", "param", "code"}}` with
vLLM's messages (empty prompt, out-of-vocabulary id, prompt + max_tokens > max_model_len: 400; unknown
model: 404). Hidden states are a deterministic function of the token ids (`expected_hidden`).

Like the real engine it runs at most FAKE_VLLM_MAX_RUNNING requests at once; the others wait in a queue.
A client that disconnects makes vLLM abort its request; in vLLM < 0.33 aborting a request that is still
queued crashes the engine (the hidden-states connector's KeyError), and so does the fake: it exits, and
every client of the server loses it. In 0.33 and later the queued request is just dropped.
It refuses `--no-enable-chunked-prefill` (vLLM itself only warns that outputs may be wrong).

Behaviour switches (environment, read at startup):
  FAKE_VLLM_HIDDEN_SIZE   H (default 16)
  FAKE_VLLM_VERSION       the vLLM version it plays (default 0.25.0, the pinned image's)
  FAKE_VLLM_MAX_RUNNING   requests the engine runs at once (default 64)
  FAKE_VLLM_VOCAB_SIZE    ids it accepts when MODEL is not a folder with a config.json (default 32000)
  FAKE_VLLM_STARTUP       "crash" (exit 1 after an error message) or "delay:S" (S seconds before listening)
  FAKE_VLLM_IGNORE_SIGTERM=1  ignore SIGTERM (the manager must fall back to SIGKILL)
  FAKE_VLLM_WRITE_DELAY_S  seconds between the answer and the connector's write (default 0.05: a client
                          must wait on the lock); 0 for throughput benchmarks
  FAKE_VLLM_FAST_STATES=1 states from a precomputed table (`fast_hidden_bits`), still a function of the
                          ids, so that a large H (4096) costs the engine a copy, not a sin per value
  FAKE_VLLM_CONTROL       a JSON file {"fault": KIND, "remaining": N} read on every completion: the
                          next N completions get the fault (N = -1: all). KIND: http500, corrupt,
                          wrong_ids, nan, bad_shape, no_params, outside_path, hang, slow:S (runs S
                          seconds, holding its place in the engine).
It also starts one "worker" child in its process group (like vLLM's engine core) and logs its pid.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np


def expected_hidden(token_ids, layer_ids: list[int], hidden_size: int) -> np.ndarray:
    """Deterministic [T, n_ids, H] float32 "hidden states": a function of token, position and layer."""
    t = np.asarray(token_ids, dtype=np.float64).reshape(-1, 1, 1)
    pos = np.arange(t.shape[0], dtype=np.float64).reshape(-1, 1, 1)
    layer = np.asarray(layer_ids, dtype=np.float64).reshape(1, -1, 1)
    h = np.arange(hidden_size, dtype=np.float64).reshape(1, 1, -1)
    return (np.sin(0.37 * (t + 1) * (h + 1) / hidden_size + 0.11 * layer) * (1 + 0.01 * pos)).astype(
        np.float32
    )


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even like torch."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    bits[np.isnan(x)] = 0x7FC0
    return bits


FAST_TABLE_ROWS = 251  # fast states repeat with the token id modulo this


def fast_hidden_bits(token_ids, layer_ids: list[int], hidden_size: int, _cache: dict = {}) -> np.ndarray:  # noqa: B006
    """bf16 bits [T, n_ids, H] of `expected_hidden` of (token id mod FAST_TABLE_ROWS) at position 0: one
    gather from a table computed once per shape."""
    key = (tuple(layer_ids), hidden_size)
    if key not in _cache:
        rows = [expected_hidden([i], layer_ids, hidden_size) for i in range(FAST_TABLE_ROWS)]
        _cache[key] = to_bf16_bits(np.concatenate(rows))
    return _cache[key][np.asarray(token_ids, dtype=np.int64) % FAST_TABLE_ROWS]


def save_safetensors(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write {name: (safetensors dtype, array)} in the safetensors layout (numpy only: starts fast)."""
    header, arrays, offset = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        arr = np.ascontiguousarray(arr)
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        arrays.append(arr)
        offset += arr.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for arr in arrays:  # straight from the arrays' memory: no joined copy of a large file
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))


class _Faults:
    """Reads the control file and hands out one fault per completion while any remain."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.lock = threading.Lock()

    def next(self) -> str | None:
        if self.path is None or not self.path.exists():
            return None
        with self.lock:
            ctl = json.loads(self.path.read_text() or "{}")
            remaining = ctl.get("remaining", 0)
            if not ctl.get("fault") or remaining == 0:
                return None
            if remaining > 0:
                ctl["remaining"] = remaining - 1
                self.path.write_text(json.dumps(ctl))
            return ctl["fault"]


def _client_gone(sock: socket.socket) -> bool:
    """A client waiting for its answer sends nothing: a readable socket means it closed (or reset) it."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class _Engine:
    """The scheduler's view: a bounded number of running requests and a queue for the rest."""

    def __init__(self, max_running: int, version: str, worker: subprocess.Popen):
        self.slots = threading.Semaphore(max_running)
        self.version = version
        self.crashes_on_queued_abort = tuple(int(x) for x in version.split(".")[:2]) < (0, 33)
        self.worker = worker

    def admit(self, sock: socket.socket, req_id: str) -> bool:
        """Wait for a running slot; False when the client left while the request was queued (aborted)."""
        while not self.slots.acquire(timeout=0.02):
            if _client_gone(sock):
                if self.crashes_on_queued_abort:
                    print(f"ERROR EngineCore encountered a fatal error (fake vLLM {self.version}): request "
                          f"{req_id} aborted while waiting\nKeyError: '{req_id}'", flush=True)
                    self.worker.kill()
                    os._exit(1)
                return False
        return True


def _write_connector_file(path: str, lock_fd: int, tensors: dict, delay_s: float) -> None:
    try:
        time.sleep(delay_s)  # the client must wait on the lock, not see a half-written file
        save_safetensors(path, tensors)
    finally:
        os.close(lock_fd)  # releases LOCK_EX


def _error(code: int, message: str, param: str | None = None) -> tuple[int, dict]:
    """vLLM's error body (0.25.0)."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(code, "InternalServerError")
    return code, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def check_completion(req: dict, served_name: str | None, max_model_len: int | None, vocab_size: int):
    """The error vLLM 0.25.0 answers for this completion request, or None (the messages as it words them)."""
    if served_name and req.get("model") != served_name:
        return _error(404, f"The model `{req.get('model')}` does not exist.", "model")
    prompt, max_tokens = req.get("prompt"), int(req.get("max_tokens") or 16)
    if not isinstance(prompt, list) or not prompt:
        return _error(400, "You must pass at least one prompt")
    if not all(isinstance(x, int) for x in prompt):
        return _error(400, "the fake serves token-id prompts only")
    bad = [x for x in prompt if not 0 <= x < vocab_size]
    if bad:
        return _error(400, f"Token id {bad[0]} is out of vocabulary")
    if max_model_len and len(prompt) + max_tokens > max_model_len:
        n = len(prompt)
        return _error(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                      f"requested {max_tokens} output tokens and your prompt contains at least {n} input "
                      f"tokens, for a total of at least {n + max_tokens} tokens. Please reduce the length of "
                      f"the input prompt or the number of requested output tokens. (parameter=input_tokens, "
                      f"value={n})", "input_tokens")
    return None


def completion_body(req_id: str, served: str, prompt: list[int], max_tokens: int, version: str,
                    kv_transfer_params: dict | None) -> dict:
    """A completion as vLLM 0.25.0 answers it (tests/fixtures/vllm_0.25.0_completions_extract.json)."""
    choice = {"index": 0, "text": "x" * max_tokens, "logprobs": None, "finish_reason": "length", "stop_reason": None,
              "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
    return {"id": req_id, "object": "text_completion", "created": int(time.time()), "model": served,
            "choices": [choice], "service_tier": None, "system_fingerprint": f"vllm-{version}-fake",
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + max_tokens,
                      "completion_tokens": max_tokens, "prompt_tokens_details": None},
            "kv_transfer_params": kv_transfer_params, "metrics": None}


def make_handler(args, layer_ids: list[int], hidden_size: int, storage: Path, faults: _Faults, engine: _Engine,
                 vocab_size: int):
    served = args.served_model_name or args.model
    fast_states = os.environ.get("FAKE_VLLM_FAST_STATES") == "1"
    write_delay_s = float(os.environ.get("FAKE_VLLM_WRITE_DELAY_S", "0.05"))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # keep the server log short
            pass

        def version_string(self) -> str:
            return "uvicorn"

        def _send(self, code: int, obj: dict | None) -> None:
            body = json.dumps(obj).encode() if obj is not None else b""
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            if obj is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Vary", "Origin")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, None)  # vLLM: 200 with an empty body
            elif self.path == "/version":
                self._send(200, {"version": engine.version})
            elif self.path == "/v1/models":
                model = {"id": served, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                         "root": args.model, "parent": None, "max_model_len": args.max_model_len, "permission": []}
                self._send(200, {"object": "list", "data": [model]})
            else:
                self._send(*_error(404, "Not Found"))

        def do_POST(self):
            if self.path != "/v1/completions":
                return self._send(*_error(404, "Not Found"))
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            rejected = check_completion(req, args.served_model_name, args.max_model_len, vocab_size)
            if rejected:
                return self._send(*rejected)
            prompt, max_tokens = req["prompt"], int(req.get("max_tokens") or 16)
            fault = faults.next()
            if fault == "hang":
                time.sleep(3600)
            if fault == "http500":
                return self._send(*_error(500, "injected failure"))
            # vLLM's response id, and the internal request id that names the connector's file
            req_id = f"cmpl-{uuid.uuid4().hex[:16]}"
            if fault == "no_params":
                return self._send(200, completion_body(req_id, served, prompt, max_tokens, engine.version, None))
            if not engine.admit(self.connection, req_id):
                self.close_connection = True
                return
            try:
                if fault and fault.startswith("slow:"):
                    time.sleep(float(fault.split(":", 1)[1]))
                path = self._save(f"{req_id}-0-{uuid.uuid4().hex[:8]}", prompt, fault)
            finally:
                engine.slots.release()
            self._send(200, completion_body(req_id, served, prompt, max_tokens, engine.version,
                                            {"hidden_states_path": path}))

        def _save(self, internal_id: str, prompt: list[int], fault: str | None) -> str:
            """Start the connector's write of the prompt's states; the file comes after the answer."""
            folder = storage.parent if fault == "outside_path" else storage
            path = str(folder / f"{internal_id}.safetensors")
            ids = np.asarray(prompt, dtype=np.int64)
            if fast_states:
                bits = fast_hidden_bits(ids, layer_ids, hidden_size)
            else:
                bits = to_bf16_bits(expected_hidden(ids, layer_ids, hidden_size))
            if fault == "wrong_ids":
                ids = ids[::-1] + 1
            if fault == "nan":
                bits[len(prompt) // 2, 1, 0] = 0x7FC0
            if fault == "bad_shape":
                bits = bits[:, :-1]
            lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # like the connector: before the path is handed out
            if fault == "corrupt":
                Path(path).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
                os.close(lock_fd)
            else:  # vLLM writes token_ids first, and never deletes the .lock
                tensors = {"token_ids": ("I64", ids), "hidden_states": ("BF16", bits)}
                threading.Thread(target=_write_connector_file, args=(path, lock_fd, tensors, write_delay_s)).start()
            return path

    return Handler


def _vocab_size(model: str) -> int:
    """The target's vocab_size (its config.json when the model is a folder), else FAKE_VLLM_VOCAB_SIZE."""
    config = Path(model) / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        vocab = (cfg.get("text_config") or cfg).get("vocab_size")
        if vocab:
            return int(vocab)
    return int(os.environ.get("FAKE_VLLM_VOCAB_SIZE", "32000"))


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] != "serve":
        print("usage: fake_vllm_server.py serve MODEL [options]", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--speculative-config", required=True)
    parser.add_argument("--kv-transfer-config", required=True)
    parser.add_argument("--no-enable-chunked-prefill", action="store_true")
    parser.add_argument("--enable-chunked-prefill", action="store_true")
    args, rest = parser.parse_known_args(sys.argv[2:])
    print(f"fake vllm serve: starting pid {os.getpid()} model {args.model} extra {rest}", flush=True)

    spec, kv = json.loads(args.speculative_config), json.loads(args.kv_transfer_config)
    if (
        spec.get("method") != "extract_hidden_states"
        or kv.get("kv_connector") != "ExampleHiddenStatesConnector"
    ):
        print("error: needs the extract_hidden_states method and ExampleHiddenStatesConnector", flush=True)
        return 2
    if args.no_enable_chunked_prefill:
        print("error: --no-enable-chunked-prefill: vLLM warns it may crash or give incorrect outputs, sizes "
              "the step to max_model_len and asserts on hybrid targets; extraction keeps it on", flush=True)
        return 2
    layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    storage = Path(kv["kv_connector_extra_config"]["shared_storage_path"])
    hidden_size = int(os.environ.get("FAKE_VLLM_HIDDEN_SIZE", "16"))

    startup = os.environ.get("FAKE_VLLM_STARTUP", "")
    if startup == "crash":
        print("torch.OutOfMemoryError: CUDA out of memory (fake)", flush=True)
        return 1
    if startup.startswith("delay:"):
        time.sleep(float(startup.split(":", 1)[1]))
    if os.environ.get("FAKE_VLLM_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"fake vllm serve: worker pid {worker.pid}", flush=True)
    version = os.environ.get("FAKE_VLLM_VERSION", "0.25.0")
    print(f"fake vllm serve: vLLM API server version {version}", flush=True)
    engine = _Engine(int(os.environ.get("FAKE_VLLM_MAX_RUNNING", "64")), version, worker)
    storage.mkdir(parents=True, exist_ok=True)
    handler = make_handler(args, layer_ids, hidden_size, storage, _Faults(os.environ.get("FAKE_VLLM_CONTROL")),
                           engine, _vocab_size(args.model))
    ThreadingHTTPServer.request_queue_size = 1024  # uvicorn's backlog is 2048; socketserver's 5
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    print(f"fake vllm serve: listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
