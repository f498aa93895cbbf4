"""Hidden-state extraction through vLLM's public `extract_hidden_states` path.

vLLM serves the target with the `extract_hidden_states` speculative method and the
`ExampleHiddenStatesConnector` KV connector. Each request (prompt token ids, `max_tokens=1`) makes the
connector write one safetensors file, `{shared_storage_path}/{request_id}.safetensors`, holding
`hidden_states` [T, n_ids, H] and `token_ids` [T]; the response's `kv_transfer_params.hidden_states_path`
names it, and a companion `<file>.lock` is held with an exclusive flock until the write is complete.
Nothing here touches vLLM internals: we only build a `vllm serve` command line and speak HTTP.

Two pieces:
- `VllmServer`: one managed `vllm serve` per run dir and host, shared by every concurrent shard job
  (separate processes started by Snakemake). A lock file serialises start/stop, a state file records
  pid/port/identity, and each job holds a shared flock on a "clients" file while it uses the server, so a
  server is replaced only when nobody uses it. A detached watchdog stops the server once it has been
  idle for `idle_timeout_s` (e.g. after Snakemake was killed before its onerror hook ran).
- `extract_shard_vllm(...)`: sends every sample of a token shard, checks each returned file and writes
  exactly the hidden shard the HF backend writes (slots = 3 aux ids then the final id N).

`python -m eagle3build.extraction.vllm stop RUN_DIR` stops this host's server (what `stop_servers` does).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eagle3build.atomic import write_json_atomic
from eagle3build.errors import ConfigError, UserError
from eagle3build.shards import NUM_SLOTS, HiddenShardWriter, read_tokens

# Defaults of the config section `extract.vllm`.
DEFAULTS = {
    "executable": ["vllm"],  # argv prefix; "serve MODEL ..." follows. A list, never split by a shell
    "tensor_parallel_size": 1,
    "data_parallel_size": 1,
    "gpu_memory_utilization": 0.9,
    "max_model_len": None,  # None = the model's own limit
    "extra_args": [],  # appended verbatim to `vllm serve` (e.g. ["--enforce-eager"])
    "env": {},  # extra environment of the server (e.g. NCCL_* settings)
    "port": None,  # None = a free port on 127.0.0.1
    "startup_timeout_s": 1800,  # loading a 1T-parameter model takes a while
    "request_timeout_s": 600,
    "idle_timeout_s": 1800,  # the watchdog stops a server nobody used for this long
    "concurrency": 8,  # requests in flight per shard job
    "retries": 3,  # extra attempts per sample after a failed or invalid response
    "shared_storage_path": None,  # connector output dir; None = RUN_DIR/vllm/<host>/connector
    # The connector rejects MLA targets (DeepSeek-V3, Kimi-K2) in the vLLM versions checked; the doctor
    # refuses them unless this is set after verifying a vLLM version that supports them.
    "allow_mla": False,
}

SERVED_MODEL_NAME = "eagle3build-target"
CONNECTOR = "ExampleHiddenStatesConnector"
SPEC_METHOD = "extract_hidden_states"
_HEALTH_TIMEOUT_S = 5.0
_BACKOFF_S = 0.5  # first retry delay; doubles each attempt, capped at 30 s
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---------------------------------------------------------------- config
def server_config(params: dict) -> dict:
    """`params["vllm"]` (the config section extract.vllm) merged over DEFAULTS and checked."""
    user = params.get("vllm") or {}
    unknown = sorted(set(user) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"extract.vllm.{unknown[0]}", f"unknown key; known keys: {', '.join(DEFAULTS)}")
    cfg = {**DEFAULTS, **user}
    exe = cfg["executable"]
    cfg["executable"] = [exe] if isinstance(exe, str) else list(exe)
    if not cfg["executable"] or not all(isinstance(a, str) and a for a in cfg["executable"]):
        raise ConfigError("extract.vllm.executable", "must be a program name or a list of arguments")
    if not isinstance(cfg["extra_args"], list) or not all(isinstance(a, str) for a in cfg["extra_args"]):
        raise ConfigError("extract.vllm.extra_args", "must be a list of strings, one argument each")
    if not isinstance(cfg["env"], dict) or not all(_ENV_NAME.match(str(k)) for k in cfg["env"]):
        raise ConfigError("extract.vllm.env", "must map environment variable names to values")
    for key in ("tensor_parallel_size", "data_parallel_size", "concurrency"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"extract.vllm.{key}", f"must be an integer >= 1, got {cfg[key]!r}")
    if not isinstance(cfg["retries"], int) or cfg["retries"] < 0:
        raise ConfigError("extract.vllm.retries", f"must be an integer >= 0, got {cfg['retries']!r}")
    if not 0 < float(cfg["gpu_memory_utilization"]) <= 1:
        raise ConfigError("extract.vllm.gpu_memory_utilization", "must be in (0, 1]")
    return cfg


def resolve_params(params: dict) -> dict:
    """Flat extraction params from either shape the callers use.

    Flat: model, revision, trust_remote_code, layer_ids (3 aux ids then N), hidden_size.
    Workflow: target {path, revision, trust_remote_code}, aux_layer_ids (3 ids): N and H are read from
    the target's config. Both also carry storage_dtype, image and vllm (the extract.vllm section).
    """
    out = dict(params)
    target = params.get("target")
    if target is not None:
        out.setdefault("model", target.get("path") or target.get("model"))
        out.setdefault("revision", target.get("revision"))
        out.setdefault("trust_remote_code", target.get("trust_remote_code"))
        if "layer_ids" not in params or "hidden_size" not in params:
            from eagle3build.config import target_text_config

            text = target_text_config(
                {
                    "path": out["model"],
                    "revision": out["revision"],
                    "trust_remote_code": out["trust_remote_code"],
                }
            )
            out.setdefault("layer_ids", [*params["aux_layer_ids"], int(text["num_hidden_layers"])])
            out.setdefault("hidden_size", int(text["hidden_size"]))
    if not out.get("model"):
        raise ConfigError("target.model", "is required")
    ids = out.get("layer_ids")
    if (
        not isinstance(ids, (list, tuple))
        or len(ids) != NUM_SLOTS
        or not all(isinstance(i, int) for i in ids)
    ):
        raise ConfigError("extract.aux_layer_ids", f"expected three aux layer ids then N, got {ids!r}")
    out["layer_ids"] = list(ids)
    return out


def build_command(params: dict, port: int, storage_path: str) -> list[str]:
    """The `vllm serve` argv. Every value is a separate argv item: nothing passes through a shell."""
    params = resolve_params(params)
    cfg = server_config(params)
    layer_ids = params["layer_ids"]
    spec = {
        "method": SPEC_METHOD,
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    kv = {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }
    cmd = [*cfg["executable"], "serve", str(params["model"]), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", SERVED_MODEL_NAME]
    if params.get("revision"):
        # Pin code and tokenizer too: vLLM otherwise loads them from the default branch.
        rev = str(params["revision"])
        cmd += ["--revision", rev, "--code-revision", rev, "--tokenizer-revision", rev]
    if params.get("trust_remote_code") is True:
        cmd.append("--trust-remote-code")
    cmd += ["--tensor-parallel-size", str(cfg["tensor_parallel_size"])]
    cmd += ["--data-parallel-size", str(cfg["data_parallel_size"])]
    cmd += ["--gpu-memory-utilization", str(cfg["gpu_memory_utilization"])]
    if cfg["max_model_len"]:
        cmd += ["--max-model-len", str(int(cfg["max_model_len"]))]
    # Each request must be one prefill so the connector sees the whole prompt at once.
    cmd.append("--no-enable-chunked-prefill")
    cmd += ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
    return cmd + cfg["extra_args"]


# ---------------------------------------------------------------- processes and locks
def _proc_start_ticks(pid: int) -> int | None:
    """Start time of a live (non-zombie) process in clock ticks, None if it is gone.

    Recorded with the pid so that a recycled pid is never mistaken for our server.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no procfs: fall back to a signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _alive(pid: int | None, start_ticks: int | None) -> bool:
    if not pid:
        return False
    ticks = _proc_start_ticks(pid)
    return ticks is not None and (start_ticks in (None, 0) or ticks == start_ticks)


