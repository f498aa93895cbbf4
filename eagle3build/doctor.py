"""Preflight: fail in seconds, with the fix, before a run that would fail after hours.

`python -m eagle3build.doctor --config config.yaml [--stage extract]` prints every check and its
result; the extraction code calls `preflight(config, "extract")`, which raises a UserError listing
every failure. Nothing here starts an engine or loads weights: vLLM is inspected through importlib
and its public module names, the target through its config.json and tokenizer.

Checks: trust policy (remote code needs a pinned revision), target config, tokenizer (under the
configured trust policy), vocab sizes (tokenizer ids and the draft vocab must fit the target vocab),
aux layer ids, vLLM (extract_hidden_states + ExampleHiddenStatesConnector), architecture (MLA targets
are unsupported by the connector), max_model_len, GPUs and GPU memory, the training attention kernel
(train.attention flash/cudnn), free disk.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3build.config import check_aux_layer_ids, default_aux_layer_ids
from eagle3build.errors import ConfigError, UserError
from eagle3build.extraction.job import pending_token_shards
from eagle3build.extraction.vllm import DEFAULTS as VLLM_DEFAULTS
from eagle3build.shards import hidden_bytes_per_token, read_meta

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
EXTRACT_MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"
# Multi-head latent attention (DeepSeek-V2/V3 family, Kimi-K2/K2.5): the hidden-states connector
# cannot isolate its cache group ("MLA verifiers are unsupported").
MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "kimi_vl"}
MLA_ARCH_PREFIXES = ("Deepseek", "KimiK2", "KimiK25", "KimiVL")
STAGES = ("all", "tokens", "extract", "train")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
GB = 1e9


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "skip" | "fail"
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        line = f"[{self.status:^4}] {self.name}: {self.detail}"
        return line + (f"\n       fix: {self.fix}" if self.fix else "")


@dataclass
class _Context:
    """The config plus what earlier checks loaded (target config, tokenizer) for later ones."""

    config: dict
    target_config: dict | None = None  # the text model's config.json
    full_config: dict | None = None
    tokenizer: object | None = None
    notes: dict = field(default_factory=dict)

    @property
    def target(self) -> dict:
        return self.config.get("target") or {}

    @property
    def extract(self) -> dict:
        return self.config.get("extract") or {}

    @property
    def vllm(self) -> dict:
        return {**VLLM_DEFAULTS, **(self.extract.get("vllm") or {})}

    @property
    def backend(self) -> str:
        return self.extract.get("backend", "hf")

    @property
    def model(self) -> str:
        return str(self.target.get("model", ""))

    @property
    def is_local(self) -> bool:
        return Path(self.model).exists()

    @property
    def trust(self) -> bool:
        return self.target.get("trust_remote_code") is True

    @property
    def revision(self) -> str | None:
        return self.target.get("revision")

    @property
    def remote_code_unpinned(self) -> bool:
        return self.trust and not self.is_local and not _COMMIT.match(str(self.revision or ""))


# ---------------------------------------------------------------- checks
def check_trust_policy(ctx: _Context) -> Check:
    name = "trust policy"
    if not ctx.trust:
        return Check(name, "ok", "remote code is not allowed (target.trust_remote_code: false)")
    if ctx.is_local:
        return Check(name, "ok", f"remote code allowed from the local folder {ctx.model} (review its *.py)")
    if ctx.remote_code_unpinned:
        return Check(
            name,
            "fail",
            f"target.trust_remote_code is true for the hub model '{ctx.model}' but target.revision is "
            f"{ctx.revision!r}, not a commit: the code that runs could change under you",
            "set target.revision to the 40-character commit sha of the model repo (its 'Files' history)",
        )
    return Check(name, "ok", f"remote code allowed from '{ctx.model}' pinned at {ctx.revision}")


def _read_config_dict(ctx: _Context) -> dict:
    """config.json as a plain dict: no remote code runs to read it."""
    if ctx.is_local:
        path = Path(ctx.model) / "config.json"
        if not path.is_file():
            raise UserError(f"config key 'target.model': {ctx.model} has no config.json")
        return json.loads(path.read_text())
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(ctx.model, revision=ctx.revision)
    return config


def check_target_config(ctx: _Context) -> Check:
    name = "target config"
    try:
        full = _read_config_dict(ctx)
    except Exception as e:
        return Check(
            name,
            "fail",
            f"cannot read the config of target.model '{ctx.model}' ({e})",
            "give a local model folder with a config.json, or a hub id reachable from here "
            "(HF_TOKEN for gated models)",
        )
    text = full.get("text_config") or full
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        return Check(
            name,
            "fail",
            f"{ctx.model}: config.json lacks {', '.join(missing)}",
            "point target.model at a causal LM (for multimodal models the text_config must have them)",
        )
    ctx.full_config, ctx.target_config = full, text
    archs = ",".join(full.get("architectures") or []) or "?"
    return Check(
        name,
        "ok",
        f"{archs} (model_type {full.get('model_type')}): {text['num_hidden_layers']} layers, "
        f"hidden {text['hidden_size']}, vocab {text['vocab_size']}",
    )


def _tokenizer_auto_map(ctx: _Context) -> dict:
    if ctx.is_local:
        path = Path(ctx.model) / "tokenizer_config.json"
    else:
        from transformers.utils import cached_file

        found = cached_file(
            ctx.model,
            "tokenizer_config.json",
            revision=ctx.revision,
            _raise_exceptions_for_missing_entries=False,
        )
        path = Path(found) if found else None
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text()).get("auto_map") or {}


def check_tokenizer(ctx: _Context) -> Check:
    name = "tokenizer"
    if ctx.remote_code_unpinned:
        return Check(
            name, "skip", "not loaded: remote code from an unpinned revision is never run (see trust policy)"
        )
    try:
        auto_map = _tokenizer_auto_map(ctx)
    except Exception as e:
        return Check(
            name,
            "fail",
            f"cannot read tokenizer_config.json of '{ctx.model}' ({e})",
            "check target.model / target.revision",
        )
    needs_code = "AutoTokenizer" in auto_map
    if needs_code and not ctx.trust:
        classes = [
            c
            for c in (
                auto_map["AutoTokenizer"]
                if isinstance(auto_map["AutoTokenizer"], list)
                else [auto_map["AutoTokenizer"]]
            )
            if c
        ]
        return Check(
            name,
            "fail",
            f"the tokenizer of '{ctx.model}' is custom code ({', '.join(classes)}) that loads only with "
            f"remote code, and target.trust_remote_code is false",
            "review the repo's tokenizer code, then set target.trust_remote_code: true "
            "(with target.revision pinned to a commit for hub models)",
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(ctx.model, revision=ctx.revision, trust_remote_code=ctx.trust)
    except Exception as e:
        return Check(
            name,
            "fail",
            f"AutoTokenizer cannot load '{ctx.model}' ({type(e).__name__}: {e})",
            "check target.model, target.revision and target.trust_remote_code",
        )
    ctx.tokenizer = tok
    origin = " (remote code)" if needs_code else ""
    return Check(name, "ok", f"{type(tok).__name__}{origin}, {len(tok)} tokens")


def check_vocab(ctx: _Context) -> Check:
    name = "vocab sizes"
    if ctx.target_config is None:
        return Check(name, "skip", "no target config")
    vocab = int(ctx.target_config["vocab_size"])
    problems, fixes, parts = [], [], [f"target vocab_size {vocab}"]
    if ctx.tokenizer is not None:
        tok = ctx.tokenizer
        top = max(len(tok), max(tok.get_vocab().values(), default=-1) + 1)
        parts.append(f"tokenizer ids < {top}")
        if top > vocab:  # len(tokenizer) < vocab_size is normal (padded embeddings); larger is not
            problems.append(
                f"the tokenizer produces ids up to {top - 1}, beyond the target's vocab_size {vocab}"
            )
            fixes.append("use the tokenizer that belongs to target.model")
    draft = (ctx.config.get("vocab") or {}).get("draft_vocab_size")
    if draft is not None:
        parts.append(f"draft vocab {draft}")
        if draft > vocab:
            problems.append(f"vocab.draft_vocab_size {draft} exceeds the target vocab_size {vocab}")
            fixes.append(f"set vocab.draft_vocab_size below {vocab}")
        elif draft == vocab:
            problems.append(
                f"vocab.draft_vocab_size equals the target vocab_size {vocab}: vLLM >= 0.33 rejects "
                f"a d2t mapping of full size"
            )
            fixes.append(f"set vocab.draft_vocab_size below {vocab} (32000 is the usual choice)")
    if problems:
        return Check(name, "fail", "; ".join(problems), "; ".join(fixes))
    return Check(name, "ok", ", ".join(parts))


def _aux_layer_ids(ctx: _Context) -> list[int] | None:
    if ctx.target_config is None:
        return None
    n = int(ctx.target_config["num_hidden_layers"])
    return ctx.extract.get("aux_layer_ids") or default_aux_layer_ids(n)


def check_layers(ctx: _Context) -> Check:
    name = "aux layer ids"
    if ctx.target_config is None:
        return Check(name, "skip", "no target config")
    n = int(ctx.target_config["num_hidden_layers"])
    try:  # the workflow's own rule, so the preflight and the DAG can never disagree
        ids = check_aux_layer_ids(ctx.extract.get("aux_layer_ids"), n)
    except ConfigError as e:
        return Check(name, "fail", str(e), f"set extract.aux_layer_ids: null (default {default_aux_layer_ids(n)})")
    return Check(name, "ok", f"aux {ids} + final {n} (layer ids stored: {[*ids, n]})")


def _is_mla(ctx: _Context) -> str | None:
    """Why the target counts as MLA (or None)."""
    full, text = ctx.full_config or {}, ctx.target_config or {}
    for cfg in (full, text):
        if cfg.get("model_type") in MLA_MODEL_TYPES:
            return f"model_type {cfg['model_type']}"
        if cfg.get("kv_lora_rank"):
            return f"kv_lora_rank {cfg['kv_lora_rank']} (latent attention)"
    for arch in full.get("architectures") or []:
        if arch.startswith(MLA_ARCH_PREFIXES):
            return f"architecture {arch}"
    return None


def check_architecture(ctx: _Context) -> Check:
    name = "architecture"
    if ctx.full_config is None:
        return Check(name, "skip", "no target config")
    mla = _is_mla(ctx)
    if ctx.backend != "vllm":
        return Check(name, "ok", "HF backend: any AutoModelForCausalLM target" + (f" ({mla})" if mla else ""))
    if mla and not ctx.vllm.get("allow_mla"):
        return Check(
            name,
            "fail",
            f"'{ctx.model}' uses multi-head latent attention ({mla}); vLLM's ExampleHiddenStatesConnector "
            f"does not support MLA targets ('MLA verifiers are unsupported') in the pinned vLLM",
            "set extract.backend: hf (the HF backend, slower but architecture-agnostic), or use a vLLM "
            "version whose connector supports MLA, verify it on a small run, and set extract.vllm.allow_mla: true",
        )
    return Check(
        name,
        "ok",
        "supported by the vLLM connector" + (f" ({mla}: allowed by extract.vllm.allow_mla)" if mla else ""),
    )


def _literal_values(tp) -> set:
    out = set()
    for arg in typing.get_args(tp):
        out |= _literal_values(arg) if typing.get_args(arg) else {arg}
    return out


def check_vllm(ctx: _Context) -> Check:
    name = "vLLM"
    if ctx.backend != "vllm":
        return Check(name, "skip", "extract.backend is hf: vLLM is not needed")
    fix_install = (
        "run inside the image (`make docker-run`), or install a vLLM that has the extract_hidden_states "
        "method and the ExampleHiddenStatesConnector (0.25 or later), or set extract.backend: hf"
    )
    if importlib.util.find_spec("vllm") is None:
        return Check(name, "fail", "vLLM is not installed in this Python", fix_install)
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    missing = []
    try:
        connector = importlib.import_module(CONNECTOR_MODULE)
        if not hasattr(connector, "ExampleHiddenStatesConnector"):
            missing.append("the ExampleHiddenStatesConnector KV connector")
    except ImportError:
        missing.append("the ExampleHiddenStatesConnector KV connector")
    method = False
    try:
        method = importlib.util.find_spec(EXTRACT_MODEL_MODULE) is not None
    except ImportError:
        pass
    if not method:
        try:
            spec_cfg = importlib.import_module("vllm.config.speculative")
            method = "extract_hidden_states" in _literal_values(spec_cfg.SpeculativeMethod)
        except (ImportError, AttributeError):
            pass
    if not method:
        missing.append("the extract_hidden_states speculative method")
    if missing:
        return Check(name, "fail", f"vLLM {version} lacks {' and '.join(missing)}", fix_install)
    exe = ctx.vllm["executable"]
    exe = [exe] if isinstance(exe, str) else list(exe)
    if not shutil.which(exe[0]):
        return Check(
            name,
            "fail",
            f"vLLM {version} is importable but extract.vllm.executable {exe[0]!r} is not on PATH",
            "set extract.vllm.executable (e.g. ['python', '-m', 'vllm.entrypoints.cli.main'])",
        )
    return Check(name, "ok", f"vLLM {version}: extract_hidden_states + ExampleHiddenStatesConnector")


def check_max_len(ctx: _Context) -> Check:
    name = "sequence length"
    max_length = int((ctx.config.get("prepare") or {}).get("max_length", 2048))
    parts = [f"prepare.max_length {max_length}"]
    if ctx.backend == "vllm" and ctx.vllm.get("max_model_len"):
        mml = int(ctx.vllm["max_model_len"])
        parts.append(f"extract.vllm.max_model_len {mml}")
        if mml < max_length + 1:  # the prompt plus the one generated token
            return Check(
                name,
                "fail",
                f"extract.vllm.max_model_len {mml} cannot hold a {max_length}-token sample "
                "plus the generated token",
                f"set extract.vllm.max_model_len >= {max_length + 1} or lower prepare.max_length",
            )
    positions = (ctx.target_config or {}).get("max_position_embeddings")
    if positions and positions < max_length:
        return Check(
            name,
            "warn",
            f"prepare.max_length {max_length} exceeds the target's max_position_embeddings {positions}",
            "lower prepare.max_length",
        )
    return Check(name, "ok", ", ".join(parts))


def _weights_bytes(ctx: _Context) -> int | None:
    if not ctx.is_local:
        return None
    files = list(Path(ctx.model).glob("*.safetensors")) or list(Path(ctx.model).glob("*.bin"))
    return sum(f.stat().st_size for f in files) or None


def check_gpus(ctx: _Context, stage: str) -> Check:
    name = "GPUs"
    import torch

    if not torch.cuda.is_available():
        return Check(name, "skip", "no CUDA device visible: GPU checks skipped (this run uses the CPU)")
    count = torch.cuda.device_count()
    mems = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
    parts = [f"{count} visible, smallest {min(mems) / GB:.0f} GB"]
    if stage in ("all", "extract") and ctx.backend == "vllm":
        tp, dp = int(ctx.vllm["tensor_parallel_size"]), int(ctx.vllm["data_parallel_size"])
        if tp * dp > count:
            return Check(
                name,
                "fail",
                f"extract.vllm tensor_parallel_size {tp} x data_parallel_size {dp} needs "
                f"{tp * dp} GPUs, {count} visible",
                "lower the parallel sizes or expose more GPUs (CUDA_VISIBLE_DEVICES, --gpus)",
            )
        weights = _weights_bytes(ctx)
        usable = min(mems) * float(ctx.vllm["gpu_memory_utilization"])
        if weights:
            per_gpu = weights / tp
            parts.append(f"weights {weights / GB:.1f} GB = {per_gpu / GB:.1f} GB per GPU at TP {tp}")
            if per_gpu > 0.9 * usable:  # leave room for activations and the KV / hidden-state cache
                return Check(
                    name,
                    "fail",
                    f"{per_gpu / GB:.1f} GB of weights per GPU leaves no room in "
                    f"{usable / GB:.1f} GB usable ({'; '.join(parts)})",
                    "raise extract.vllm.tensor_parallel_size or gpu_memory_utilization",
                )
    if stage in ("all", "train"):
        want = int((ctx.config.get("train") or {}).get("gpus", 1) or 0)
        if want > count:
            return Check(
                name, "fail", f"train.gpus {want} but {count} GPUs are visible", f"set train.gpus <= {count}"
            )
    return Check(name, "ok", "; ".join(parts))


def check_attention(ctx: _Context) -> Check:
    """train.attention flash/cudnn: torch's private kernel ops, run once on a tiny problem against fp32
    math on this machine's GPU (check_kernel, about a second; training runs it again before loading)."""
    name = "attention"
    import torch

    from eagle3build.attention.kernel import KERNELS, check_kernel

    impl = (ctx.config.get("train") or {}).get("attention", "auto")
    if impl not in KERNELS:
        return Check(name, "ok", f"train.attention {impl}: nothing to check")
    if not torch.cuda.is_available():
        return Check(name, "skip", f"train.attention {impl}: no CUDA device visible, checked where training runs")
    try:
        errors = check_kernel(impl, "cuda")
    except RuntimeError as e:
        return Check(name, "fail", str(e), "set train.attention: flex (the default on GPUs)")
    worst = max(errors, key=errors.get)
    return Check(name, "ok", f"train.attention {impl} agrees with fp32 math (worst: {worst} {errors[worst]:.1e})")


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(ctx: _Context) -> Check:
    name = "disk"
    if ctx.target_config is None:
        return Check(name, "skip", "no target config")
    storage = ctx.extract.get("storage_dtype", "bf16")
    per_token = hidden_bytes_per_token(int(ctx.target_config["hidden_size"]), storage)
    per_million = f"{per_token * 1e6 / GB:.1f} GB per million tokens ({storage})"
    root = Path(ctx.config.get("output_root", "build"))
    pending = pending_token_shards(str(root))
    remaining = sum(int(read_meta(tokens).get("num_tokens", 0)) for tokens in pending)
    shards = len(pending)
    free = shutil.disk_usage(_existing_parent(root)).free
    reserve = float(ctx.extract.get("disk_reserve_gb", 1.0)) * GB
    problems = []
    if shards:
        need = remaining * per_token
        detail = (
            f"{shards} shards / {remaining:,} tokens left to extract need {need / GB:.1f} GB "
            f"({per_million}); {free / GB:.1f} GB free under {root}"
        )
        if need + reserve > free:
            problems.append(detail)
    else:
        built = "every token shard is extracted" if any((root / "tokens").glob("*/*.safetensors")) else (
            "no token shards yet for an exact figure"
        )
        detail = f"{per_million}; {free / GB:.1f} GB free under {root} ({built})"
    if ctx.backend == "vllm":
        # The connector's files of the requests in flight, each [T, 4, H] bf16.
        staging = Path(ctx.vllm.get("shared_storage_path") or root)
        max_length = int((ctx.config.get("prepare") or {}).get("max_length", 2048))
        burst = int(ctx.vllm["concurrency"]) * max_length * 4 * int(ctx.target_config["hidden_size"]) * 2
        staging_free = shutil.disk_usage(_existing_parent(staging)).free
        detail += (
            f"; connector staging up to {burst / GB:.2f} GB in {staging} ({staging_free / GB:.1f} GB free)"
        )
        if burst > staging_free:
            problems.append(
                f"extract.vllm.shared_storage_path {staging} has {staging_free / GB:.2f} GB free, "
                f"in-flight files need up to {burst / GB:.2f} GB"
            )
    if problems:
        return Check(
            name,
            "fail",
            "; ".join(problems),
            "free space, move output_root / extract.vllm.shared_storage_path, or use "
            "extract.storage_dtype: fp8 (about half the bytes)",
        )
    return Check(name, "ok", detail)


