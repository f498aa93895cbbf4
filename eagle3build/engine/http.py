"""One JSON-over-HTTP client with timeouts and retries, for every server the package talks to.

`JsonClient` speaks to one server (`vllm serve`, an OpenAI-compatible endpoint); each thread gets its own
`requests.Session` (connection pool). `with_retries` repeats an attempt with exponential backoff on what a
busy or restarting server produces: connection errors, timeouts, HTTP 408 / 429 / 500 / 502 / 503 / 504 and
answers that are not what was asked for (all `Retryable`). Other non-2xx answers (a prompt longer than the
context, a wrong model name) raise `Rejected` at once: asking again would get the same answer.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import requests

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
BACKOFF_MAX_S = 30.0  # the longest wait between two attempts

T = TypeVar("T")


class HttpError(Exception):
    """A request that did not produce the answer asked for."""


class Retryable(HttpError):
    """A failed or invalid answer that another attempt may fix."""


class Rejected(HttpError):
    """The server refused the request itself: repeating it cannot help."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status, self.body = status, body

    @property
    def message(self) -> str:
        """The server's own words: OpenAI-style `{"error": {"message": ...}}` (vLLM), `{"message": ...}`,
        else the body."""
        try:
            reply = json.loads(self.body)
            error = reply.get("error", reply)
            return str(error["message"] if isinstance(error, dict) else error)
        except (ValueError, AttributeError, KeyError, TypeError):
            return self.body[:500]


class GaveUp(HttpError):
    """Every attempt failed with a retryable error; `last` is the last one."""

    def __init__(self, attempts: int, last: Exception | None):
        super().__init__(f"{last or 'no attempt made'} (gave up after {attempts} attempts)")
        self.attempts, self.last = attempts, last


class JsonClient:
    """JSON requests to one server. Thread-safe: each thread gets its own `requests.Session`."""

    def __init__(self, base_url: str, timeout_s: float, headers: dict | None = None):
        self.base_url = base_url
        self.timeout_s = timeout_s
        self._headers = dict(headers or {})
        self._local = threading.local()

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "requests_session"):
            self._local.requests_session = requests.Session()
            self._local.requests_session.headers.update(self._headers)
        return self._local.requests_session

    def _send(self, method: str, path: str, timeout_s: float, **kwargs) -> requests.Response:
        """One request; a non-2xx answer raises Retryable or Rejected."""
        try:
            response = self._session().request(method, self.base_url + path, timeout=timeout_s, **kwargs)
        except requests.Timeout as e:
            raise Retryable(f"timed out after {timeout_s} s") from e
        except requests.RequestException as e:
            raise Retryable(f"request error: {e}") from e
        if response.status_code in RETRY_STATUS:
            raise Retryable(f"HTTP {response.status_code}: {response.text[:200]}")
        if not 200 <= response.status_code < 300:
            raise Rejected(response.status_code, response.text)
        return response

    def get_json(self, path: str, timeout_s: float | None = None) -> Any:
        response = self._send("GET", path, self.timeout_s if timeout_s is None else timeout_s)
        try:
            return response.json()
        except ValueError as e:
            raise Retryable(f"not JSON: {response.text[:200]!r}") from e

    def get_text(self, path: str, timeout_s: float | None = None) -> str:
        """GET a page that is not JSON (Prometheus' /metrics) as text."""
        return self._send("GET", path, self.timeout_s if timeout_s is None else timeout_s).text

    def post_json(self, path: str, body: dict, parse: Callable[[Any], T] = lambda reply: reply,
                  what: str = "JSON") -> T:
        """POST `body`; `parse` turns the answer into the result. An answer that is not JSON, or that
        `parse` cannot read (KeyError, IndexError, TypeError, AttributeError, ValueError), is Retryable
        ('not {what}: ...')."""
        response = self._send("POST", path, self.timeout_s, json=body)
        try:
            return parse(response.json())
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise Retryable(f"not {what}: {response.text[:200]!r}") from e

    def answers(self, path: str, timeout_s: float) -> bool:
        """True when GET path answers HTTP 200 within timeout_s (a health check)."""
        try:
            return self._send("GET", path, timeout_s).status_code == 200
        except HttpError:
            return False


def with_retries(attempt: Callable[[], T], retries: int, backoff_s: float, *, jitter: bool = False,
                 sleep: Callable[[float], Any] = time.sleep, before: Callable[[], None] | None = None) -> T:
    """`attempt()`, repeated up to `retries` more times while it raises Retryable, waiting backoff_s, then
    twice as long each time (at most BACKOFF_MAX_S; with jitter, a random 50-100% of that). `before` runs
    before every attempt (it may raise to stop). Raises GaveUp after the last failed attempt."""
    last = None
    for n in range(retries + 1):
        if n:
            delay = min(BACKOFF_MAX_S, backoff_s * 2 ** (n - 1))
            sleep(delay * random.uniform(0.5, 1.0) if jitter else delay)
        if before is not None:
            before()
        try:
            return attempt()
        except Retryable as e:
            last = e
    raise GaveUp(retries + 1, last)
