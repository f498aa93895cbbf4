"""Hidden-state extraction, Hugging Face backend.

`Extractor` loads the target once and turns token shards into hidden shards. It captures, with
forward pre-hooks, the residual stream *entering* each aux layer (= HF `hidden_states[L]`) and the
stream entering the final norm (the pre-norm final state; HF's own `hidden_states[-1]` is post-norm),
so no logits and no extra hidden states are materialised. Samples are sorted by length and batched
under a token budget (right padding never changes a causal model's states at real positions); only
real tokens are stored, packed back to back, by a writer thread that overlaps disk writes with compute.

Snakemake runs one job per shard, each in its own process. So that the model is loaded once per
extraction run rather than once per shard, shard jobs are clients of one extraction server per device
(`python -m eagle3build.extract serve`), started by the first job that needs it, shared through a state
file under a lock, stopped by the workflow's onsuccess/onerror hooks (`stop_servers`) or after an idle
timeout. A job picks a free device by taking an exclusive `flock` on that device's slot file, so
concurrent jobs never share a GPU and a crashed job frees its slot automatically.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import UserError
from .shards import HiddenShardWriter, hidden_bytes_per_token, read_meta, read_tokens

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


# ---------------------------------------------------------------- the model side
def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[name]
    except KeyError:
        raise UserError(f"config key 'target.dtype': '{name}' is not one of auto, bfloat16, float16, float32") from None


def length_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group sample indices, longest first, so each padded batch (B x longest) fits the token budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and ((len(cur) + 1) * longest > batch_tokens or len(cur) >= max_batch_size):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class Extractor:
    """A target model loaded once, with hooks that capture the aux and final streams."""

    def __init__(self, model: str, aux_layer_ids: list[int], device: str = "cpu", dtype: str = "auto",
                 revision: str | None = None, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.dtype = resolve_dtype(dtype, device)
        self.model_id, self.revision = model, revision
        lm = AutoModelForCausalLM.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code,
                                                  dtype=self.dtype)
        base = lm.get_decoder()
        layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
        if layers is None or norm is None:
            raise UserError(f"{model}: the HF backend needs a decoder with `.layers` and a final `.norm` "
                            f"({type(base).__name__} has not); use extract.backend: vllm")
        n = len(layers)
        bad = [i for i in aux_layer_ids if not 0 <= i < n]
        if len(aux_layer_ids) != 3 or bad:
            raise UserError(f"config key 'extract.aux_layer_ids': {aux_layer_ids} must be three ids in [0, {n - 1}] "
                            f"for this {n}-layer target (default: 2, {n // 2}, {n - 3})")
        self.aux_layer_ids = list(aux_layer_ids)
        self.layer_ids = self.aux_layer_ids + [n]
        self.hidden_size = lm.config.get_text_config().hidden_size
        # Drop the lm_head: extraction never needs logits over the vocabulary.
        self.base = base.to(device).eval()
        del lm
        self._captured: dict[int, torch.Tensor] = {}
        for slot, module in enumerate([layers[i] for i in self.aux_layer_ids] + [norm]):
            module.register_forward_pre_hook(self._hook(slot), with_kwargs=True)

    def _hook(self, slot: int):
        def capture(module, args, kwargs):
            self._captured[slot] = args[0] if args else kwargs["hidden_states"]
        return capture

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> the states at `rows` (flat indices into B*T), packed: [len(rows), 4, H]
        (three aux streams, then the pre-norm final stream)."""
        self._captured.clear()
        self.base(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        return torch.stack([self._captured[s].flatten(0, 1).index_select(0, rows) for s in range(4)], dim=1)

    def extract_shard(self, tokens_path: str, out_path: str, storage_dtype: str, batch_tokens: int,
                      max_batch_size: int = 64, meta: dict | None = None, progress: bool = True) -> dict:
        shard = read_tokens(tokens_path)
        lengths = shard.lengths
        meta = {"model": str(self.model_id), "revision": self.revision or "", "layer_ids": self.layer_ids,
                "backend": "hf", "model_dtype": str(self.dtype).removeprefix("torch."), **(meta or {})}
        t0 = time.perf_counter()
        bar = _progress(total=int(shard.input_ids.numel()), desc=Path(out_path).name, enabled=progress)
        with HiddenShardWriter(out_path, shard.input_ids, shard.loss_mask, shard.cu_seqlens, self.hidden_size,
                               storage_dtype, meta) as writer:
            # Pinned inputs copied with non_blocking: a pageable host-to-device copy synchronises the stream,
            # which would stall the queue of forwards behind every batch.
            pin = self.device.startswith("cuda")
            for batch in length_batches(lengths, batch_tokens, max_batch_size):
                longest = lengths[batch[0]]
                ids = torch.zeros(len(batch), longest, dtype=torch.long, pin_memory=pin)
                mask = torch.zeros(len(batch), longest, dtype=torch.long, pin_memory=pin)
                spans = []
                for row, i in enumerate(batch):
                    a, b = int(shard.cu_seqlens[i]), int(shard.cu_seqlens[i + 1])
                    ids[row, : b - a] = shard.input_ids[a:b]
                    mask[row, : b - a] = 1
                    spans.append((a, b - a))
                # Real positions as flat indices computed here, so packing them needs no device sync.
                real = torch.cat([torch.arange(n) + row * longest for row, (_, n) in enumerate(spans)])
                real = real.pin_memory() if pin else real
                states = self.forward(*(t.to(self.device, non_blocking=True) for t in (ids, mask, real)))
                writer.write_batch(spans, states)
                bar.update(int(real.numel()))
        bar.close()
        seconds = time.perf_counter() - t0
        tokens = int(sum(lengths))
        return {"tokens": tokens, "samples": len(lengths), "seconds": seconds,
                "tokens_per_s": tokens / max(seconds, 1e-9)}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not enabled, file=sys.stderr,
                mininterval=2.0)


