"""Preflight checks of the extraction engine: vLLM's hidden-states method and connector (inspected through
importlib and its public module names, never started), the target's architecture (what the connector
supports), the sequence length the engine must hold, and the cache it needs per token on each GPU
(`cache_plan`, which the GPU check weighs against the GPUs' memory).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import shutil
import typing

from eagle3build.config import section_defaults
from eagle3build.doctor.context import GB, Check, Context
from eagle3build.shards import NUM_SLOTS

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
EXTRACT_MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"
# Multi-head latent attention (DeepSeek-V2/V3 family, Kimi-K2/K2.5). The connector raises "MLA verifiers
# are unsupported" only when the KV cache has two or more groups; a pure-MLA target has one, like a dense
# model, and extracts (checked on a GPU with vLLM 0.25.0: a random DeepSeek-V3, MLA + MoE, against the
# HF forward of the same weights).
MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "kimi_vl"}
MLA_ARCH_PREFIXES = ("Deepseek", "KimiK2", "KimiK25", "KimiVL")
FIXED_ABORT = (0, 33)  # vLLM < 0.33 crashes when a queued extraction request is aborted
V3_ROUTED_MODEL_TYPES = {"deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25"}  # sigmoid-routed MoE


def _is_mla(ctx: Context) -> str | None:
    """Why the target counts as MLA (or None)."""
    full, text = ctx.full_config or {}, ctx.target_config or {}
    for cfg in (text, full):  # the latent's size is the clearest evidence
        if cfg.get("kv_lora_rank"):
            return f"kv_lora_rank {cfg['kv_lora_rank']}"
    for cfg in (full, text):
        if cfg.get("model_type") in MLA_MODEL_TYPES:
            return f"model_type {cfg['model_type']}"
    for arch in full.get("architectures") or []:
        if arch.startswith(MLA_ARCH_PREFIXES):
            return f"architecture {arch}"
    return None


def _attention_kinds(ctx: Context) -> list[str]:
    """The distinct per-layer attention kinds a hybrid target declares (config.json's layer_types)."""
    kinds = []
    for cfg in (ctx.target_config or {}, ctx.full_config or {}):
        for kind in cfg.get("layer_types") or []:
            if kind not in kinds:
                kinds.append(str(kind))
    return kinds


def _router_gaps(ctx: Context) -> list[str]:
    """Router keys a DeepSeek-V3-style MoE config must state for vLLM to compute the model HF computes.
    vLLM's DeepSeek MoE reads `scoring_func` with softmax as the default, while DeepSeek-V3 (and Kimi-K2)
    routes with sigmoid, which HF's code hard-wires; and it builds the router's e_score_correction_bias only
    for `topk_method: noaux_tc`. The real models' config.json states both; a config written by
    transformers (a small stand-in) states neither: measured on vLLM 0.25.0, the states then differ from
    the HF forward by 2-3% on average."""
    text, full = ctx.target_config or {}, ctx.full_config or {}
    kinds = {text.get("model_type"), full.get("model_type")}
    if not kinds & V3_ROUTED_MODEL_TYPES or not text.get("n_routed_experts"):
        return []
    want = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    return [f"{key}: {value}" for key, value in want.items() if text.get(key, full.get(key)) is None]


def check_architecture(ctx: Context) -> Check:
    name = "architecture"
    if ctx.full_config is None:
        return Check(name, "skip", "no target config")
    mla = _is_mla(ctx)
    if ctx.backend != "vllm":
        return Check(name, "ok", "HF backend: any AutoModelForCausalLM target" + (f" ({mla})" if mla else ""))
    kinds = _attention_kinds(ctx)
    gaps = _router_gaps(ctx)
    if gaps:
        return Check(
            name,
            "warn",
            f"the MoE router of '{ctx.model}' does not state {' and '.join(gaps)}: vLLM then routes with "
            "softmax weights (its default) and no score-correction bias, unlike the model (and the HF "
            "backend); measured on vLLM 0.25.0, the stored states differ by 2-3% on average",
            f"add {', '.join(gaps)} to the target's config.json (DeepSeek-V3's and Kimi-K2's own configs have them)",
        )
    if len(kinds) > 1:
        return Check(
            name,
            "warn",
            f"hybrid attention (layer_types {', '.join(kinds)}): the KV cache forms two or more groups, which "
            "vLLM's ExampleHiddenStatesConnector refuses at start in the versions checked (0.25/0.26)",
            "try it on a small run first (`vllm serve` starts or names the problem), or set extract.backend: hf",
        )
    if mla:
        return Check(
            name,
            "ok",
            f"MLA target ({mla}): one KV-cache group, supported by extract_hidden_states since vLLM 0.25 "
            "(the connector refuses only two or more groups); verified on a random DeepSeek-V3 (MLA + MoE) "
            "against the HF forward",
        )
    return Check(name, "ok", "one KV-cache group: supported by vLLM's hidden-states connector")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2]) or (0,)


