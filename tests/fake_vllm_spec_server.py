"""A stand-in for `vllm serve` with an EAGLE-3 draft (`--speculative-config '{"method": "eagle3", ...}'`).

Run as `python tests/fake_vllm_spec_server.py serve MODEL --port P ...` (what the vllm evaluation backend
launches when evaluate.vllm.executable is [python, this file]). It honours vLLM's HTTP contract:
GET /health; POST /v1/chat/completions (answers from `fake_openai_server.fake_answer`, one token per word,
`usage.completion_tokens`; a prompt plus max_tokens over --max-model-len gets vLLM's HTTP 400 "maximum
context length" answer); GET /metrics, a Prometheus page written by prometheus_client with vLLM's own
metric names and labels (vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/loggers.py): counters
`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos` (labels model_name, engine, position), exposed with the `_total` suffix,
`vllm:request_success` (finished_reason), gauges `vllm:num_requests_running` / `_waiting`, a histogram.

Acceptance is what the test asks for: a user message containing `accept:DIGITS` drafts one round per
digit, accepting that many tokens (at most k); at a temperature > 0 `sampled:DIGITS` does, when the message
has it; without either, every two answer tokens are one round accepting one. The sampling fields are
checked as vLLM's request validation does (`temperature` >= 0, `top_p` in (0, 1], `seed` an integer;
HTTP 400 otherwise). Requests go to engines 0, 1, ... in turn (--data-parallel-size), so counters have one series per
engine. Without --speculative-config there are no spec-decode metrics and every token costs a step.

Switches (environment): FAKE_VLLM_STARTUP "crash" (exit 1 after an error message) or "delay:S";
FAKE_VLLM_METRICS_LAG_S (counters move this long after the answer, as a real engine's may);
FAKE_VLLM_STEP_S (seconds per decoding step, default 0.002); FAKE_VLLM_ARGV (a file that gets a line
{"argv", "env"} per start: the arguments after the program and VLLM_USE_FLASHINFER_SAMPLER);
FAKE_VLLM_REQUESTS (a file that gets a line {"content", "temperature", "top_p", "seed"} per chat request:
the last user message and the sampling fields as sent, absent ones null).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai_server import fake_answer  # noqa: E402

TOO_LONG = (
    "This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
    "({prompt} in the messages, {completion} in the completion). Please reduce the length of the messages "
    "or completion."
)


def rounds(messages: list[dict], answer_tokens: int, k: int, temperature: float = 0.0) -> list[int]:
    """Accepted tokens of each verification round of one request (see the module docstring)."""
    content = messages[-1]["content"]
    match = (temperature > 0 and re.search(r"sampled:(\d+)", content)) or re.search(r"accept:(\d+)", content)
    if match:
        return [min(int(d), k) for d in match.group(1)]
    return [1] * (answer_tokens // 2)


class Metrics:
    """vLLM's spec-decode and request metrics in a registry of their own."""

    def __init__(self, model_name: str, engines: int, k: int | None):
        self.registry = CollectorRegistry()
        self.k, self.lock = k, threading.Lock()
        labels = ["model_name", "engine"]
        self.engines = [[model_name, str(i)] for i in range(engines)]
        def counter(name: str, doc: str, extra: tuple = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=self.registry)

        self.success = counter("vllm:request_success", "Count of successfully processed requests.",
                               ["finished_reason"])
        self.running, self.waiting = (Gauge(name, "Number of requests.", labels, registry=self.registry)
                                      for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        self.latency = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency.",
                                 labels, registry=self.registry)
        for engine in self.engines:
            self.running.labels(*engine).set(0)
            self.waiting.labels(*engine).set(0)
        if k is None:
            return
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted tokens per draft position.", ["position"])
        for engine in self.engines:  # vLLM creates every series at start: they read 0 before any request
            for c in (self.drafts, self.draft_tokens, self.accepted):
                c.labels(*engine)
            for pos in range(k):
                self.per_pos.labels(*engine, str(pos))

    def arrive(self, engine: int) -> None:
        with self.lock:
            self.running.labels(*self.engines[engine]).inc()

    def record(self, engine: int, accepts: list[int], finish: str, seconds: float) -> None:
        """A finished request's counts, with the running gauge, in one update (as vLLM's stat logger)."""
        labels = self.engines[engine]
        with self.lock:
            self.running.labels(*labels).dec()
            self.success.labels(*labels, finish).inc()
            self.latency.labels(*labels).observe(seconds)
            if self.k is None:
                return
            self.drafts.labels(*labels).inc(len(accepts))
            self.draft_tokens.labels(*labels).inc(len(accepts) * self.k)
            self.accepted.labels(*labels).inc(sum(accepts))
            for pos in range(self.k):
                self.per_pos.labels(*labels, str(pos)).inc(sum(a > pos for a in accepts))

    def page(self) -> bytes:
        with self.lock:
            return generate_latest(self.registry)


SAMPLING_FIELDS = ("temperature", "top_p", "seed")


