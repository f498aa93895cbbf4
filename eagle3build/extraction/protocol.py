"""The HF extraction server's wire format, shared by the server and the shard jobs.

One request and one reply per connection, each a 4-byte big-endian length followed by that many bytes of
UTF-8 JSON. The server listens on 127.0.0.1 only; every request carries the token of its state file.
"""

from __future__ import annotations

import json
import socket
import struct


def send_message(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_message(sock: socket.socket) -> dict:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("connection closed")
            buf += chunk
        return buf

    (n,) = struct.unpack(">I", exactly(4))
    return json.loads(exactly(n))


def call(port: int, token: str, request: dict) -> dict:
    """Send one request to the server on 127.0.0.1:port and return its reply."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        send_message(sock, {**request, "token": token})
        return recv_message(sock)