def cache_plan(ctx: Context) -> tuple[int, int, int] | None:
    """Bytes per token on each GPU of vLLM's KV cache and of the connector's hidden-state cache, and the
    tokens one sequence needs (max_model_len); None without a target config. The hidden-state cache holds
    n_ids x H values per token in the model dtype and is NOT split across tensor-parallel GPUs: every GPU
    holds all of it next to its share of the KV cache. MLA caches one latent (kv_lora_rank + rope dims) per
    layer, whole on every GPU; other attention caches K and V of num_key_value_heads / TP heads."""
    text = ctx.target_config
    if text is None:
        return None
    tp = int(ctx.vllm["tensor_parallel_size"])
    dtype_bytes = 4 if str(text.get("torch_dtype") or text.get("dtype")) == "float32" else 2
    layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    if text.get("kv_lora_rank"):
        kv = (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 64)) * layers * dtype_bytes
    else:
        heads = int(text.get("num_attention_heads") or 1)
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        kv = 2 * -(-kv_heads // tp) * head_dim * layers * dtype_bytes
    tokens = int(ctx.vllm.get("max_model_len") or ctx.max_length + 1)
    return kv, NUM_SLOTS * hidden * dtype_bytes, tokens


def describe_cache_plan(ctx: Context) -> str:
    kv, states, tokens = cache_plan(ctx)
    return (f"per token on each GPU: KV cache {kv / 1e3:.1f} kB + hidden-state cache {states / 1e3:.1f} kB "
            f"({NUM_SLOTS} layer ids x H x dtype, on every GPU: not split by tensor parallel); one "
            f"{tokens}-token sequence needs {(kv + states) * tokens / GB:.2f} GB per GPU")


def _literal_values(tp) -> set:
    out = set()
    for arg in typing.get_args(tp):
        out |= _literal_values(arg) if typing.get_args(arg) else {arg}
    return out


def check_vllm(ctx: Context) -> Check:
    name = "vLLM"
    users = [s for s in ("extract", "evaluate") if ctx.section(s).get("backend") == "vllm"]
    if not users:
        return Check(name, "skip", "extract.backend and evaluate.backend are hf: vLLM is not needed")
    extracting = "extract" in users  # the hidden-states method and connector are extraction's needs
    fix_install = (
        "run inside the image (`make docker-run`), or install a vLLM that has the extract_hidden_states "
        "method and the ExampleHiddenStatesConnector (0.25 or later), or set "
        + " and ".join(f"{s}.backend: hf" for s in users)
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
    if missing and extracting:
        return Check(name, "fail", f"vLLM {version} lacks {' and '.join(missing)}", fix_install)
    note = ""
    if extracting and version != "?" and _version(version) < FIXED_ABORT:
        note = ("; it crashes when a queued request is aborted (fixed in 0.33): extraction never aborts one "
                "(a relay keeps every request open until vLLM answers)")
    for stage in users:  # each stage starts `vllm serve` with its own executable setting
        exe = ctx.section(stage)["vllm"].get("executable") or section_defaults(f"{stage}.vllm")["executable"]
        exe = [exe] if isinstance(exe, str) else list(exe)
        if not shutil.which(exe[0]):
            return Check(
                name,
                "fail",
                f"vLLM {version} is importable but {stage}.vllm.executable {exe[0]!r} is not on PATH",
                f"set {stage}.vllm.executable (e.g. ['python', '-m', 'vllm.entrypoints.cli.main'])",
            )
    found = "extract_hidden_states + ExampleHiddenStatesConnector" if extracting else "serves the draft"
    return Check(name, "ok", f"vLLM {version}: {found}{note} (for {', '.join(b + '.backend' for b in users)})")


def check_max_len(ctx: Context) -> Check:
    name = "sequence length"
    max_length = ctx.max_length
    parts = [f"prepare.max_length {max_length}"]
    if ctx.backend == "vllm" and not ctx.vllm.get("max_model_len"):
        parts.append(f"vLLM serves --max-model-len {max_length + 1} (prepare.max_length + 1, "
                     "not the target's own limit)")
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
    if ctx.backend == "vllm" and ctx.target_config is not None:
        parts.append(describe_cache_plan(ctx))
    positions = (ctx.target_config or {}).get("max_position_embeddings")
    if positions and positions < max_length:
        return Check(
            name,
            "warn",
            f"prepare.max_length {max_length} exceeds the target's max_position_embeddings {positions}",
            "lower prepare.max_length",
        )
    return Check(name, "ok", ", ".join(parts))
