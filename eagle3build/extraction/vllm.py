"""Hidden-state extraction through vLLM's public `extract_hidden_states` path.

vLLM serves the target with the `extract_hidden_states` speculative method and the
`ExampleHiddenStatesConnector` KV connector. Each request (prompt token ids, `max_tokens=1`) makes the
connector write one safetensors file, `{shared_storage_path}/{request_id}.safetensors`, holding
`hidden_states` [T, n_ids, H] and `token_ids` [T]; the response's `kv_transfer_params.hidden_states_path`
names it, and a companion `<file>.lock` is held with an exclusive flock until the write is complete.
Nothing here touches vLLM internals: we only build a `vllm serve` command line and speak HTTP.

What the engine needs, read from vLLM's source and checked on a GPU with vLLM 0.25.0:
- chunked prefill stays on (turning it off warns that outputs may be wrong, sizes the step's token budget
  to max_model_len and asserts on hybrid targets); `--max-model-len` is prepare.max_length + 1 unless
  extract.vllm.max_model_len says more, never the model's own limit (Kimi-K2.5: 262,144);
- aux ids are distinct, and not 0 on DeepSeek-family targets (`config.check_aux_layer_ids`, at config time);
- MLA targets (DeepSeek-V3, Kimi-K2/K2.5) are fine: the connector refuses only KV caches of two or more
  groups, and a pure-MLA target has one;
- no request is ever aborted while vLLM holds it: vLLM < 0.33 crashes when a queued request is aborted,
  and a client's disconnect aborts it. Clients talk to a relay (`eagle3build.engine.relay`, the process
  that starts `vllm serve`) which keeps every request open until vLLM answers, whatever the client does.

Two pieces:
- `VllmServer`: one managed relay + `vllm serve` per run dir and host, shared by every concurrent shard job
  (separate processes started by Snakemake), through `eagle3build.engine.process`: a lock file serialises
  start/stop, a state file records pid/port/identity, and each job holds a shared flock on a "clients" file
  while it uses the server, so a server is replaced only when nobody uses it. A detached watchdog stops the
  server once it has been idle for `idle_timeout_s`, and as soon as no job uses it once the workflow it
  serves has ended (Snakemake killed before its onerror hook ran; its jobs end with it).
- `extract_shard_vllm(...)`: sends every sample of a token shard (`eagle3build.engine.http`), checks each
  returned file and writes exactly the hidden shard the HF backend writes (slots = 3 aux ids then the final
  id N).

Its settings are the config section `extract.vllm` (defaults in eagle3build/config.schema.yaml).
`python -m eagle3build.extraction.vllm stop RUN_DIR` stops this host's server (what `stop_servers` does).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eagle3build.atomic import write_json_atomic
from eagle3build.config import resolve_aux_layer_ids, resolve_section, section_schema, target_text_config
from eagle3build.engine import process, relay
from eagle3build.engine.http import GaveUp, JsonClient, Rejected, Retryable, with_retries
from eagle3build.engine.vllm_server import (
    SERVED_MODEL_NAME,
    free_port,
    healthy,
    launch,
    serve_command,
    server_config,
)
from eagle3build.errors import ConfigError, UserError
from eagle3build.extraction.disk import check_disk
from eagle3build.extraction.plan import pending_token_shards, planned_shards, untokenized_shards
from eagle3build.shards import NUM_SLOTS, HiddenShardWriter, read_tokens

CONNECTOR = "ExampleHiddenStatesConnector"
SPEC_METHOD = "extract_hidden_states"
_BACKOFF_S = 0.5  # first retry delay; doubles each attempt, capped at engine.http.BACKOFF_MAX_S


# ---------------------------------------------------------------- config
def resolve_params(params: dict) -> dict:
    """Flat extraction params from either shape the callers use, over the schema's defaults.

    Flat: model, revision, trust_remote_code, layer_ids (3 aux ids then N), hidden_size.
    Workflow: target {path, revision, trust_remote_code}, aux_layer_ids (3 ids): N and H are read from
    the target's config, and the ids are checked as vLLM needs them (`config.check_aux_layer_ids`). Both
    also carry keys of the `extract` section (storage_dtype, image, and vllm: the extract.vllm section) and
    may carry max_length (prepare.max_length; default: the schema's), from which the server's
    max_model_len is derived when extract.vllm.max_model_len is null.
    """
    vllm = server_config("extract.vllm", params.get("vllm"))
    keys = section_schema("extract")["properties"]
    section = resolve_section("extract", {k: v for k, v in params.items() if k in keys and k != "vllm"})
    out = {**params, **section, "vllm": vllm}
    target = params.get("target")
    if target is not None:
        out.setdefault("model", target.get("path") or target.get("model"))
        out.setdefault("revision", target.get("revision"))
        out.setdefault("trust_remote_code", target.get("trust_remote_code"))
        if "layer_ids" not in params or "hidden_size" not in params:
            _layers_from_target(out, params["aux_layer_ids"])
    if not out.get("model"):
        raise ConfigError("target.model", "is required")
    ids = out.get("layer_ids")
    if (
        not isinstance(ids, (list, tuple))
        or len(ids) != NUM_SLOTS
        or not all(isinstance(i, int) for i in ids)
    ):
        raise ConfigError("extract.aux_layer_ids", f"expected three aux layer ids then N, got {ids!r}")
    if len(set(ids)) != len(ids):  # vLLM returns one state per distinct layer: the engine would crash
        raise ConfigError("extract.aux_layer_ids", f"layer ids {list(ids)} repeat a layer, which vLLM cannot "
                                                   "capture; use three distinct aux ids or the hf backend")
    out["layer_ids"] = list(ids)
    out["vllm"] = {**vllm, "max_model_len": _max_model_len(vllm["max_model_len"], out.get("max_length"))}
    return out


def _layers_from_target(out: dict, aux_layer_ids: list[int]) -> None:
    """layer ids (aux, then N) and H from the target's config, the aux ids checked as vLLM needs them."""
    target = {"path": out["model"], "revision": out["revision"], "trust_remote_code": out["trust_remote_code"] is True}
    text = target_text_config(target)
    aux = resolve_aux_layer_ids(target, list(aux_layer_ids), "extract.backend: vllm")
    out.setdefault("layer_ids", [*aux, int(text["num_hidden_layers"])])
    out.setdefault("hidden_size", int(text["hidden_size"]))


def _max_model_len(configured: int | None, max_length: int | None) -> int:
    """The server's context: the longest sample (prepare.max_length) plus the one token generated."""
    if max_length is None:
        max_length = resolve_section("prepare", {})["max_length"]
    need = int(max_length) + 1
    if configured is None:
        return need
    if int(configured) < need:
        raise ConfigError("extract.vllm.max_model_len", f"{configured} cannot hold a prepare.max_length={max_length}"
                          f"-token sample plus the generated token; set it >= {need} or null (= {need})")
    return int(configured)


def build_command(params: dict, port: int, storage_path: str) -> list[str]:
    """The `vllm serve` argv. Every value is a separate argv item: nothing passes through a shell."""
    params = resolve_params(params)
    cfg = params["vllm"]
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
    # Chunked prefill stays on (vLLM's default): the connector saves a request's states once it has
    # finished, however many steps its prefill took. `--max-model-len` comes from resolve_params.
    engine_args = ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
    return serve_command(cfg, params, port, engine_args)


# ---------------------------------------------------------------- the managed server
@dataclass
class ServerState:
    pid: int  # the relay's; vLLM is its child, in its process group
    start_ticks: int | None
    port: int  # the relay's, which clients use
    identity: dict
    command: list
    log: str
    watchdog_pid: int | None = None
    started_at: float = 0.0
    upstream_port: int | None = None  # vLLM's own port: only the relay talks to it
    owner: dict | None = None  # the workflow it serves ({"pid", "start_ticks"}): its watchdog stops it after


class VllmServer:
    """The `vllm serve` (behind its relay) shared by every extraction job of one run dir on this host.

    Files under `RUN_DIR/vllm/<host>/` (per host: on a cluster, jobs on other nodes start their own):
    `server.lock` (held while starting, reusing or stopping), `server.json` (the state), `clients.lock` (a
    shared flock per job using the server), `vllm-server.log`, and `connector/` (the connector's files,
    unless shared_storage_path is set).
    """

    def __init__(self, run_dir: str | os.PathLike, params: dict):
        self.params = params = resolve_params(params)
        self.cfg = params["vllm"]
        self.run_dir = Path(run_dir).resolve()
        self.dir = _host_dir(run_dir)
        self.files = _server_files(self.dir)
        self.state_path = self.files.state
        self.log_path = self.files.log
        self.storage_path = Path(self.cfg["shared_storage_path"] or self.dir / "connector").resolve()
        self.identity = {
            "model": str(params["model"]),
            "revision": params.get("revision"),
            "trust_remote_code": params.get("trust_remote_code") is True,
            "layer_ids": params["layer_ids"],
            "image": params.get("image"),
            "shared_storage_path": str(self.storage_path),
            "max_model_len": self.cfg["max_model_len"],
        }

    def read_state(self) -> ServerState | None:
        state = process.read_state(self.state_path)
        try:
            return ServerState(**state) if state is not None else None
        except TypeError:
            return None

    @contextlib.contextmanager
    def lease(self) -> Iterator[str]:
        """Yield the base URL of a healthy server with our identity, starting one if needed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as using:
            with process.flock(self.files.lock, fcntl.LOCK_EX):
                state = self.read_state()
                if state is not None and not self._reusable(state):
                    self._retire(state)
                    state = None
                if state is None:
                    state = self._start()
                self._adopt(state)
                using.enter_context(self.files.client())
            yield f"http://127.0.0.1:{state.port}"

    def _reusable(self, state: ServerState) -> bool:
        if state.identity != self.identity or not process.alive(state.pid, state.start_ticks):
            return False
        # A busy server can answer /health slowly: give it a few chances before calling it broken.
        for attempt in range(3):
            if healthy(state.port):
                return True
            time.sleep(2.0 * (attempt + 1))
        return False

    def _adopt(self, state: ServerState) -> None:
        """Make the server this job's workflow's (reused from a run that ended): it lives as long as that."""
        owner = process.workflow_owner()
        if owner is not None and state.owner != owner:
            state.owner = owner
            write_json_atomic(self.state_path, asdict(state))

    def _retire(self, state: ServerState) -> None:
        """Stop a dead, broken or other-identity server, unless other jobs are still using it."""
        if process.alive(state.pid, state.start_ticks):
            if not process.unlocked(self.files.clients):
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
            process.terminate(state.pid, state.start_ticks)
        self.state_path.unlink(missing_ok=True)

    def _start(self) -> ServerState:
        port = int(self.cfg["port"] or free_port())
        upstream = free_port()
        while upstream == port:  # a port just released may come back
            upstream = free_port()
        self.storage_path.mkdir(parents=True, exist_ok=True)
        vllm_cmd = build_command(self.params, upstream, str(self.storage_path))
        if shutil.which(vllm_cmd[0]) is None:  # the relay would start, then fail to run it
            raise ConfigError("extract.vllm.executable",
                              f"cannot run {vllm_cmd[0]!r} (not found); install vLLM or run inside the image")
        cmd = relay.command(port, upstream, str(self.storage_path), vllm_cmd)
        proc = launch(cmd, self.cfg, self.log_path, port, "extract.vllm")
        ticks = process.start_ticks(proc.pid)
        state = ServerState(pid=proc.pid, start_ticks=ticks, port=port, identity=self.identity, command=cmd,
                            log=str(self.log_path), started_at=time.time(), upstream_port=upstream,
                            owner=process.workflow_owner())
        state.watchdog_pid = process.start_watchdog(self.files, float(self.cfg["idle_timeout_s"]))
        write_json_atomic(self.state_path, asdict(state))
        return state


def _host_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir).resolve() / "vllm" / socket.gethostname()


def _server_files(host_dir: Path) -> process.ServerFiles:
    return process.ServerFiles(lock=host_dir / "server.lock", state=host_dir / "server.json",
                               clients=host_dir / "clients.lock", log=host_dir / "vllm-server.log")


def stop_servers(run_dir: str | os.PathLike) -> bool:
    """Stop the server this host started for run_dir (for the Snakefile's onsuccess/onerror hooks).
    True if one was running."""
    files = _server_files(_host_dir(run_dir))
    if not files.state.exists():
        return False
    with process.flock(files.lock, fcntl.LOCK_EX):
        return process.stop_recorded(files.state)


# ---------------------------------------------------------------- the client
def file_threads() -> int:
    """Threads that read, check and convert connector files at once: the cores, at most 8 (each holds
    one sample's states in memory: [T, 4, H] bf16, 1.8 GB for a 32k-token sample at H = 7168)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores))


class _Client:
    """Sends the samples of a shard to the server, reads the connector's file of each and writes its rows.

    One pool of `concurrency + file_threads()` threads, one sample per task, two bounds: at most
    `concurrency` requests are with vLLM at once (a thread holds a slot from sending to the answer only,
    so the next request goes out while the last file is read), and at most `file_threads()` connector
    files are read, checked, converted and written at once (the GIL is released in the reads, torch ops
    and pwrite, so they run in parallel). Rows go straight to their offsets in the shard: the order in
    which samples finish does not matter.
    """

    def __init__(self, base_url: str, cfg: dict, storage_path: Path, hidden_size: int, log_path: Path):
        self.http = JsonClient(base_url, float(cfg["request_timeout_s"]))
        self.cfg = cfg
        self.storage_path = storage_path
        self.hidden_size = hidden_size
        self.log_path = log_path
        self.cancelled = threading.Event()
        self.in_flight = threading.BoundedSemaphore(int(cfg["concurrency"]))
        self.reading = threading.BoundedSemaphore(file_threads())

    def run(self, label: str, input_ids: torch.Tensor, samples: list[tuple[int, int, int]],
            writer: HiddenShardWriter) -> None:
        """Every sample (index, start, end) of `input_ids` into `writer`. The first failure cancels the
        samples not yet sent and is raised once the ones in flight have finished (their files deleted)."""
        threads = int(self.cfg["concurrency"]) + file_threads()
        with ThreadPoolExecutor(threads, thread_name_prefix="vllm-extract") as pool:
            futures = [pool.submit(self.sample, f"{label}: sample {i} ({b - a} tokens)", input_ids[a:b], a, writer)
                       for i, a, b in samples]
            try:
                for future in as_completed(futures):
                    future.result()
            except BaseException:
                self.cancelled.set()
                for future in futures:
                    future.cancel()
                raise

    def sample(self, where: str, ids: torch.Tensor, offset: int, writer: HiddenShardWriter) -> None:
        if self.cancelled.is_set():
            return
        self.extract(where, ids, lambda rows: writer.write_now(offset, rows))

    def extract(self, where: str, ids: torch.Tensor, use=lambda rows: rows):
        """use(hidden states [T, 4, H]) of one sample, called while its connector file is read (the rows
        may be a view of it); requests retried with exponential backoff."""

        def not_cancelled() -> None:
            if self.cancelled.is_set():
                raise UserError(f"{where}: cancelled after another sample failed")

        try:
            return with_retries(lambda: self._once(ids, use), self.cfg["retries"], _BACKOFF_S,
                                sleep=self.cancelled.wait, before=not_cancelled)
        except Rejected as e:
            raise UserError(f"{where}: vLLM rejected the request (HTTP {e.status}: {e.message}){_hint(e)}") from e
        except GaveUp as e:
            raise UserError(
                f"{where}: vLLM extraction failed after {e.attempts} attempts: {e.last} "
                f"(server log: {self.log_path}; more attempts: extract.vllm.retries)"
            ) from e

    def _once(self, ids: torch.Tensor, use):
        sent = ids.to(torch.int64)
        body = {"model": SERVED_MODEL_NAME, "prompt": sent.tolist(), "max_tokens": 1, "temperature": 0.0}
        with self.in_flight:
            reply = self.http.post_json("/v1/completions", body, what="a completion")
        path = ((reply.get("kv_transfer_params") or {}) if isinstance(reply, dict) else {}).get(
            "hidden_states_path"
        )
        if not path:
            raise Retryable(
                "the response has no kv_transfer_params.hidden_states_path: is the server running with the "
                f"{CONNECTOR} and the {SPEC_METHOD} method?"
            )
        path = Path(path).resolve()
        if path.parent != self.storage_path:
            # Never read or delete a file outside the connector's folder, whatever the server says.
            raise Retryable(f"the server named {path}, which is outside {self.storage_path}")
        try:
            with self.reading:
                # A failed check is Retryable (another request); a failed write is not (the disk's).
                return use(self._load_and_check(path, sent))
        finally:
            path.unlink(missing_ok=True)
            Path(str(path) + ".lock").unlink(missing_ok=True)

    def _load_and_check(self, path: Path, sent: torch.Tensor) -> torch.Tensor:
        lock = Path(str(path) + ".lock")
        try:
            if lock.exists():
                # The connector holds LOCK_EX on the lock file until its async write is complete.
                with process.flock(lock, fcntl.LOCK_SH):
                    data = load_file(str(path))
            else:
                data = load_file(str(path))
        except (OSError, SafetensorError, RuntimeError, ValueError) as e:
            raise Retryable(f"unreadable connector file {path.name}: {e}") from e
        hidden, token_ids = data.get("hidden_states"), data.get("token_ids")
        if hidden is None or token_ids is None:
            raise Retryable(f"connector file {path.name} lacks hidden_states/token_ids (has {sorted(data)})")
        if token_ids.shape != sent.shape or not torch.equal(token_ids.to(torch.int64), sent):
            raise Retryable(f"connector file {path.name} holds other token ids than the ones sent")
        expected = (sent.numel(), NUM_SLOTS, self.hidden_size)
        if tuple(hidden.shape) != expected:
            raise Retryable(
                f"hidden_states has shape {tuple(hidden.shape)}, expected [T, n_ids, H] = {expected}"
            )
        if not hidden.is_floating_point() or not _finite(hidden):
            raise Retryable(f"hidden_states in {path.name} has non-finite values")
        return hidden


def _finite(values: torch.Tensor) -> bool:
    """No NaN or ±inf: min and max propagate NaN and are ±inf when any value is (one pass, no mask:
    ~25x faster than isfinite().all() on bf16 CPU tensors)."""
    if values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _hint(rejected: Rejected) -> str:
    """What to do about an answer vLLM will give again (its messages as vLLM 0.25.0 words them)."""
    message = rejected.message
    if "maximum context length" in message:
        return ("; the sample is longer than the server's --max-model-len: raise extract.vllm.max_model_len "
                "(null = prepare.max_length + 1) or lower prepare.max_length")
    if "out of vocabulary" in message:
        return "; the token shards hold ids the served target does not know: were they made with its tokenizer?"
    if rejected.status == 404:
        return (f"; the server on this port does not serve {SERVED_MODEL_NAME!r}: another program may hold "
                "extract.vllm.port")
    return ""


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
    plan = planned_shards(run_dir)  # the run's other shards not yet extracted must fit too, before any request
    check_disk(out_path, pending_token_shards(plan, tokens_path), hidden_size, params["storage_dtype"],
               float(params["disk_reserve_gb"]), untokenized_shards(plan))
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
            params["storage_dtype"],
            meta,
        ) as writer,
    ):
        client = _Client(base_url, server.cfg, server.storage_path, hidden_size, server.log_path)
        client.run(tokens_path, shard.input_ids, samples, writer)


# ---------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3build.extraction.vllm", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="stop this host's vLLM server of a run dir")
    stop.add_argument("run_dir")
    args = parser.parse_args(argv)
    print("stopped" if stop_servers(args.run_dir) else "no server running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
