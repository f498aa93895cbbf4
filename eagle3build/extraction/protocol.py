"""The HF extraction server's wire format, shared by the server and the shard jobs.

One request and one reply per connection. A request is the server's token (TOKEN_CHARS ASCII bytes, the
secret of its private state file), then a 4-byte big-endian length and that many bytes of UTF-8 JSON; a
reply is the length and the JSON. The server listens on 127.0.0.1 only. It checks the token before it
reads a length, refuses a length over its bound before reading the body, reads the body in chunks (memory
grows only with the bytes that actually arrive) and gives up on a peer that stalls for READ_TIMEOUT_S.
"""

from __future__ import annotations

import hmac
import json
import socket
import struct

PROTOCOL_VERSION = 2  # recorded in the server's state: a server that speaks another version is replaced
TOKEN_CHARS = 32  # secrets.token_hex(16)
MAX_REQUEST_BYTES = 256 << 20  # a request lists the run's pending shards: ~150 bytes each, 10,000s of them
MAX_REPLY_BYTES = 16 << 20
READ_TIMEOUT_S = 30.0  # for the request's reads and the reply's send: a stalled peer must not block a server
CONNECT_TIMEOUT_S = 10.0
_CHUNK = 1 << 20


class ProtocolError(ConnectionError):
    """A malformed, oversized or unauthenticated message."""


def send_message(sock: socket.socket, obj: dict, token: str | None = None) -> None:
    data = json.dumps(obj).encode()
    prefix = token.encode("ascii") if token is not None else b""
    sock.sendall(prefix + struct.pack(">I", len(data)) + data)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket, max_bytes: int = MAX_REPLY_BYTES) -> dict:
    (n,) = struct.unpack(">I", _exactly(sock, 4))
    if n > max_bytes:
        raise ProtocolError(f"message of {n} bytes announced, more than the {max_bytes} allowed")
    try:
        obj = json.loads(_exactly(sock, n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"malformed message ({e})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a message must be a JSON object")
    return obj


def recv_request(sock: socket.socket, token: str, max_bytes: int = MAX_REQUEST_BYTES) -> dict:
    """The server's side: check the token, then read the request (ProtocolError on a bad one)."""
    got = _exactly(sock, TOKEN_CHARS)
    if not hmac.compare_digest(got, token.encode("ascii")):
        raise ProtocolError("bad token")
    return recv_message(sock, max_bytes)


def call(port: int, token: str, request: dict) -> dict:
    """Send one request to the server on 127.0.0.1:port and return its reply. The reply comes when the
    shard is written (minutes): that wait has no timeout, a server that dies closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S) as sock:
        send_message(sock, request, token)
        sock.settimeout(None)
        return recv_message(sock, MAX_REPLY_BYTES)
