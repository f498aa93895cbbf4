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

Requests are checked as vLLM 0.25.0 checks them (`vllm_rejection`, from its ChatCompletionRequest,
ChatCompletionToolsParam / FunctionDefinition, chat_utils' message types, OnlineRenderer.render_chat and
SamplingParams._verify_args), with its error bodies: {"error": {"message", "type", "param", "code"}}.
- body validation (HTTP 400, type "Bad Request", message "N validation error(s):\n  {error}... [errors]"
  without FastAPI's endpoint lines): each tool must be {"type": "function", "function": {"name": str,
  "description"?: str, "parameters"?: object}} ('missing' at ('body', 'tools', i, 'function') for a bare
  {"name", ...}), `tools` not empty; message roles strings, content a string or a list (None only for
  an assistant), tool calls {"id": str, "type": "function", "function": {"name": str, "arguments":
  str}}; seed an int64, max_tokens an int, temperature / top_p numbers. vLLM reports union branches of a
  bad message one by one; here one error per bad field stands for them;
- an unknown model: HTTP 404 NotFoundError;
- tools with tool_choice "auto" (vLLM's default when tools are sent) on a server without a tool parser
  (`auto_tools` off, as `vllm serve` without --enable-auto-tool-choice): HTTP 400 BadRequestError;
- sampling: temperature in [0, 2], top_p in (0, 1], max_tokens >= 1 (HTTP 400 BadRequestError).
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

INT64 = 2**63


def _error(kind: str, loc: tuple, msg: str, value, **ctx) -> dict:
    """One pydantic error as FastAPI lists it (no url)."""
    error = {"type": kind, "loc": ("body", *loc), "msg": msg, "input": value}
    return {**error, "ctx": ctx} if ctx else error


def _model_error(value, loc: tuple, name: str) -> dict:
    return _error("model_type", loc, f"Input should be a valid dictionary or instance of {name}", value,
                  class_name=name)


def tool_errors(tools) -> list[dict]:
    """ChatCompletionRequest.tools: list[ChatCompletionToolsParam] | None."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        return [_error("list_type", ("tools",), "Input should be a valid list", tools)]
    if not tools:  # check_tool_usage, a model validator: reported at the body
        message = ("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                   "entirely.")
        return [_error("value_error", (), f"Value error, {message}", {"tools": tools}, error=message)]
    errors = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            errors.append(_model_error(tool, ("tools", i), "ChatCompletionToolsParam"))
            continue
        if tool.get("type", "function") != "function":
            errors.append(_error("literal_error", ("tools", i, "type"), "Input should be 'function'",
                                 tool["type"], expected="'function'"))
        function = tool.get("function")
        if "function" not in tool:
            errors.append(_error("missing", ("tools", i, "function"), "Field required", tool))
        elif not isinstance(function, dict):
            errors.append(_model_error(function, ("tools", i, "function"), "FunctionDefinition"))
        else:
            at = ("tools", i, "function")
            if "name" not in function:
                errors.append(_error("missing", (*at, "name"), "Field required", function))
            elif not isinstance(function["name"], str):
                errors.append(_error("string_type", (*at, "name"), "Input should be a valid string",
                                     function["name"]))
            if function.get("description") is not None and not isinstance(function["description"], str):
                errors.append(_error("string_type", (*at, "description"), "Input should be a valid string",
                                     function["description"]))
            if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
                errors.append(_error("dict_type", (*at, "parameters"), "Input should be a valid dictionary",
                                     function["parameters"]))
    return errors


def _call_errors(call, at: tuple) -> list[dict]:
    """ChatCompletionMessageFunctionToolCallParam: id, type "function", function {name, arguments: str}."""
    if not isinstance(call, dict):
        return [_model_error(call, at, "ChatCompletionMessageFunctionToolCallParam")]
    errors = [_error("missing", (*at, key), "Field required", call) for key in ("id", "function", "type")
              if key not in call]
    if call.get("type", "function") != "function":
        errors.append(_error("literal_error", (*at, "type"), "Input should be 'function'", call["type"]))
    function = call.get("function")
    if isinstance(function, dict):
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                errors.append(_error("string_type", (*at, "function", key), "Input should be a valid string",
                                     function.get(key)))
    elif "function" in call:
        errors.append(_model_error(function, (*at, "function"), "Function"))
    return errors


def message_errors(messages) -> list[dict]:
    """ChatCompletionRequest.messages: list[ChatCompletionMessageParam] (OpenAI's message types, vLLM's
    CustomChatCompletionMessageParam: any role string, content a string or parts)."""
    if not isinstance(messages, list):
        return [_error("list_type", ("messages",), "Input should be a valid list", messages)]
    errors = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            errors.append(_model_error(message, ("messages", i), "CustomChatCompletionMessageParam"))
            continue
        if "role" not in message:
            errors.append(_error("missing", ("messages", i, "role"), "Field required", message))
        elif not isinstance(message["role"], str):
            errors.append(_error("string_type", ("messages", i, "role"), "Input should be a valid string",
                                 message["role"]))
        content = message.get("content")
        if "content" in message and not (isinstance(content, str | list) or
                                         (content is None and message.get("role") == "assistant")):
            errors.append(_error("string_type", ("messages", i, "content"), "Input should be a valid string",
                                 content))
        for key in ("tool_call_id", "reasoning", "reasoning_content", "name"):
            if message.get(key) is not None and not isinstance(message[key], str):
                errors.append(_error("string_type", ("messages", i, key), "Input should be a valid string",
                                     message[key]))
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            errors.append(_error("list_type", ("messages", i, "tool_calls"), "Input should be a valid list",
                                 calls))
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            errors += _call_errors(call, ("messages", i, "tool_calls", j))
    return errors


def field_errors(request: dict) -> list[dict]:
    """The scalar fields the project sends: seed (int64), max_tokens, temperature, top_p."""
    errors = []
    for key in ("seed", "max_tokens", "max_completion_tokens"):
        value = request.get(key)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            errors.append(_error("int_type", (key,), "Input should be a valid integer", request[key]))
        elif key == "seed" and not -INT64 <= value < INT64:
            errors.append(_error("less_than_equal" if value > 0 else "greater_than_equal", (key,),
                                 f"Input should be {'less' if value > 0 else 'greater'} than or equal to "
                                 f"{INT64 - 1 if value > 0 else -INT64}", value))
    for key in ("temperature", "top_p"):
        value = request.get(key)
        if value is not None and not isinstance(value, int | float):
            errors.append(_error("float_type", (key,), "Input should be a valid number", value))
    return errors


def _body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def vllm_rejection(request: dict, model: str, auto_tools: bool) -> tuple[int, dict] | None:
    """(status, body) of vLLM 0.25.0's answer to a chat request it refuses; None when it accepts it."""
    errors = [*message_errors(request.get("messages")), *tool_errors(request.get("tools")),
              *field_errors(request)]
    if errors:  # FastAPI's RequestValidationError, as vllm/entrypoints/serve/utils/server_utils.py words it
        head = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:\n"
        message = (head + "".join(f"  {e}\n" for e in errors)).rstrip() + f" {errors}"
        param = ".".join(str(part) for part in errors[0]["loc"])
        return 400, _body(message, "Bad Request", 400, param)
    if request.get("model") not in (None, model):
        return 404, _body(f"The model `{request['model']}` does not exist.", "NotFoundError", 404, "model")
    tool_choice = request.get("tool_choice", "auto" if request.get("tools") else "none")
    if tool_choice not in (None, "none") and not auto_tools:
        if tool_choice == "auto":
            message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        else:
            message = f'tool_choice="{tool_choice}" requires --tool-call-parser to be set'
        return 400, _body(message, "BadRequestError", 400)
    temperature, top_p = request.get("temperature"), request.get("top_p")
    max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
    for wrong, message, param, value in (
        (temperature is not None and not (math.isfinite(temperature) and 0 <= temperature <= 2),
         "temperature must be in [0, 2]", "temperature", temperature),
        (top_p is not None and not 0 < top_p <= 1, "top_p must be in (0, 1]", "top_p", top_p),
        (max_tokens is not None and max_tokens < 1, "max_tokens must be at least 1", "max_tokens",
         max_tokens),
    ):
        if wrong:
            words = f"{message}, got {value}. (parameter={param}, value={value})"
            return 400, _body(words, "BadRequestError", 400, param)
    return None


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
        # a tool parser (--enable-auto-tool-choice --tool-call-parser): tools with tool_choice "auto" are
        # accepted; None: on while tool_call_when is set
        self.auto_tools: bool | None = None
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

    @property
    def tool_parser(self) -> bool:
        return bool(self.tool_call_when) if self.auto_tools is None else self.auto_tools

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
        parse_calls = self.tool_parser and request.get("tool_choice", "auto") != "none"
        if parse_calls and self.tool_call_when and self.tool_call_when in last_user:
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
                rejected = vllm_rejection(request, server.model, server.tool_parser)
                if rejected is not None:
                    return rejected[0], json.dumps(rejected[1]).encode()
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
