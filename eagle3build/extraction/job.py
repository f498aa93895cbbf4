"""Hidden-state extraction, Hugging Face backend: the shard jobs' side.

Snakemake runs one job per shard, each in its own process. So that the model is loaded once per
extraction run rather than once per shard, shard jobs are clients of one extraction server per device
(`python -m eagle3build.extraction.job serve`, the model side in `eagle3build.extraction.hf_server`), started
by the first job that needs it (`eagle3build.engine.process`), shared through a state file under a lock,
stopped by the workflow's onsuccess/onerror hooks (`stop_servers`), after an idle timeout, or when the
workflow that owns it ends (killed: its hooks never run; `eagle3build.engine.process.workflow_owner`). A
job picks a free device with `eagle3build.extraction.devices.device_slot`.

This module imports no torch: a job's start-up is time its GPU sits idle (jobs run one after the other
on each device), and importing torch and initialising CUDA would cost that for every shard. The device
list is therefore found once per run and host, and the disk check runs in the server, which has the
model's hidden size at hand. The disk check covers every hidden shard the run will still write: the
workflow lists them at its start (`write_shard_plan`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import sys
from pathlib import Path

from eagle3build.engine import process
from eagle3build.errors import UserError
from eagle3build.extraction.devices import device_slot, forget_devices, visible_devices
from eagle3build.extraction.plan import pending_token_shards, planned_shards, untokenized_shards
from eagle3build.extraction.protocol import PROTOCOL_VERSION, call
from eagle3build.trust import check_trust


def identity_of(target: dict, aux_layer_ids: list[int], device: str) -> dict:
    return {"model": str(target["path"]), "revision": target.get("revision") or None,
            "trust_remote_code": bool(target.get("trust_remote_code")),
            "dtype": target.get("dtype") or "auto", "aux_layer_ids": list(aux_layer_ids), "device": device}


# ---------------------------------------------------------------- the server
def ensure_server(run_dir: Path, index: int, identity: dict, params: dict) -> dict:
    """Return the state of a live server for `identity` on device slot `index`, starting one if needed.
    params: the resolved `extract` section (server_idle_s, server_start_timeout_s)."""
    state_file = run_dir / f"hf-server-{index}.json"
    log = run_dir / f"hf-server-{index}.log"
    # The workflow's process (or, outside a workflow, this one): the server ends with it.
    owner = process.workflow_owner(default_pid=os.getpid())
    with process.flock(run_dir / f"hf-server-{index}.start.lock", fcntl.LOCK_EX):
        state = process.read_state(state_file)
        if state is not None and process.alive(state["pid"], state.get("start_ticks")) \
                and state["identity"] == identity and state.get("owner") == owner \
                and state.get("protocol") == PROTOCOL_VERSION:
            return state
        # another model / revision / layer set, another workflow's or an older version's: replace it
        process.stop_recorded(state_file, grace_s=10)
        state_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "eagle3build.extraction.job", "serve",
               "--identity", json.dumps(identity), "--state-file", str(state_file),
               "--idle-s", str(params["server_idle_s"]), "--owner", json.dumps(owner)]
        proc = process.start(cmd, log)
        try:
            process.wait_ready(proc, state_file.exists, float(params["server_start_timeout_s"]), poll_s=0.2)
        except process.NotReady as e:
            if e.returncode is None:
                raise UserError(f"the extraction server did not start within extract.server_start_timeout_s; "
                                f"see {log}") from None
            raise UserError(f"the extraction server for {identity['model']} on {identity['device']} exited "
                            f"with code {e.returncode} while loading; its log {log} ends with:\n"
                            f"{process.log_tail(log)}") from None
        return json.loads(state_file.read_text())


def stop_servers(run_dir: str | os.PathLike) -> int:
    """Stop every extraction server recorded under run_dir (the workflow's onsuccess/onerror hook)."""
    states = Path(run_dir).glob("hf-server-*.json")
    stopped = sum(process.stop_recorded(state_file, grace_s=10) for state_file in states)
    forget_devices(run_dir)
    return stopped


def release_devices(run_dir: str | os.PathLike, stage: str) -> int:
    """Stop this host's extraction servers of the run, HF and vLLM, before a later GPU stage (train,
    evaluate) starts: they read every hidden shard, so no extraction job is left, while an idle server
    would keep its GPUs until its idle timeout (a TP-8 vLLM server holds ~90% of every GPU for
    extract.vllm.idle_timeout_s) and the stage would run out of memory. Returns how many were stopped."""
    from eagle3build.extraction import vllm as vllm_backend  # torch and the HTTP client: only when called

    stopped = stop_servers(run_dir) + int(vllm_backend.stop_servers(run_dir))
    if stopped:
        print(f"{stage}: stopped {stopped} extraction server(s) of this run to free their devices", flush=True)
    return stopped


# ---------------------------------------------------------------- the shard job
def extract_shard(tokens_path: str, out_path: str, target: dict, params: dict, run_dir: str) -> dict:
    """Extract one token shard into a hidden shard (the `extract` rule's body, HF backend).

    target: {"path", "revision", "trust_remote_code", "dtype"}; params: the `extract` config section as
    resolved (`eagle3build.config.resolve_section`, as the workflow's config is), with the target's
    `aux_layer_ids`. This side reads no schema: that would cost every job its parse and jsonschema's
    import. The disk check covers this shard and the run's other shards not yet extracted
    (`write_shard_plan`).
    """
    check_trust(target)  # before a server that loads the target (and any code it ships) starts
    run_dir = Path(run_dir)
    devices = visible_devices(params["devices"], run_dir)
    plan = planned_shards(run_dir)
    pending = pending_token_shards(plan, tokens_path)
    request = {"tokens": str(Path(tokens_path).resolve()), "out": str(Path(out_path).resolve()),
               # abspath, not resolve: no syscalls for each of up to 10,000 pending shards
               "pending": [os.path.abspath(t) for t in pending], "untokenized": untokenized_shards(plan),
               "disk_reserve_gb": float(params["disk_reserve_gb"]), "storage_dtype": params["storage_dtype"],
               "batch_tokens": int(params["batch_tokens"]), "max_batch_size": int(params["max_batch_size"]),
               "meta": {"image": params.get("image") or ""}}
    with device_slot(run_dir, devices) as index:
        identity = identity_of(target, params["aux_layer_ids"], devices[index])
        if not params["server"]:
            from eagle3build.extraction.hf_server import Extractor, run_request

            ex = Extractor(identity["model"], identity["aux_layer_ids"], identity["device"],
                           identity["dtype"], identity["revision"], identity["trust_remote_code"])
            return run_request(ex, request)
        state = ensure_server(run_dir, index, identity, params)
        try:
            reply = call(state["port"], state["token"], request)
        except (ConnectionError, OSError) as e:
            log = run_dir / f"hf-server-{index}.log"
            raise UserError(f"lost the extraction server on {identity['device']} ({e}); its log {log} ends "
                            f"with:\n{process.log_tail(log)}") from e
        if not reply.get("ok"):
            raise UserError(f"extracting {tokens_path}: {reply.get('error')}")
        return reply


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3build.extraction.job")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an extraction server (started by shard jobs)")
    s.add_argument("--identity", required=True)
    s.add_argument("--state-file", required=True)
    s.add_argument("--idle-s", type=float, required=True)
    s.add_argument("--owner", default="null", help="JSON {pid, start_ticks}: the workflow it serves")
    st = sub.add_parser("stop", help="stop the extraction servers of a run dir")
    st.add_argument("run_dir")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        from eagle3build.extraction.hf_server import serve

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        serve(json.loads(args.identity), args.state_file, args.idle_s, json.loads(args.owner))
    else:
        print(f"stopped {stop_servers(args.run_dir)} server(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
