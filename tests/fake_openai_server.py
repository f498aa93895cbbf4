"""A deterministic OpenAI-compatible chat server on 127.0.0.1, for tests (stdlib only).

The answer depends only on the request's messages: "reply {n}: {last user message reversed}" where n
counts the user messages, cut to `max_tokens` words (finish_reason "length" then). Knobs make the next
N chat requests fail with HTTP 500, hang past the client's timeout, or return a body that is not JSON.
As a program it stands in for `vllm serve MODEL --port P` (bench/quality.py's smoke run starts it as the
regeneration server): `python tests/fake_openai_server.py serve MODEL --port P [other flags ignored]`,
serving until SIGTERM.

Like a server started with a reasoning parser and a tool parser (vLLM's `ChatMessage`: `reasoning`,
formerly `reasoning_content`, which SGLang still uses; `tool_calls` in OpenAI form with the arguments as
a JSON string, finish_reason "tool_calls", content null when the answer is only a call):
- `reasoning_field` set: every answer carries "thinking about: {last user message}" in that field;
- `tool_call_when` set: a user message containing that text is answered with a call of `tool_name`
  (id "chatcmpl-tool-{n}"), and the answer after the tool result is "tool said: {result}".
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def fake_answer(messages: list[dict], max_tokens: int | None = None) -> tuple[str, str]:
    users = [m["content"] for m in messages if m["role"] == "user"]
    words = f"reply {len(users)}: {users[-1][::-1]}".split(" ")
    if max_tokens is not None and len(words) > max_tokens:
        return " ".join(words[:max_tokens]), "length"
    return " ".join(words), "stop"


class FakeOpenAIServer:
    def __init__(self, model: str = "fake-model", delay_s: float = 0.0, hang_s: float = 2.0, port: int = 0):
        self.model = model
        self.delay_s = delay_s  # every chat answer waits this long (to observe concurrency)
        self.hang_s = hang_s
        self.fail_next = 0  # the next N chat requests get HTTP 500
        self.hang_next = 0  # the next N chat requests sleep hang_s before answering
        self.garbage_next = 0  # the next N chat requests get a body that is not JSON
        self.fail_if_contains: str | None = None  # always HTTP 500 when a user message contains this
        self.reasoning_field: str | None = None  # "reasoning" (vLLM) or "reasoning_content" (SGLang)
        self.tool_call_when: str | None = None  # a user message containing this gets a tool call
        self.tool_name = "get_weather"
        self.requests: list[dict] = []  # chat request bodies, in arrival order
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, knob: str) -> bool:
        """Consume one unit of a failure knob; True when this request should misbehave."""
        if getattr(self, knob) > 0:
            setattr(self, knob, getattr(self, knob) - 1)
            return True
        return False

    def message(self, request: dict) -> tuple[dict, str]:
        """The assistant message and finish_reason, shaped like vLLM's ChatCompletionResponse choice."""
        messages = request["messages"]
        last_user = [m["content"] for m in messages if m["role"] == "user"][-1]
        message: dict = {"role": "assistant", "content": None}
        if self.reasoning_field:
            message[self.reasoning_field] = f"thinking about: {last_user}"
        if messages[-1]["role"] == "tool":
            message["content"] = f"tool said: {messages[-1]['content']}"
            return message, "stop"
        if self.tool_call_when and self.tool_call_when in last_user:
            calls = sum(1 for m in messages if m.get("tool_calls"))
            message["tool_calls"] = [{
                "id": f"chatcmpl-tool-{calls}", "type": "function",
                "function": {"name": self.tool_name, "arguments": json.dumps({"query": last_user})},
            }]
            return message, "tool_calls"
        message["content"], finish = fake_answer(messages, request.get("max_tokens"))
        return message, finish

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    body = {"object": "list", "data": [{"id": server.model, "object": "model"}]}
                    self._send(200, json.dumps(body).encode())
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                request = json.loads(self.rfile.read(length))
                if self.path != "/v1/chat/completions":
                    return self._send(404, b'{"error": "not found"}')
                with server._lock:
                    server.requests.append(request)
                    # One misbehaviour per request: fail, then hang, then garbage.
                    fail = server._take("fail_next")
                    hang = not fail and server._take("hang_next")
                    garbage = not (fail or hang) and server._take("garbage_next")
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                # The reply is computed first and the request leaves the in-flight count before a
                # byte is sent: a client may fire its next request as soon as it reads this one.
                reply = None
                try:
                    time.sleep(server.hang_s if hang else server.delay_s)
                    reply = self._reply(request, fail, garbage)
                finally:
                    with server._lock:
                        server.in_flight -= 1
                try:
                    self._send(*reply)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def _reply(self, request: dict, fail: bool, garbage: bool) -> tuple:
                if request.get("model") != server.model:
                    return 404, b'{"error": "model not found"}'
                poisoned = server.fail_if_contains and any(
                    server.fail_if_contains in m["content"] for m in request["messages"] if m["role"] == "user"
                )
                if fail or poisoned:
                    return 500, b'{"error": "internal error"}'
                if garbage:
                    return 200, b"<html>proxy error</html>", "text/html"
                message, finish = server.message(request)
                body = {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "model": server.model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                }
                return 200, json.dumps(body).encode()

        return Handler


def main(argv: list[str] | None = None) -> int:
    """`serve MODEL --port P`: serve MODEL's answers on 127.0.0.1:P until SIGTERM or SIGINT."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description="fake OpenAI-compatible chat server")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)  # vLLM's other flags (memory, lengths) mean nothing here
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with FakeOpenAIServer(model=args.model, port=args.port) as server:
        print(f"serving {args.model} at {server.url}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