# ---------------------------------------------------------------- driver
_CHECKS: list[tuple[str, Callable[[_Context, str], Check], set[str]]] = [
    ("trust", lambda c, s: check_trust_policy(c), {"all", "tokens", "extract", "train"}),
    ("config", lambda c, s: check_target_config(c), {"all", "tokens", "extract", "train"}),
    ("tokenizer", lambda c, s: check_tokenizer(c), {"all", "tokens", "extract"}),
    ("vocab", lambda c, s: check_vocab(c), {"all", "tokens", "extract", "train"}),
    ("layers", lambda c, s: check_layers(c), {"all", "extract", "train"}),
    ("vllm", lambda c, s: check_vllm(c), {"all", "extract"}),
    ("architecture", lambda c, s: check_architecture(c), {"all", "extract"}),
    ("length", lambda c, s: check_max_len(c), {"all", "extract"}),
    ("gpus", check_gpus, {"all", "extract", "train"}),
    ("attention", lambda c, s: check_attention(c), {"all", "train"}),
    ("disk", lambda c, s: check_disk(c), {"all", "extract"}),
]


def preflight(config: dict, stage: str = "all", echo: Callable[[Check], None] | None = None) -> list[Check]:
    """Run the checks a stage needs; raise UserError listing the failures. `echo` sees each result."""
    if stage not in STAGES:
        raise UserError(f"unknown preflight stage '{stage}'; one of {', '.join(STAGES)}")
    ctx = _Context(config)
    checks = []
    for key, run, stages in _CHECKS:
        if stage in stages:
            try:
                check = run(ctx, stage)
            except Exception as e:  # a check must never hide the others
                check = Check(key, "fail", f"{type(e).__name__}: {e}")
            checks.append(check)
            if echo:
                echo(check)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        lines = "\n".join(
            f"  - {c.name}: {c.detail}" + (f"\n    fix: {c.fix}" if c.fix else "") for c in failed
        )
        raise UserError(f"preflight found {len(failed)} problem(s) before the '{stage}' stage:\n{lines}")
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3build.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="config.yaml", help="the workflow config (default config.yaml)")
    parser.add_argument("--stage", default="all", choices=STAGES, help="check only what this stage needs")
    args = parser.parse_args(argv)
    try:
        from eagle3build.config import load_config

        config = load_config(args.config)
        print(f"eagle3build doctor: {args.config}, stage {args.stage}")
        preflight(config, args.stage, echo=print)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
