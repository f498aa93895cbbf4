"""Preflight checks of the target: trust policy, config, tokenizer, vocabulary sizes and aux layer ids.

Nothing here loads weights: the target is read through its config.json and its tokenizer (under the
configured trust policy).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3build.config import check_aux_layer_ids, deepseek_family, default_aux_layer_ids, vllm_serves_target
from eagle3build.doctor.context import Check, Context
from eagle3build.errors import ConfigError, UserError


def check_trust_policy(ctx: Context) -> Check:
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


def _read_config_dict(ctx: Context) -> dict:
    """config.json as a plain dict: no remote code runs to read it."""
    if ctx.is_local:
        path = Path(ctx.model) / "config.json"
        if not path.is_file():
            raise UserError(f"config key 'target.model': {ctx.model} has no config.json")
        return json.loads(path.read_text())
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(ctx.model, revision=ctx.revision)
    return config


def check_target_config(ctx: Context) -> Check:
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


def _tokenizer_auto_map(ctx: Context) -> dict:
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


def check_tokenizer(ctx: Context) -> Check:
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


def check_vocab(ctx: Context) -> Check:
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


def check_layers(ctx: Context) -> Check:
    name = "aux layer ids"
    if ctx.target_config is None:
        return Check(name, "skip", "no target config")
    n = int(ctx.target_config["num_hidden_layers"])
    vllm = vllm_serves_target({"extract": ctx.extract, "evaluate": ctx.section("evaluate")})
    family = deepseek_family(ctx.full_config or {}) if vllm else None
    try:  # the workflow's own rule, so the preflight and the DAG can never disagree
        ids = check_aux_layer_ids(ctx.extract["aux_layer_ids"], n, vllm, family)
    except ConfigError as e:
        default = default_aux_layer_ids(n)
        fix = (f"set extract.aux_layer_ids: null (default {default})" if not vllm or len(set(default)) == 3
               else f"set extract.aux_layer_ids to three distinct ids in [1, {n - 1}]")
        return Check(name, "fail", str(e), fix)
    checked = f"; distinct{', none 0 (' + family + ')' if family else ''}, as {vllm} needs" if vllm else ""
    return Check(name, "ok", f"aux {ids} + final {n} (layer ids stored: {[*ids, n]}){checked}")
