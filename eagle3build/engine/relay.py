"""A local HTTP relay in front of `vllm serve` that never drops a request vLLM holds.

vLLM 0.25 / 0.26 (fixed in 0.33) crash the engine when a request is aborted while it still waits in the
scheduler's queue: the hidden-states connector pops a key the request never got (KeyError in the engine
core), and the server dies for every job that shares it. vLLM aborts a request when its HTTP client
disconnects, which a client cannot rule out: a read timeout, Ctrl-C, a killed or preempted job all close
the socket, and whether the request was still queued depends on the load other jobs put on the server.

So extraction never lets a client's socket reach vLLM. The relay is the process that `VllmServer` starts:
it starts `vllm serve` as its child (same process group: stopping the group stops both, and the relay
exits with vLLM's status when vLLM exits), listens on the client-facing port and forwards each request to
vLLM on a private port over a connection of its own, which it keeps open until vLLM has answered, whatever
the client does. A client that left before the answer came back makes that answer an orphan: the relay
deletes the connector file it names (after the connector's write lock is released), so an abandoned
request costs GPU time once but neither crashes the engine nor leaks disk. The only way a request is
aborted is stopping the server itself.

Stdlib only (and `engine.process`, itself stdlib only): it starts in a fraction of a second and needs
nothing of the image beyond Python. `command()` gives its argv; see `main` for the arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from eagle3build.engine import process

# Headers that describe one hop, not the message (RFC 9110 7.6.1), or that the relay writes itself
# (Server, Date): never forwarded.
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
        "content-length", "host", "server", "date"}
UPSTREAM_CONNECT_S = 5.0  # vLLM listens on localhost: a connect that takes longer means it is not up


def command(listen_port: int, upstream_port: int, storage_path: str, child: list[str]) -> list[str]:
    """The argv that runs the relay (this Python, this package) in front of `child` (the `vllm serve`
    argv, which must listen on upstream_port). No environment is changed: vLLM sees the caller's."""
    return process.module_command("eagle3build.engine.relay", [
        "--port", str(listen_port), "--upstream-port", str(upstream_port), "--storage", storage_path, "--", *child])


def client_gone(sock: socket.socket) -> bool:
    """True when the client closed its end. A client waiting for its answer sends nothing, so a readable
    socket means end-of-file (or a reset)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def discard_orphan(body: bytes, storage: Path) -> str | None:
    """Delete the connector file an unanswered completion names (inside `storage` only), once the
    connector's exclusive lock on `<file>.lock` is released. Returns the path deleted."""
    try:
        path = json.loads(body)["kv_transfer_params"]["hidden_states_path"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(path, str):
        return None
    path = Path(path).resolve()
    if path.parent != storage:
        return None
    lock = Path(f"{path}.lock")
    with contextlib.suppress(OSError):
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # the connector holds LOCK_EX until its write is complete
        finally:
            os.close(fd)
    path.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    return str(path)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a request still held for vLLM never keeps the relay from exiting with it
    request_queue_size = 1024  # every job's requests may connect at once (socketserver's default is 5)


def make_handler(upstream_port: int, storage: Path):
    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # vLLM logs every request already
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=UPSTREAM_CONNECT_S)
            try:
                upstream.connect()
                upstream.sock.settimeout(None)  # wait for vLLM as long as it takes: never abort
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                status, reason = response.status, response.reason
                reply_headers, reply = response.getheaders(), response.read()
            except OSError as e:  # vLLM not listening (yet, or any more)
                status, reason, reply_headers = 502, "Bad Gateway", [("Content-Type", "text/plain")]
                reply = f"eagle3build relay: vLLM on port {upstream_port} did not answer ({e})".encode()
            finally:
                upstream.close()
            if self.command == "POST" and client_gone(self.connection):
                orphan = discard_orphan(reply, storage)
                print(f"=== eagle3build relay: the client left before its answer; vLLM's request finished"
                      f"{f' and {orphan} was deleted' if orphan else ''}", flush=True)
                self.close_connection = True
                return
            try:
                self.send_response(status, reason)
                for key, value in reply_headers:
                    if key.lower() not in _HOP:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
            except OSError:  # the client left while we answered
                if self.command == "POST":
                    discard_orphan(reply, storage)
                self.close_connection = True

        do_GET = do_POST = _forward

    return Relay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3build relay", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the port clients use")
    parser.add_argument("--upstream-port", type=int, required=True, help="the port `vllm serve` listens on")
    parser.add_argument("--storage", required=True, help="the connector's folder (orphans are deleted there)")
    parser.add_argument("child", nargs=argparse.REMAINDER, help="-- then the `vllm serve` argv")
    args = parser.parse_args(argv)
    child = args.child[1:] if args.child[:1] == ["--"] else args.child
    if not child:
        parser.error("no server command after --")
    server = _Server(("127.0.0.1", args.port), make_handler(args.upstream_port, Path(args.storage).resolve()))
    try:
        proc = subprocess.Popen(child, stdin=subprocess.DEVNULL)  # same process group, same log
    except OSError as e:
        print(f"eagle3build relay: cannot run {child[0]!r}: {e}", flush=True)
        return 127
    # SIGTERM reaches vLLM too (the group is signalled): wait for it to finish, then exit with its status.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"=== eagle3build relay: pid {os.getpid()} on 127.0.0.1:{args.port} -> vLLM pid {proc.pid} on port "
          f"{args.upstream_port}", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