def sampling_error(req: dict) -> str | None:
    """vLLM's refusal of a request's sampling fields (SamplingParams' checks), or None when they are valid.
    An absent temperature is the model's default (generation_config's, else 1.0)."""
    temperature, top_p, seed = (req.get(f) for f in SAMPLING_FIELDS)
    if temperature is not None and (not isinstance(temperature, int | float) or temperature < 0):
        return f"temperature must be non-negative, got {temperature}."
    if top_p is not None and (not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        return f"top_p must be in (0, 1], got {top_p}."
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not -2**63 <= seed < 2**63):
        return f"seed: Input should be a valid integer, got {seed!r}"
    return None


def make_handler(args, metrics: Metrics, k: int | None):
    step_s = float(os.environ.get("FAKE_VLLM_STEP_S", "0.002"))
    lag_s = float(os.environ.get("FAKE_VLLM_METRICS_LAG_S", "0"))
    served = {"n": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            pass

        def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                self._send(200, metrics.page(), "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path != "/v1/chat/completions":
                return self._send(404, b'{"error": "not found"}')
            if req.get("model") != args.served_model_name:
                missing = {"message": f"The model `{req.get('model')}` does not exist."}
                return self._send(404, json.dumps(missing).encode())
            messages, max_tokens = req["messages"], int(req["max_tokens"])
            prompt = sum(len(m["content"].split()) + 4 for m in messages)
            if args.max_model_len and prompt + max_tokens > args.max_model_len:
                message = TOO_LONG.format(limit=args.max_model_len, total=prompt + max_tokens, prompt=prompt,
                                          completion=max_tokens)
                body = {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
                return self._send(400, json.dumps(body).encode())
            invalid = sampling_error(req)
            if invalid:
                body = {"object": "error", "message": invalid, "type": "BadRequestError", "code": 400}
                return self._send(400, json.dumps(body).encode())
            if os.environ.get("FAKE_VLLM_REQUESTS"):
                seen = {"content": messages[-1]["content"], **{f: req.get(f) for f in SAMPLING_FIELDS}}
                with lock, open(os.environ["FAKE_VLLM_REQUESTS"], "a") as f:
                    f.write(json.dumps(seen) + "\n")
            content, finish = fake_answer(messages, max_tokens)
            tokens = len(content.split(" "))
            temperature = 1.0 if req.get("temperature") is None else float(req["temperature"])
            accepts = rounds(messages, tokens, k, temperature) if k else []
            with lock:
                engine = served["n"] % len(metrics.engines)
                served["n"] += 1
            metrics.arrive(engine)
            start = time.perf_counter()
            time.sleep(step_s * (len(accepts) if k else tokens))
            record = (engine, accepts, finish, time.perf_counter() - start)
            if lag_s:
                threading.Timer(lag_s, metrics.record, record).start()
            else:
                metrics.record(*record)
            body = {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": args.served_model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": tokens,
                          "total_tokens": prompt + tokens},
            }
            self._send(200, json.dumps(body).encode())

    return Handler


def speculative_k(spec_json: str | None) -> int | None:
    """k of an eagle3 speculative config whose draft folder holds an export; exits like vLLM otherwise."""
    if spec_json is None:
        return None
    spec = json.loads(spec_json)
    if spec.get("method") != "eagle3" or not isinstance(spec.get("num_speculative_tokens"), int):
        sys.exit(f"error: expected an eagle3 speculative config with num_speculative_tokens, got {spec}")
    if spec.get("draft_sample_method", "greedy") not in ("greedy", "probabilistic"):
        sys.exit(f"error: draft_sample_method must be 'greedy' or 'probabilistic', got {spec['draft_sample_method']}")
    if not (Path(spec["model"]) / "config.json").is_file():
        sys.exit(f"error: no draft config.json in {spec['model']}")
    return spec["num_speculative_tokens"]


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] != "serve":
        print("usage: fake_vllm_spec_server.py serve MODEL [options]", file=sys.stderr)
        return 2
    if os.environ.get("FAKE_VLLM_ARGV"):
        sampler = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")
        seen = {"argv": sys.argv[1:], "env": {"VLLM_USE_FLASHINFER_SAMPLER": sampler}}
        with open(os.environ["FAKE_VLLM_ARGV"], "a") as f:
            f.write(json.dumps(seen) + "\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--speculative-config")
    args, rest = parser.parse_known_args(sys.argv[2:])
    print(f"fake vllm serve: pid {os.getpid()} model {args.model} extra {rest}", flush=True)
    k = speculative_k(args.speculative_config)

    startup = os.environ.get("FAKE_VLLM_STARTUP", "")
    if startup == "crash":
        print("torch.OutOfMemoryError: CUDA out of memory (fake)", flush=True)
        return 1
    if startup.startswith("delay:"):
        time.sleep(float(startup.split(":", 1)[1]))
    metrics = Metrics(args.served_model_name, args.data_parallel_size, k)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args, metrics, k))
    server.daemon_threads = True
    print(f"fake vllm serve: listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
