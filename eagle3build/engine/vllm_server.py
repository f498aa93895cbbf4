"""`vllm serve` as a child process: the one command line and start-up of every stage that serves the target.

Extraction (`eagle3build.extraction.vllm`, config section `extract.vllm`) and evaluation
(`eagle3build.evaluate.vllm`, section `evaluate.vllm`) serve the target through vLLM's public CLI and only
speak HTTP to it. What they share lives here: the section's settings (`server_config`), the `vllm serve`
argv (`serve_command`), the health check and the start that waits for it (`launch`, run by
`eagle3build.engine.process`). Every value is a separate argv item: nothing passes through a shell.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from eagle3build.config import resolve_section
from eagle3build.engine import process
from eagle3build.engine.http import JsonClient
from eagle3build.errors import ConfigError, UserError
from eagle3build.trust import check_trust

SERVED_MODEL_NAME = "eagle3build-target"  # what requests name and what the metrics' model_name label says
HEALTH_TIMEOUT_S = 5.0
# Our requests are greedy and need none of FlashInfer's sampling kernels; an engine whose flashinfer is
# missing or was built for other GPUs fails when the sampler imports them. The section's env may set it.
SERVER_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def server_config(section: str, given: dict | None) -> dict:
    """A server section (`extract.vllm`, `evaluate.vllm`) over the schema's defaults; `executable` a list."""
    cfg = resolve_section(section, given)
    exe = cfg["executable"]
    return {**cfg, "executable": [exe] if isinstance(exe, str) else list(exe)}


def serve_command(cfg: dict, target: dict, port: int, engine_args: list[str]) -> list[str]:
    """`vllm serve` argv: the target (model, revision, trust_remote_code), the section's parallelism and
    memory settings, then the stage's own `engine_args`, then the section's `extra_args`."""
    check_trust(target)  # --trust-remote-code makes vLLM import the repo's code
    cmd = [*cfg["executable"], "serve", str(target["model"]), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", SERVED_MODEL_NAME]
    if target.get("revision"):
        # Pin code and tokenizer too: vLLM otherwise loads them from the default branch.
        rev = str(target["revision"])
        cmd += ["--revision", rev, "--code-revision", rev, "--tokenizer-revision", rev]
    if target.get("trust_remote_code") is True:
        cmd.append("--trust-remote-code")
    cmd += ["--tensor-parallel-size", str(cfg["tensor_parallel_size"])]
    cmd += ["--data-parallel-size", str(cfg["data_parallel_size"])]
    cmd += ["--gpu-memory-utilization", str(cfg["gpu_memory_utilization"])]
    if cfg["max_model_len"]:
        cmd += ["--max-model-len", str(int(cfg["max_model_len"]))]
    return cmd + list(engine_args) + cfg["extra_args"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    return JsonClient(f"http://127.0.0.1:{port}", timeout_s).answers("/health", timeout_s)


def launch(cmd: list[str], cfg: dict, log_path: Path, port: int, section: str,
           base_env: dict | None = None, bound: bool = False) -> subprocess.Popen:
    """Start `cmd` (its output appended to log_path) and wait until it answers /health.

    The environment is ours, then SERVER_ENV, then `base_env`, then the section's `env`. A program that
    cannot run names `{section}.executable`; a server that exits or is not healthy within
    `{section}.startup_timeout_s` was stopped, and the error quotes the log's last lines. A `bound` server
    ends with this process (process.start)."""
    env = {**os.environ, **SERVER_ENV, **(base_env or {}), **{str(k): str(v) for k, v in cfg["env"].items()}}
    log_start = log_path.stat().st_size if log_path.exists() else 0
    try:
        banner = f"\n=== eagle3build: starting {json.dumps(cmd)}\n"
        proc = process.start(cmd, log_path, env, banner, bound=bound)
    except OSError as e:
        raise ConfigError(
            f"{section}.executable",
            f"cannot run {cmd[0]!r} ({e}); install vLLM or run inside the image",
        ) from e
    timeout_s = cfg["startup_timeout_s"]
    try:
        process.wait_ready(proc, lambda: healthy(port, timeout_s=2.0), float(timeout_s), poll_s=0.5)
    except process.NotReady as e:
        reason = (f"exited with status {e.returncode}" if e.returncode is not None
                  else f"was not healthy after {section}.startup_timeout_s={timeout_s}")
        raise UserError(
            f"vLLM server {reason}; full log: {log_path}\n--- last lines ---\n"
            f"{process.log_tail(log_path, log_start)}"
        ) from None
    return proc
