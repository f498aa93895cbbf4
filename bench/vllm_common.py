"""What the real-engine benchmarks (bench/vllm_*.py) share: the extraction params they hand to the package,
the fake engines that stand in for vLLM on CPU, tiny targets for the smoke runs, and row statistics.

On a GPU machine the engine is `python -m vllm.entrypoints.cli.main` (a carried vLLM has no `vllm` script on
PATH); with `fake=True` it is tests/fake_vllm_server.py (extraction) or tests/fake_vllm_spec_server.py
(speculative serving), so every script runs end to end on CPU.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from eagle3build.config import default_aux_layer_ids  # noqa: E402

FAKE_EXTRACT = ROOT / "tests" / "fake_vllm_server.py"
FAKE_SPEC = ROOT / "tests" / "fake_vllm_spec_server.py"
VLLM_EXECUTABLE = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
TOLERANCES = (0.01, 0.02, 0.05)  # rows whose relative difference exceeds each


def engine_executable(fake_script: Path | None) -> list[str]:
    return [sys.executable, str(fake_script)] if fake_script else list(VLLM_EXECUTABLE)


def device_name() -> str:
    from results import cpu_device

    return torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_device()


def model_shape(model_dir: str | Path) -> tuple[int, int, int]:
    """(layers N, hidden size H, vocab size) of a HF target dir."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"])


def extract_params(model_dir: str | Path, storage: str = "bf16", concurrency: int = 8, *, fake: bool = False,
                   max_length: int = 8192, gpu_memory_utilization: float = 0.3,
                   extra_args: list[str] | None = None, env: dict | None = None,
                   connector_dir: str | None = None) -> dict:
    """Flat params of `eagle3build.extraction.vllm.extract_shard_vllm` for a local target dir: the default
    aux ids then N, storage dtype, and the extract.vllm section (the rest at the schema's defaults)."""
    n, hidden, _ = model_shape(model_dir)
    server_env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    if fake:
        server_env["FAKE_VLLM_HIDDEN_SIZE"] = str(hidden)
    return {
        "model": str(Path(model_dir).resolve()),
        "layer_ids": [*default_aux_layer_ids(n), n],
        "hidden_size": hidden,
        "storage_dtype": storage,
        "max_length": max_length,
        "vllm": {
            "executable": engine_executable(FAKE_EXTRACT if fake else None),
            "extra_args": list(extra_args or []),
            "env": server_env,
            "gpu_memory_utilization": gpu_memory_utilization,
            "concurrency": concurrency,
            "startup_timeout_s": 60 if fake else 900,
            "shared_storage_path": connector_dir,  # null: the run folder's (extract.vllm.shared_storage_path)
        },
    }


def tiny_llama(out: Path, seed: int = 0) -> Path:
    """A random-weight 8-layer Llama (H 32, vocab 128) for smoke runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def random_shards(folder: Path, vocab: int, lengths_per_shard: list[list[int]], seed: int = 1) -> list[Path]:
    """Token shards of random ids (every token in the loss) with the given sample lengths."""
    from eagle3build.shards import write_tokens

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    paths = []
    for s, lengths in enumerate(lengths_per_shard):
        ids = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
        path = folder / f"shard_{s:05d}.safetensors"
        write_tokens(path, ids, [torch.ones(n) for n in lengths], {"tokenizer": "synthetic"})
        paths.append(path)
    return paths


def wait_and_delete(path: str, limit_s: float = 30.0) -> int:
    """Wait for a connector file's write (its .lock released), delete it and its .lock (the connector never
    deletes the lock); returns the file's size."""
    deadline = time.time() + limit_s
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.001)
    if os.path.exists(path + ".lock"):
        with open(path + ".lock") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    Path(path).unlink(missing_ok=True)
    Path(path + ".lock").unlink(missing_ok=True)
    return size


def rel_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative difference of each row: ||a - b|| / ||b||."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)


def row_stats(d: torch.Tensor) -> dict:
    d = d.double()
    out = {"rows": int(d.numel()), "max": float(d.max()), "mean": float(d.mean()),
           "p99": float(d.quantile(0.99)) if d.numel() < 2**24 else None}
    for t in TOLERANCES:
        out[f"rows_over_{t}"] = int((d > t).sum())
    return out
