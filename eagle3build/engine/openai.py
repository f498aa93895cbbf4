"""A small client for OpenAI-compatible chat endpoints (`vllm serve`, SGLang), on `engine.http`.

Only `/v1/models` and `/v1/chat/completions` are used. A chat request is retried with exponential backoff
(plus jitter) on what a busy or restarting server produces (`engine.http.with_retries`), including bodies
that are not a chat completion; other 4xx answers fail at once.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

from eagle3build.engine.http import GaveUp, HttpError, JsonClient, Rejected, with_retries
from eagle3build.errors import UserError

# vLLM's answer (renderers/online_renderer.py, 0.25.0) to tools with tool_choice "auto", the default, on a
# server started without a tool parser
NO_TOOL_PARSER = '"auto" tool choice requires --enable-auto-tool-choice'


class RequestFailed(Exception):
    """A chat request that did not produce an answer (after retries, where retrying made sense)."""


@dataclass
class ChatAnswer:
    content: str
    tool_calls: list | None
    finish_reason: str  # "stop" | "length" | "tool_calls" | ...
    reasoning: str | None = None  # what a reasoning parser split off (vLLM, SGLang --reasoning-parser)


def normalize_base_url(url: str) -> str:
    """'http://h:8000', 'http://h:8000/' and 'http://h:8000/v1' all name the same server."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _chat_answer(reply: dict) -> ChatAnswer:
    choice = reply["choices"][0]
    message = choice["message"]
    return ChatAnswer(
        content=message.get("content") or "",
        tool_calls=message.get("tool_calls") or None,
        finish_reason=choice.get("finish_reason") or "stop",
        # vLLM names it `reasoning` (`reasoning_content` until it was renamed), SGLang `reasoning_content`
        reasoning=message.get("reasoning_content") or message.get("reasoning") or None,
    )


class ChatClient:
    """Thread-safe. The settings are the config section `regenerate`'s (url, model, api_key_env,
    timeout_s, max_retries, retry_backoff_s)."""

    def __init__(self, base_url: str, model: str | None, api_key_env: str | None, timeout_s: float,
                 max_retries: int, backoff_s: float):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        # The key is read from the environment, never from the config (configs end up in git and logs).
        api_key = os.environ.get(api_key_env) if api_key_env else None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = JsonClient(self.base_url, timeout_s, headers)
        self.tool_choice: str | None = None  # None: the server's default ("auto" in vLLM when tools are sent)
        self._lock = threading.Lock()

    def served_models(self) -> list[str]:
        """The model names the server serves; a UserError when nothing answers at base_url."""
        url = f"{self.base_url}/v1/models"
        try:
            models = self.http.get_json("/v1/models", timeout_s=min(self.http.timeout_s, 30.0))
            return [m["id"] for m in models["data"]]
        except (HttpError, KeyError, TypeError) as e:
            raise UserError(
                f"no OpenAI-compatible server answers at {url} ({e}); start one (e.g. `vllm serve MODEL`) "
                "or fix the config key regenerate.url"
            ) from e

    def resolve_model(self) -> str:
        """Check `model` is served, or pick the only served model when `model` is None."""
        served = self.served_models()
        if self.model is None:
            if len(served) != 1:
                raise UserError(
                    f"the server at {self.base_url} serves {served}; set the config key regenerate.model "
                    "to the one to use"
                )
            self.model = served[0]
        elif self.model not in served:
            raise UserError(
                f"config key regenerate.model: '{self.model}' is not served at {self.base_url} "
                f"(served: {served})"
            )
        return self.model

    def chat(self, messages: list[dict], tools: list | None = None, **sampling) -> ChatAnswer:
        """One chat completion; `sampling` goes into the request body (temperature, max_tokens, seed...).

        `tools` go as given: OpenAI's form, [{"type": "function", "function": {...}}] (vLLM answers
        anything else with HTTP 400; eagle3build/data/tools.py writes it). With tools, vLLM's tool_choice
        defaults to "auto", which a server started without --enable-auto-tool-choice and
        --tool-call-parser refuses (HTTP 400): the request is then sent again with tool_choice "none",
        and so is every later one. The template still renders the tools (unless the server runs with
        --exclude-tools-when-tool-choice-none); the target's calls stay text in its answers."""
        body = {"model": self.model, "messages": messages, **sampling}
        if tools:
            body["tools"] = tools
            if self.tool_choice is not None:
                body["tool_choice"] = self.tool_choice
        try:
            try:
                return self._complete(body)
            except Rejected as e:
                if not (tools and "tool_choice" not in body and NO_TOOL_PARSER in e.message):
                    raise
                self._without_tool_parser(e.message)
                return self._complete({**body, "tool_choice": "none"})
        except (GaveUp, Rejected) as e:
            raise RequestFailed(str(e)) from e

    def _complete(self, body: dict) -> ChatAnswer:
        return with_retries(
            lambda: self.http.post_json("/v1/chat/completions", body, _chat_answer, "a chat completion"),
            self.max_retries, self.backoff_s, jitter=True,
        )

    def _without_tool_parser(self, message: str) -> None:
        with self._lock:
            if self.tool_choice is None:
                self.tool_choice = "none"
                print(
                    f"regenerate: {self.base_url} parses no tool calls ({message}); asking with tool_choice "
                    "\"none\": the target's tool calls stay text in its answers and no tool result is "
                    "replayed. Serve with --enable-auto-tool-choice --tool-call-parser NAME to replay them",
                    file=sys.stderr,
                    flush=True,
                )
