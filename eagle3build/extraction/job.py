"""Hidden-state extraction, Hugging Face backend: the shard jobs' side.

Snakemake runs one job per shard, each in its own process. So that the model is loaded once per
extraction run rather than once per shard, shard jobs are clients of one extraction server per device
(`python -m eagle3build.extraction.job serve`, the model side in `eagle3build.extraction.hf_server`), started by the first
job that needs it, shared through a state file under a lock, stopped by the workflow's onsuccess/onerror
hooks (`stop_servers`) or after an idle timeout. A job picks a free device by taking an exclusive `flock`
on that device's slot file, so concurrent jobs never share a GPU and a crashed job frees its slot
automatically.

This module imports no torch: a job's start-up is time its GPU sits idle (jobs run one after the other
on each device), and importing torch and initialising CUDA would cost ≈1 s of it per shard
(BENCHMARKS.md §4). The device list is therefore found once per run and host (`visible_devices`), and
the disk check runs in the server, which has the model's hidden size at hand.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3build.atomic import write_json_atomic
from eagle3build.errors import UserError

DEFAULTS = {
    "backend": "hf",
    "storage_dtype": "bf16",
    "batch_tokens": 8192,
    "max_batch_size": 64,
    "devices": "auto",
    "server": True,
    "server_idle_s": 300,
    "server_start_timeout_s": 1800,
    "disk_reserve_gb": 1.0,
}


# ---------------------------------------------------------------- devices
def visible_devices(spec, run_dir: str | os.PathLike | None = None) -> list[str]:
    """The devices `extract.devices` names; "auto": every CUDA device torch sees, else the CPU."""
    if spec in (None, "auto"):
        return _cuda_devices(run_dir) or ["cpu"]
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    return [f"cuda:{d}" if isinstance(d, int) or str(d).isdigit() else str(d) for d in spec]


def _cuda_devices(run_dir: str | os.PathLike | None) -> list[str]:
    """torch's CUDA devices, remembered in run_dir for the rest of the run (`forget_devices` at its start and
    end), keyed on what decides them here: the host (a container has its own) and the two
    variables that select GPUs. Only the first job of a run on a host pays for importing torch."""
    key = {"host": socket.gethostname(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "NVIDIA_VISIBLE_DEVICES": os.environ.get("NVIDIA_VISIBLE_DEVICES")}
    cache = Path(run_dir) / f"devices-{key['host']}.json" if run_dir is not None else None
    if cache is not None:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
            known = json.loads(cache.read_text())
            if known["key"] == key:
                return list(known["devices"])
    import torch

    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]
    if cache is not None:
        write_json_atomic(cache, {"key": key, "devices": devices})
    return devices


def forget_devices(run_dir: str | os.PathLike) -> None:
    """Drop the remembered device lists: the next run looks again (GPUs may come and go between runs)."""
    for cache in Path(run_dir).glob("devices-*.json"):
        cache.unlink(missing_ok=True)


@contextlib.contextmanager
def device_slot(run_dir: str | os.PathLike, devices: list[str], poll_s: float = 0.2) -> Iterator[int]:
    """Hold an exclusive flock on one device's slot file for the duration of a shard job.

    flock is released by the kernel when the holder dies, so a SIGKILLed job never leaks a device.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for index, _ in enumerate(devices):
            fd = os.open(run_dir / f"slot-{index}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield index
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        time.sleep(poll_s)


# ---------------------------------------------------------------- server and client
# Wire format: 4-byte big-endian length + UTF-8 JSON, one request and one reply per connection.
def _send(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv(sock: socket.socket) -> dict:
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


def identity_of(target: dict, aux_layer_ids: list[int], device: str) -> dict:
    return {"model": str(target["path"]), "revision": target.get("revision") or None,
            "trust_remote_code": bool(target.get("trust_remote_code")), "dtype": target.get("dtype") or "auto",
            "aux_layer_ids": list(aux_layer_ids), "device": device}


def _state_path(run_dir: Path, index: int) -> Path:
    return run_dir / f"hf-server-{index}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _stop_pid(pid: int, grace_s: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def ensure_server(run_dir: Path, index: int, identity: dict, params: dict) -> dict:
    """Return the state of a live server for `identity` on device slot `index`, starting one if needed."""
    state_file = _state_path(run_dir, index)
    log = run_dir / f"hf-server-{index}.log"
    with open(run_dir / f"hf-server-{index}.start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if state_file.exists():
            state = json.loads(state_file.read_text())
            if _alive(state["pid"]) and state["identity"] == identity:
                return state
            if _alive(state["pid"]):  # another model / revision / layer set: replace it
                _stop_pid(state["pid"])
            state_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "eagle3build.extraction.job", "serve", "--identity", json.dumps(identity),
               "--state-file", str(state_file), "--idle-s", str(params.get("server_idle_s", DEFAULTS["server_idle_s"]))]
        env = dict(os.environ)
        with open(log, "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env)
        deadline = time.monotonic() + float(params.get("server_start_timeout_s", DEFAULTS["server_start_timeout_s"]))
        while not state_file.exists():
            if proc.poll() is not None:
                raise UserError(f"the extraction server for {identity['model']} on {identity['device']} exited with "
                                f"code {proc.returncode} while loading; its log {log} ends with:\n{_log_tail(log)}")
            if time.monotonic() > deadline:
                _stop_pid(proc.pid)
                raise UserError(f"the extraction server did not start within extract.server_start_timeout_s; see {log}")
            time.sleep(0.2)
        return json.loads(state_file.read_text())


def stop_servers(run_dir: str | os.PathLike) -> int:
    """Stop every extraction server recorded under run_dir (the workflow's onsuccess/onerror hook)."""
    stopped = 0
    for state_file in Path(run_dir).glob("hf-server-*.json"):
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
            pid = json.loads(state_file.read_text())["pid"]
            if _alive(pid):
                _stop_pid(pid)
                stopped += 1
            state_file.unlink(missing_ok=True)
    forget_devices(run_dir)
    return stopped


def _request(state: dict, req: dict) -> dict:
    with socket.create_connection(("127.0.0.1", state["port"])) as sock:
        _send(sock, {**req, "token": state["token"]})
        return _recv(sock)


# ---------------------------------------------------------------- the shard job
def extract_shard(tokens_path: str, out_path: str, target: dict, params: dict, run_dir: str,
                  pending_tokens: list[str] | None = None) -> dict:
    """Extract one token shard into a hidden shard (the `extract` rule's body, HF backend).

    target: {"path", "revision", "trust_remote_code", "dtype"}; params: the `extract` config section plus
    the resolved `aux_layer_ids`. `pending_tokens`: token shards whose hidden shards are still missing,
    for the disk check (defaults to this shard alone).
    """
    params = {**DEFAULTS, **params}
    run_dir = Path(run_dir)
    devices = visible_devices(params["devices"], run_dir)
    request = {"tokens": str(Path(tokens_path).resolve()), "out": str(Path(out_path).resolve()),
               # abspath, not resolve: no syscalls for each of up to 10,000 pending shards (0.16 s a job)
               "pending": [os.path.abspath(t) for t in pending_tokens or [tokens_path]],
               "disk_reserve_gb": float(params["disk_reserve_gb"]), "storage_dtype": params["storage_dtype"],
               "batch_tokens": int(params["batch_tokens"]), "max_batch_size": int(params["max_batch_size"]),
               "meta": {"image": params.get("image") or ""}}
    with device_slot(run_dir, devices) as index:
        identity = identity_of(target, params["aux_layer_ids"], devices[index])
        if not params["server"]:
            from eagle3build.extraction.hf_server import Extractor, run_request

            ex = Extractor(identity["model"], identity["aux_layer_ids"], identity["device"], identity["dtype"],
                           identity["revision"], identity["trust_remote_code"])
            return run_request(ex, request)
        state = ensure_server(run_dir, index, identity, params)
        try:
            reply = _request(state, request)
        except (ConnectionError, OSError) as e:
            log = run_dir / f"hf-server-{index}.log"
            raise UserError(f"lost the extraction server on {identity['device']} ({e}); its log {log} ends with:\n"
                            f"{_log_tail(log)}") from e
        if not reply.get("ok"):
            raise UserError(f"extracting {tokens_path}: {reply.get('error')}")
        return reply


def pending_token_shards(out_root: str, this_shard: str | None = None) -> list[str]:
    """Token shards whose hidden shard does not exist yet: what the rest of the run will write."""
    root = Path(out_root)
    pending = {str(Path(this_shard))} if this_shard else set()
    for tokens in (root / "tokens").glob("*/*.safetensors"):
        rel = tokens.relative_to(root / "tokens")
        if not (root / "hidden" / rel).exists():
            pending.add(str(tokens))
    return sorted(pending)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3build.extraction.job")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an extraction server (started by shard jobs)")
    s.add_argument("--identity", required=True)
    s.add_argument("--state-file", required=True)
    s.add_argument("--idle-s", type=float, default=DEFAULTS["server_idle_s"])
    st = sub.add_parser("stop", help="stop the extraction servers of a run dir")
    st.add_argument("run_dir")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        from eagle3build.extraction.hf_server import serve

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        serve(json.loads(args.identity), args.state_file, args.idle_s)
    else:
        print(f"stopped {stop_servers(args.run_dir)} server(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