_children: dict[int, subprocess.Popen] = {}  # processes this process started, reaped on stop


def _terminate_group(pid: int, start_ticks: int | None, grace_s: float = 30.0) -> None:
    """SIGTERM the process group led by pid, then SIGKILL it if it outlives grace_s."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not _alive(pid, start_ticks):
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            child = _children.get(pid)
            if child is not None:
                child.poll()  # reap our own child so it does not linger as a zombie
            if not _alive(pid, start_ticks):
                break
            time.sleep(0.05)
    child = _children.pop(pid, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1)


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int, timeout: float = _HEALTH_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _tail(path: Path, start: int = 0, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


# ---------------------------------------------------------------- the managed server
@dataclass
class ServerState:
    pid: int
    start_ticks: int | None
    port: int
    identity: dict
    command: list
    log: str
    watchdog_pid: int | None = None
    started_at: float = 0.0


class VllmServer:
    """The `vllm serve` shared by every extraction job of one run dir on this host.

    Files under `RUN_DIR/vllm/<host>/` (per host: on a cluster, jobs on other nodes start their own): `server.lock` (held while starting, reusing or stopping),
    `server.json` (the state), `clients.lock` (a shared flock per job using the server),
    `vllm-server.log`, and `connector/` (the connector's files, unless shared_storage_path is set).
    """

    def __init__(self, run_dir: str | os.PathLike, params: dict):
        self.params = params = resolve_params(params)
        self.cfg = server_config(params)
        self.run_dir = Path(run_dir).resolve()
        self.dir = _host_dir(run_dir)
        self.lock_path = self.dir / "server.lock"
        self.state_path = self.dir / "server.json"
        self.clients_path = self.dir / "clients.lock"
        self.log_path = self.dir / "vllm-server.log"
        self.storage_path = Path(self.cfg["shared_storage_path"] or self.dir / "connector").resolve()
        self.identity = {
            "model": str(params["model"]),
            "revision": params.get("revision"),
            "trust_remote_code": params.get("trust_remote_code") is True,
            "layer_ids": params["layer_ids"],
            "image": params.get("image"),
            "shared_storage_path": str(self.storage_path),
        }

    # -- state
    def read_state(self) -> ServerState | None:
        try:
            return ServerState(**json.loads(self.state_path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None

    def _clients_idle(self) -> bool:
        """True when no job holds the clients lock (checked while holding server.lock)."""
        fd = os.open(self.clients_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    # -- lifecycle
    @contextlib.contextmanager
    def lease(self) -> Iterator[str]:
        """Yield the base URL of a healthy server with our identity, starting one if needed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with _flock(self.lock_path, fcntl.LOCK_EX):
            state = self.read_state()
            if state is not None and not self._reusable(state):
                self._retire(state)
                state = None
            if state is None:
                state = self._start()
            client_fd = os.open(self.clients_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(client_fd, fcntl.LOCK_SH)
        try:
            yield f"http://127.0.0.1:{state.port}"
        finally:
            os.close(client_fd)

    def _reusable(self, state: ServerState) -> bool:
        if state.identity != self.identity or not _alive(state.pid, state.start_ticks):
            return False
        # A busy server can answer /health slowly: give it a few chances before calling it broken.
        for attempt in range(3):
            if _healthy(state.port):
                return True
            time.sleep(2.0 * (attempt + 1))
        return False

    def _retire(self, state: ServerState) -> None:
        """Stop a dead, broken or other-identity server, unless other jobs are still using it."""
        if _alive(state.pid, state.start_ticks):
            if not self._clients_idle():
                what = (
                    "is unhealthy"
                    if state.identity == self.identity
                    else f"serves another extraction ({json.dumps(state.identity)})"
                )
                raise UserError(
                    f"{self.state_path}: the vLLM server (pid {state.pid}) {what} and other jobs are still "
                    f"using it; let them finish, or stop it with "
                    f"`python -m eagle3build.extraction.vllm stop {self.run_dir}` and rerun"
                )
            _terminate_group(state.pid, state.start_ticks)
        self.state_path.unlink(missing_ok=True)

    def _start(self) -> ServerState:
        port = int(self.cfg["port"] or _free_port())
        self.storage_path.mkdir(parents=True, exist_ok=True)
        cmd = build_command(self.params, port, str(self.storage_path))
        env = {**os.environ, **{str(k): str(v) for k, v in self.cfg["env"].items()}}
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== eagle3build: starting {json.dumps(cmd)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # own process group: stopping it reaches every worker
                )
            except OSError as e:
                raise ConfigError(
                    "extract.vllm.executable",
                    f"cannot run {cmd[0]!r} ({e}); install vLLM or run inside the image",
                ) from e
        _children[proc.pid] = proc
        ticks = _proc_start_ticks(proc.pid)
        deadline = time.monotonic() + float(self.cfg["startup_timeout_s"])
        while not _healthy(port, timeout=2.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                reason = (
                    f"exited with status {proc.returncode}"
                    if proc.poll() is not None
                    else f"was not healthy after extract.vllm.startup_timeout_s={self.cfg['startup_timeout_s']}"
                )
                _terminate_group(proc.pid, ticks, grace_s=10)
                raise UserError(
                    f"vLLM server {reason}; full log: {self.log_path}\n--- last lines ---\n"
                    f"{_tail(self.log_path, log_start)}"
                )
            time.sleep(0.5)
        state = ServerState(
            pid=proc.pid,
            start_ticks=ticks,
            port=port,
            identity=self.identity,
            command=cmd,
            log=str(self.log_path),
            started_at=time.time(),
        )
        state.watchdog_pid = self._start_watchdog()
        write_json_atomic(self.state_path, asdict(state))
        return state

    def _start_watchdog(self) -> int:
        package_root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "eagle3build.extraction.vllm",
                    "_watch",
                    str(self.dir),
                    str(float(self.cfg["idle_timeout_s"])),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        _children[proc.pid] = proc
        return proc.pid

    def stop(self) -> bool:
        """Stop this host's server (whatever its identity). True if one was running."""
        return _stop_dir(self.dir)


def _stop_dir(host_dir: Path) -> bool:
    state_path = host_dir / "server.json"
    if not state_path.exists():
        return False
    with _flock(host_dir / "server.lock", fcntl.LOCK_EX):
        try:
            state = ServerState(**json.loads(state_path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return False
        running = _alive(state.pid, state.start_ticks)
        _terminate_group(state.pid, state.start_ticks)
        if state.watchdog_pid and state.watchdog_pid != os.getpid():
            _terminate_group(state.watchdog_pid, None, grace_s=5)
        state_path.unlink(missing_ok=True)
        return running


def _host_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir).resolve() / "vllm" / socket.gethostname()


def stop_servers(run_dir: str | os.PathLike) -> bool:
    """Stop the server this host started for run_dir (for the Snakefile's onsuccess/onerror hooks)."""
    return _stop_dir(_host_dir(run_dir))


def _watch(host_dir: Path, idle_timeout_s: float) -> None:
    """Watchdog loop: stop the server once no job has held the clients lock for idle_timeout_s."""
    server_lock, state_path, clients = (
        host_dir / "server.lock",
        host_dir / "server.json",
        host_dir / "clients.lock",
    )
    poll_s = max(0.2, min(10.0, idle_timeout_s / 4))
    last_busy = time.monotonic()
    while True:
        time.sleep(poll_s)
        with _flock(server_lock, fcntl.LOCK_EX):
            try:
                state = ServerState(**json.loads(state_path.read_text()))
            except (FileNotFoundError, json.JSONDecodeError, TypeError):
                state = None
            # Not (or no longer) our server: a newer watchdog is in charge, or it was stopped.
            if state is None or state.watchdog_pid != os.getpid() or not _alive(state.pid, state.start_ticks):
                return
            fd = os.open(clients, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                idle = True
            except BlockingIOError:
                idle = False
            finally:
                os.close(fd)
            if not idle:
                last_busy = time.monotonic()
            elif time.monotonic() - last_busy >= idle_timeout_s:
                print(
                    f"=== eagle3build watchdog: idle for {idle_timeout_s:.0f} s, stopping pid {state.pid}",
                    flush=True,
                )
                _terminate_group(state.pid, state.start_ticks)
                state_path.unlink(missing_ok=True)
                return


# ---------------------------------------------------------------- the client
class _Retryable(Exception):
    """A failed or invalid response that another attempt may fix."""


class _Rejected(Exception):
    """The server refused the request itself (HTTP 4xx): repeating it cannot help."""


class _Client:
    def __init__(self, base_url: str, cfg: dict, storage_path: Path, hidden_size: int, log_path: Path):
        self.url = base_url + "/v1/completions"
        self.cfg = cfg
        self.storage_path = storage_path
        self.hidden_size = hidden_size
        self.log_path = log_path
        self.cancelled = threading.Event()

    def extract(self, where: str, ids: torch.Tensor) -> torch.Tensor:
        """hidden states [T, 4, H] of one sample, retried with exponential backoff."""
        attempts = self.cfg["retries"] + 1
        for attempt in range(attempts):
            if attempt:
                self.cancelled.wait(min(_BACKOFF_S * 2 ** (attempt - 1), 30.0))
            if self.cancelled.is_set():
                raise UserError(f"{where}: cancelled after another sample failed")
            try:
                return self._once(ids)
            except _Retryable as e:
                last = e
            except _Rejected as e:
                raise UserError(f"{where}: {e}") from e
        raise UserError(
            f"{where}: vLLM extraction failed after {attempts} attempts: {last} "
            f"(server log: {self.log_path}; more attempts: extract.vllm.retries)"
        )

    def _once(self, ids: torch.Tensor) -> torch.Tensor:
        sent = ids.to(torch.int64)
        body = json.dumps(
            {"model": SERVED_MODEL_NAME, "prompt": sent.tolist(), "max_tokens": 1, "temperature": 0.0}
        ).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=float(self.cfg["request_timeout_s"])) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            if 400 <= e.code < 500 and e.code not in (408, 429):
                raise _Rejected(
                    f"vLLM rejected the request (HTTP {e.code}: {detail}); a sample longer than the "
                    f"server's limit needs a larger extract.vllm.max_model_len or a smaller prepare.max_length"
                ) from e
            raise _Retryable(f"HTTP {e.code}: {detail}") from e
        except (OSError, json.JSONDecodeError) as e:  # refused, reset, timed out, garbled
            raise _Retryable(f"request failed: {e}") from e
        path = ((reply.get("kv_transfer_params") or {}) if isinstance(reply, dict) else {}).get(
            "hidden_states_path"
        )
        if not path:
            raise _Retryable(
                "the response has no kv_transfer_params.hidden_states_path: is the server running with the "
                f"{CONNECTOR} and the {SPEC_METHOD} method?"
            )
        path = Path(path).resolve()
        if path.parent != self.storage_path:
            # Never read or delete a file outside the connector's folder, whatever the server says.
            raise _Retryable(f"the server named {path}, which is outside {self.storage_path}")
        try:
            return self._load_and_check(path, sent)
        finally:
            path.unlink(missing_ok=True)
            Path(str(path) + ".lock").unlink(missing_ok=True)

    def _load_and_check(self, path: Path, sent: torch.Tensor) -> torch.Tensor:
        lock = Path(str(path) + ".lock")
        try:
            if lock.exists():
                # The connector holds LOCK_EX on the lock file until its async write is complete.
                with _flock(lock, fcntl.LOCK_SH):
                    data = load_file(str(path))
            else:
                data = load_file(str(path))
        except (OSError, SafetensorError, RuntimeError, ValueError) as e:
            raise _Retryable(f"unreadable connector file {path.name}: {e}") from e
        hidden, token_ids = data.get("hidden_states"), data.get("token_ids")
        if hidden is None or token_ids is None:
            raise _Retryable(f"connector file {path.name} lacks hidden_states/token_ids (has {sorted(data)})")
        if token_ids.shape != sent.shape or not torch.equal(token_ids.to(torch.int64), sent):
            raise _Retryable(f"connector file {path.name} holds other token ids than the ones sent")
        expected = (sent.numel(), NUM_SLOTS, self.hidden_size)
        if tuple(hidden.shape) != expected:
            raise _Retryable(
                f"hidden_states has shape {tuple(hidden.shape)}, expected [T, n_ids, H] = {expected}"
            )
        if not hidden.is_floating_point() or not torch.isfinite(hidden).all():
            raise _Retryable(f"hidden_states in {path.name} has non-finite values")
        return hidden


def extract_shard_vllm(tokens_path: str, out_path: str, params: dict, run_dir: str) -> None:
    """Write the hidden shard of one token shard through the run's shared vLLM server.

    params: see `resolve_params` (the target, its layer ids and hidden size), storage_dtype ("bf16" |
    "fp8"), image (EAGLE3_IMAGE, recorded in the metadata) and vllm (the extract.vllm section).
    The server is left running for the next shard job: `stop_servers(run_dir)` ends it.
    """
    shard = read_tokens(tokens_path)
    server = VllmServer(run_dir, params)
    params = server.params
    hidden_size = int(params["hidden_size"])
    meta = {
        "model": str(params["model"]),
        "revision": params.get("revision") or "",  # as the HF backend writes it
        "layer_ids": server.identity["layer_ids"],
        "backend": "vllm",
        "image": params.get("image") or "",
    }
    cu = shard.cu_seqlens.tolist()
    samples = [(i, cu[i], cu[i + 1]) for i in range(shard.num_samples) if cu[i + 1] > cu[i]]
    with (
        server.lease() as base_url,
        HiddenShardWriter(
            out_path,
            shard.input_ids,
            shard.loss_mask,
            shard.cu_seqlens,
            hidden_size,
            params.get("storage_dtype", "bf16"),
            meta,
        ) as writer,
    ):
        client = _Client(base_url, server.cfg, server.storage_path, hidden_size, server.log_path)
        with ThreadPoolExecutor(server.cfg["concurrency"], thread_name_prefix="vllm-extract") as pool:
            pending = {
                pool.submit(
                    client.extract, f"{tokens_path}: sample {i} ({b - a} tokens)", shard.input_ids[a:b]
                ): a
                for i, a, b in samples
            }
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                    for future in done:
                        writer.write(pending.pop(future), future.result())
            except BaseException:
                client.cancelled.set()
                for future in pending:
                    future.cancel()
                raise


# ---------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3build.extraction.vllm", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="stop this host's vLLM server of a run dir")
    stop.add_argument("run_dir")
    watch = sub.add_parser("_watch")  # internal: the idle watchdog
    watch.add_argument("host_dir")
    watch.add_argument("idle_timeout_s", type=float)
    args = parser.parse_args(argv)
    if args.command == "stop":
        print("stopped" if stop_servers(args.run_dir) else "no server running")
    else:
        _watch(Path(args.host_dir), args.idle_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