# ---------------------------------------------------------------- disk estimate
def check_disk(out_path: str, tokens_paths: list[str], hidden_size: int, storage_dtype: str,
               reserve_gb: float) -> int:
    """Refuse (UserError) unless the disk holds every listed, not yet extracted shard. Returns bytes needed."""
    per_token = hidden_bytes_per_token(hidden_size, storage_dtype)
    need = sum(int(read_meta(p)["num_tokens"]) * per_token for p in tokens_paths)
    folder = Path(out_path).parent
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    reserve = int(reserve_gb * 1e9)
    if need + reserve > free:
        raise UserError(f"{folder}: extraction needs {need / 1e9:.2f} GB for {len(tokens_paths)} shard(s) "
                        f"({per_token} bytes/token, {storage_dtype}) + {reserve_gb} GB reserve, but only "
                        f"{free / 1e9:.2f} GB is free. Free space, move output_root, or set "
                        f"extract.storage_dtype: fp8 (halves the bytes)")
    return need


# ---------------------------------------------------------------- devices
def visible_devices(spec) -> list[str]:
    if spec in (None, "auto"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    return [f"cuda:{d}" if isinstance(d, int) or str(d).isdigit() else str(d) for d in spec]


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


def serve(identity: dict, state_file: str, idle_s: float) -> None:
    """Run an extraction server until idle for `idle_s` seconds (or SIGTERM)."""
    extractor = Extractor(identity["model"], identity["aux_layer_ids"], identity["device"], identity["dtype"],
                          identity["revision"], identity["trust_remote_code"])
    token = secrets.token_hex(16)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1.0)
    state = {"pid": os.getpid(), "port": listener.getsockname()[1], "token": token, "identity": identity}
    tmp = Path(state_file).with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(tmp, state_file)
    print(f"extraction server ready: {identity} on port {state['port']}", flush=True)
    last = time.monotonic()
    while time.monotonic() - last < idle_s:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(None)
            try:
                req = _recv(conn)
                if req.get("token") != token:
                    _send(conn, {"ok": False, "error": "bad token"})
                    continue
                print(f"extract {req['tokens']} -> {req['out']}", flush=True)
                stats = extractor.extract_shard(req["tokens"], req["out"], req["storage_dtype"], req["batch_tokens"],
                                                req.get("max_batch_size", 64), req.get("meta"), progress=True)
                print(f"done {stats}", flush=True)
                _send(conn, {"ok": True, **stats})
            except UserError as e:
                _send(conn, {"ok": False, "error": str(e), "user_error": True})
            except Exception as e:  # report to the client, keep serving
                import traceback

                traceback.print_exc()
                with contextlib.suppress(OSError):
                    _send(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        last = time.monotonic()
    print("idle timeout: exiting", flush=True)
    with contextlib.suppress(FileNotFoundError):
        if json.loads(Path(state_file).read_text()).get("pid") == os.getpid():
            os.unlink(state_file)


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
        cmd = [sys.executable, "-m", "eagle3build.extract", "serve", "--identity", json.dumps(identity),
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
    hidden_size = _hidden_size(target)
    check_disk(out_path, pending_tokens or [tokens_path], hidden_size, params["storage_dtype"],
               params["disk_reserve_gb"])
    meta = {"image": params.get("image") or ""}
    devices = visible_devices(params["devices"])
    run_dir = Path(run_dir)
    with device_slot(run_dir, devices) as index:
        identity = identity_of(target, params["aux_layer_ids"], devices[index])
        request = {"tokens": str(Path(tokens_path).resolve()), "out": str(Path(out_path).resolve()),
                   "storage_dtype": params["storage_dtype"], "batch_tokens": int(params["batch_tokens"]),
                   "max_batch_size": int(params["max_batch_size"]), "meta": meta}
        if not params["server"]:
            ex = Extractor(identity["model"], identity["aux_layer_ids"], identity["device"], identity["dtype"],
                           identity["revision"], identity["trust_remote_code"])
            return ex.extract_shard(request["tokens"], request["out"], request["storage_dtype"],
                                    request["batch_tokens"], request["max_batch_size"], meta)
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


def _hidden_size(target: dict) -> int:
    from .config import target_text_config

    return int(target_text_config(target)["hidden_size"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3build.extract")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an extraction server (started by shard jobs)")
    s.add_argument("--identity", required=True)
    s.add_argument("--state-file", required=True)
    s.add_argument("--idle-s", type=float, default=DEFAULTS["server_idle_s"])
    st = sub.add_parser("stop", help="stop the extraction servers of a run dir")
    st.add_argument("run_dir")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        identity = json.loads(args.identity)
        if identity["device"].startswith("cuda"):
            torch.cuda.set_device(identity["device"])
        serve(identity, args.state_file, args.idle_s)
    else:
        print(f"stopped {stop_servers(args.run_dir)} server(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
