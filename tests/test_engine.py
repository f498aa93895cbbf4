"""engine.process (server processes) and engine.http (the retrying JSON client), on their own."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3build.engine import process
from eagle3build.engine.http import GaveUp, JsonClient, Rejected, Retryable, with_retries

# A server that forks a worker into its own process group, prints both pids, then sleeps (optionally
# ignoring SIGTERM, like a stuck engine).
SERVER = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("pids", os.getpid(), worker.pid, flush=True)
time.sleep(600)
"""


def _pids(log, timeout=20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("pids")] if log.exists() else []
        if lines:
            return [int(x) for x in lines[-1].split()[1:]]
        time.sleep(0.05)
    raise AssertionError(f"no pids in {log}")


def _gone(pid, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", ["term", "ignore"])
def test_terminate_reaches_the_whole_group(tmp_path, mode):
    log = tmp_path / "server.log"
    proc = process.start([sys.executable, "-c", SERVER, mode], log, banner="=== starting\n")
    leader, worker = _pids(log)
    assert leader == proc.pid and log.read_text().startswith("=== starting\n")
    ticks = process.start_ticks(leader)
    assert process.alive(leader, ticks) and not process.alive(leader, ticks + 1)  # another process, same pid
    process.terminate(leader, ticks, grace_s=0.5)  # SIGKILL follows when SIGTERM is ignored
    assert not process.alive(leader) and _gone(worker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("bound", [True, False])
def test_a_bound_server_ends_with_its_starter_even_when_that_is_killed(tmp_path, bound):
    """An evaluation's engine must not outlive a SIGKILLed job (its `finally` never runs) and keep the GPUs."""
    log = tmp_path / "server.log"
    starter = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from eagle3build.engine import process
process.start([sys.executable, "-c", {SERVER!r}, "term"], Path({str(log)!r}), bound={bound})
time.sleep(600)
"""])
    leader, worker = _pids(log)
    try:
        starter.kill()
        starter.wait()
        assert _gone(leader, timeout=10) is bound  # unbound, its own session outlives the starter
    finally:
        for pid in (leader, worker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_bound_server_that_cannot_run_says_so_at_start(tmp_path):
    with pytest.raises(FileNotFoundError):
        process.start(["no-such-engine-xyz", "serve"], tmp_path / "x.log", bound=True)


def test_wait_ready_reports_exit_and_timeout(tmp_path):
    log = tmp_path / "server.log"
    proc = process.start([sys.executable, "-c", "print('CUDA out of memory'); raise SystemExit(3)"], log)
    with pytest.raises(process.NotReady) as e:
        process.wait_ready(proc, lambda: False, timeout_s=30, poll_s=0.05)
    assert e.value.returncode == 3 and "CUDA out of memory" in process.log_tail(log)
    proc = process.start([sys.executable, "-c", SERVER, "term"], log)
    with pytest.raises(process.NotReady) as e:
        process.wait_ready(proc, lambda: False, timeout_s=0.5, poll_s=0.05)
    assert e.value.returncode is None and not process.alive(proc.pid)  # stopped before raising
    ready = tmp_path / "ready"
    proc = process.start([sys.executable, "-c", f"open({str(ready)!r}, 'w').close(); import time; time.sleep(60)"],
                         log)
    process.wait_ready(proc, ready.exists, timeout_s=30, poll_s=0.05)
    process.terminate(proc.pid, None, grace_s=5)


def test_log_tail_reads_from_an_offset(tmp_path):
    log = tmp_path / "x.log"
    assert process.log_tail(log) == "(no log)"
    log.write_text("old\n")
    start = log.stat().st_size
    assert process.log_tail(log, start) == "(empty log)"
    log.write_text("old\n" + "".join(f"line {i}\n" for i in range(40)))
    assert process.log_tail(log, start, lines=2) == "line 38\nline 39"


def test_stop_recorded_stops_the_server_and_drops_its_state(tmp_path):
    state = tmp_path / "server.json"
    assert process.read_state(state) is None and not process.stop_recorded(state)
    state.write_text("{half")
    assert process.read_state(state) is None  # half written: nothing to stop
    proc = process.start([sys.executable, "-c", SERVER, "term"], tmp_path / "server.log")
    leader, worker = _pids(tmp_path / "server.log")
    state.write_text(json.dumps({"pid": leader, "start_ticks": process.start_ticks(leader)}))
    assert process.stop_recorded(state, grace_s=5) and not state.exists()
    assert proc.poll() is not None and _gone(worker)


def test_clients_lock_tells_whether_a_server_is_in_use(tmp_path):
    files = process.ServerFiles(tmp_path / "s.lock", tmp_path / "s.json", tmp_path / "c.lock", tmp_path / "s.log")
    assert process.unlocked(files.clients)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)"), str(files.clients)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not process.unlocked(files.clients) and process.try_lock(files.clients) is None
        with files.client():  # shared: several jobs use one server at once
            pass
    finally:
        holder.kill()
        holder.wait()
    assert process.unlocked(files.clients)  # a dead holder frees it


def test_watchdog_stops_an_idle_server(tmp_path):
    files = process.ServerFiles(tmp_path / "s.lock", tmp_path / "s.json", tmp_path / "c.lock", tmp_path / "s.log")
    server = process.start([sys.executable, "-c", SERVER, "term"], files.log)
    leader, worker = _pids(files.log)
    with files.client():
        with process.flock(files.lock, fcntl.LOCK_EX):  # as a starting job holds it until the state is written
            watchdog = process.start_watchdog(files, idle_s=0.5)
            files.state.write_text(json.dumps({"pid": leader, "start_ticks": process.start_ticks(leader),
                                               "watchdog_pid": watchdog}))
        time.sleep(1.5)
        assert process.alive(leader)  # in use: left running
    assert _gone(leader) and _gone(worker) and _gone(watchdog)
    assert server.poll() is not None and not files.state.exists()
    assert "watchdog: idle for" in files.log.read_text()


def test_watchdog_stops_the_server_of_a_workflow_that_ended(tmp_path):
    """Snakemake killed before its onerror hook ran: the server stops once its jobs are gone, not after
    an hour of idle_s."""
    files = process.ServerFiles(tmp_path / "s.lock", tmp_path / "s.json", tmp_path / "c.lock", tmp_path / "s.log")
    workflow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    server = process.start([sys.executable, "-c", SERVER, "term"], files.log)
    leader, worker = _pids(files.log)
    owner = {"pid": workflow.pid, "start_ticks": process.start_ticks(workflow.pid)}
    with files.client():
        with process.flock(files.lock, fcntl.LOCK_EX):
            watchdog = process.start_watchdog(files, idle_s=3600)
            files.state.write_text(json.dumps({"pid": leader, "start_ticks": process.start_ticks(leader),
                                               "watchdog_pid": watchdog, "owner": owner}))
        workflow.kill()
        workflow.wait()
        time.sleep(1.5)
        assert process.alive(leader)  # a job still uses it: left running
    assert _gone(leader) and _gone(worker) and _gone(watchdog)
    assert server.poll() is not None and not files.state.exists()
    assert f"its workflow (pid {workflow.pid}) ended" in files.log.read_text()


# ---------------------------------------------------------------- http
class _Server:
    """Answers from a script: each request takes the next (status, body, delay) until one is left."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                outer.requests.append((self.command, self.path, self.rfile.read(length), dict(self.headers)))
                status, body, delay = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                time.sleep(delay)
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def make(*script):
        servers.append(_Server(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_transient_answers_are_retried_with_backoff(serve):
    server = serve((500, "busy", 0), (429, "slow down", 0), (200, "not json", 0), (200, '{"ok": 1}', 0))
    client = JsonClient(server.url, timeout_s=5, headers={"Authorization": "Bearer k"})
    waits = []
    reply = with_retries(lambda: client.post_json("/x", {"a": 1}), retries=3, backoff_s=0.5, sleep=waits.append)
    assert reply == {"ok": 1} and waits == [0.5, 1.0, 2.0]
    assert [json.loads(body) for _, _, body, _ in server.requests] == [{"a": 1}] * 4
    assert server.requests[0][3]["Authorization"] == "Bearer k"


def test_backoff_is_capped_and_jittered():
    waits = []

    def fail():
        raise Retryable("HTTP 503: down")

    with pytest.raises(GaveUp, match=r"HTTP 503: down \(gave up after 8 attempts\)") as e:
        with_retries(fail, retries=7, backoff_s=1.0, jitter=True, sleep=waits.append)
    assert e.value.attempts == 8 and len(waits) == 7
    for n, wait in enumerate(waits):
        assert 0.5 * min(30.0, 2.0**n) <= wait <= min(30.0, 2.0**n)


def test_a_rejected_request_is_not_retried(serve):
    server = serve((400, "prompt too long", 0), (200, "{}", 0))
    client = JsonClient(server.url, timeout_s=5)
    with pytest.raises(Rejected, match="HTTP 400: prompt too long") as e:
        with_retries(lambda: client.post_json("/x", {}), retries=3, backoff_s=0.0)
    assert e.value.status == 400 and len(server.requests) == 1


def test_timeouts_parse_failures_and_health(serve):
    server = serve((200, '{"choices": []}', 0), (200, "{}", 1.0))
    client = JsonClient(server.url, timeout_s=0.3)
    with pytest.raises(Retryable, match=r"not a completion: '\{\"choices\": \[\]\}'"):
        client.post_json("/x", {}, parse=lambda reply: reply["choices"][0], what="a completion")
    with pytest.raises(Retryable, match=r"timed out after 0.3 s"):
        client.post_json("/x", {})
    assert not client.answers("/health", timeout_s=0.3)
    assert client.answers("/health", timeout_s=5)
    assert not JsonClient("http://127.0.0.1:9", timeout_s=1).answers("/health", 1)
    with pytest.raises(Retryable, match="request error"):
        JsonClient("http://127.0.0.1:9", timeout_s=1).get_json("/health")
