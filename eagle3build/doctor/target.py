"""Preflight checks of the target: trust policy, config, tokenizer, vocabulary sizes and aux layer ids.

Nothing here loads weights: the target is read through its config.json and its tokenizer (under the
configured trust policy).
"""

from __future__ import annotations

from eagle3build.config import (
    check_aux_layer_ids,
    deepseek_family,
    default_aux_layer_ids,
    read_model_config,
    vllm_serves_target,
)
from eagle3build.doctor.context import Check, Context
from eagle3build.errors import ConfigError, UserError
from eagle3build.trust import check_trust, remote_code_classes

# The fix for each key the trust policy can name.
_TRUST_FIXES = {
    "target.revision": "set target.revision to the 40-character commit sha of the model repo (its 'Files' "
                       "history) whose code you reviewed",
    "target.trust_remote_code": "review the repo's code, then set target.trust_remote_code: true "
                                "(with target.revision pinned to a commit for hub models)",
}


def _trust_refusal(ctx: Context) -> UserError | None:
    """Why the trust policy refuses the target (`eagle3build.trust.check_trust`), or None."""
    try:
        check_trust(ctx.target)
    except UserError as e:
        return e
    return None


def check_trust_policy(ctx: Context) -> Check:
    name = "trust policy"
    refused = _trust_refusal(ctx)
    if refused is not None:
        fix = _TRUST_FIXES.get(getattr(refused, "key", ""), "check target.model")
        return Check(name, "fail", str(refused), fix)
    if not ctx.trust:
        return Check(name, "ok", "remote code is not allowed (target.trust_remote_code: false)")
    if ctx.is_local:
        return Check(name, "ok", f"remote code allowed from the local folder {ctx.model} (review its *.py)")
    return Check(name, "ok", f"remote code allowed from '{ctx.model}' pinned at {ctx.revision}")


def check_target_config(ctx: Context) -> Check:
    name = "target config"
    try:
        full = read_model_config(ctx.model, ctx.revision)
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


def check_tokenizer(ctx: Context) -> Check:
    name = "tokenizer"
    if _trust_refusal(ctx) is not None:
        return Check(name, "skip", "not loaded: the trust policy refuses the target's code (see trust policy)")
    try:
        classes = remote_code_classes(ctx.model, ctx.revision)
        needs_code = ctx.trust and any(" AutoTokenizer -> " in c for c in classes)
    except UserError as e:
        return Check(name, "fail", f"cannot read tokenizer_config.json of '{ctx.model}' ({e})",
                     "check target.model / target.revision")
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
    vllm = vllm_serves_target({"extract": ctx.extract})
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
