"""A small client for OpenAI-compatible chat endpoints (`vllm serve`, SGLang): timeouts, retries.

Only `/v1/models` and `/v1/chat/completions` are used. A request is retried with exponential backoff
(plus jitter) on what a busy or restarting server produces: connection errors, timeouts, HTTP 408 / 429 /
5xx and bodies that are not a chat completion. Other 4xx answers (a prompt longer than the context, a
wrong model name) fail at once: asking again would get the same answer.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass

import requests

from eagle3build.errors import UserError

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class RequestFailed(Exception):
    """A chat request that did not produce an answer (after retries, where retrying made sense)."""


@dataclass
class ChatAnswer:
    content: str
    tool_calls: list | None
    finish_reason: str  # "stop" | "length" | "tool_calls" | ...


def normalize_base_url(url: str) -> str:
    """'http://h:8000', 'http://h:8000/' and 'http://h:8000/v1' all name the same server."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class ChatClient:
    """Thread-safe: each thread gets its own `requests.Session` (connection pool)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        timeout_s: float = 600.0,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
    ):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        # The key is read from the environment, never from the config (configs end up in git and logs).
        api_key = os.environ.get(api_key_env) if api_key_env else None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.headers.update(self._headers)
        return self._local.session

    def served_models(self) -> list[str]:
        """The model names the server serves; a UserError when nothing answers at base_url."""
        url = f"{self.base_url}/v1/models"
        try:
            response = self._session().get(url, timeout=min(self.timeout_s, 30.0))
            response.raise_for_status()
            return [m["id"] for m in response.json()["data"]]
        except (requests.RequestException, ValueError, KeyError, TypeError) as e:
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
        """One chat completion; `sampling` goes into the request body (temperature, max_tokens, seed...)."""
        body = {"model": self.model, "messages": messages, **sampling}
        if tools:
            body["tools"] = tools
        last_error = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
                time.sleep(delay * random.uniform(0.5, 1.0))
            try:
                return self._post_chat(body)
            except _Retryable as e:
                last_error = str(e)
        raise RequestFailed(f"{last_error} (gave up after {self.max_retries + 1} attempts)")

    def _post_chat(self, body: dict) -> ChatAnswer:
        url = f"{self.base_url}/v1/chat/completions"
        try:
            response = self._session().post(url, json=body, timeout=self.timeout_s)
        except requests.Timeout as e:
            raise _Retryable(f"timed out after {self.timeout_s} s") from e
        except requests.RequestException as e:
            raise _Retryable(f"request error: {e}") from e
        if response.status_code in RETRYABLE_STATUS:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code != 200:
            raise RequestFailed(f"HTTP {response.status_code}: {response.text[:500]}")
        try:
            choice = response.json()["choices"][0]
            message = choice["message"]
            return ChatAnswer(
                content=message.get("content") or "",
                tool_calls=message.get("tool_calls") or None,
                finish_reason=choice.get("finish_reason") or "stop",
            )
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise _Retryable(f"not a chat completion: {response.text[:200]!r}") from e


class _Retryable(Exception):
    pass
