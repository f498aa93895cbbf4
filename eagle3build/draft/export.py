"""Export the trained draft as the EAGLE-3 checkpoint vLLM and SGLang load (and optionally speculators').

`out_dir/eagle3/` holds config.json (LlamaForCausalLMEagle3) and model.safetensors with exactly the names
the engines know: fc, midlayer.*, norm, lm_head, d2t (omitted when K == V: vLLM >= 0.33 rejects it),
t2d. embed_tokens is NOT exported by default: it is the target's frozen embedding, which vLLM and
SGLang share from the target when the checkpoint lacks it, so writing it would only add V*H values
(1 GB for Llama-3.1-8B). `include_embed_tokens: true` writes it anyway.

The aux layer ids are written once per engine, each in that engine's convention. Ours (and vLLM's) id L
is the residual stream entering layer L (HF's output_hidden_states[L]):
- vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` and uses the ids as they are;
- SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` (absent: its default (2, N//2, N-3))
  and adds 1 to each ("takes the output of the (i-1)th layer"), so that key holds L - 1.
The head variants (DraftConfig.norm_before_residual, norm_before_fc, fc_norm, norm_output) are written as
the top-level config keys of those names, which vLLM (0.25.0: models/llama_eagle3.py, and its speculators
config reader) reads; their weights are `input_norm.weight` [3*Ht] and `fc_norm.{0,1,2}.weight` [Ht],
the names vLLM loads (its loader skips `input_norm.*` unless norm_before_fc is set). SGLang's EAGLE-3
head ignores these keys: serve a variant with vLLM.
The target is recorded as the user configured it (a hub id, or the path as written, relative or not):
never this machine's absolute path, which means nothing where the checkpoint is served.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3build import FORMAT_VERSIONS
from eagle3build.atomic import atomic_path, save_safetensors_atomic, write_json_atomic
from eagle3build.config import resolve_section
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.draft.target import load_target_head, read_target_config, rope_theta_of
from eagle3build.draft.vocab import read_mapping
from eagle3build.errors import UserError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHT_NAMES = (
    "fc.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
)
HEAD_VARIANTS = DraftConfig.VARIANTS


def weight_names(c: DraftConfig) -> tuple[str, ...]:
    """The trained tensors an export of head `c` holds: the plain names, plus its variant's norms."""
    extra = ("input_norm.weight",) if c.norm_before_fc else ()
    extra += tuple(f"fc_norm.{i}.weight" for i in range(3)) if c.fc_norm else ()
    return WEIGHT_NAMES + extra


def eagle3_config(c: DraftConfig, target_path: str | None = None) -> dict:
    """config.json of the EAGLE-3 format (see docs/eagle3-facts); `target_path`: the target as configured."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,  # what the draft was trained with (plain RoPE, no scaling)
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),  # vLLM: as they are
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layer_ids]},  # SGLang: +1
        **{key: getattr(c, key) for key in HEAD_VARIANTS},  # vLLM: top-level, false when absent
        "torch_dtype": "bfloat16",
        # ours (engines ignore unknown config keys; they refuse unknown tensor names only)
        "eagle3build": {
            "draft_config": c.to_dict(),
            "target": target_path,
            "format_version": FORMAT_VERSIONS["export"],
        },
    }
    return config


def speculators_config(c: DraftConfig, target_path: str, target_config: dict) -> dict:
    """speculators' eagle3 format; the variant keys are written because vLLM defaults norm_before_residual
    to true there."""
    layer = {
        k: v
        for k, v in eagle3_config(c).items()
        if k
        not in (
            "architectures",
            "draft_vocab_size",
            "target_hidden_size",
            "eagle_aux_hidden_state_layer_ids",
            "eagle_config",
            "eagle3build",
            *HEAD_VARIANTS,
            "torch_dtype",
        )
    }
    layer["architectures"] = ["LlamaForCausalLM"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        **{key: getattr(c, key) for key in HEAD_VARIANTS},
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {
                "name_or_path": target_path,
                "architectures": target_config.get("architectures", ["LlamaForCausalLM"]),
            },
        },
        "torch_dtype": "bfloat16",
    }


def _read_weights(weights_path: str) -> tuple[dict[str, torch.Tensor], DraftConfig]:
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise UserError(f"{weights_path}: unreadable draft weights ({e}); rerun the train stage") from e
    if "draft_config" not in meta:
        raise UserError(
            f"{weights_path}: no 'draft_config' metadata; not written by eagle3build's train stage"
        )
    return tensors, DraftConfig.from_dict(json.loads(meta["draft_config"]))


def _check_finite(weights_path: str, tensors: dict[str, torch.Tensor], cast: str = "") -> None:
    """Refuse NaN/inf weights: an engine would load them and accept no draft token (or crash)."""
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if not bad:
        return
    if cast:
        raise UserError(f"{weights_path}: {bad} overflow {cast} (values beyond its range become inf); "
                        "export in bfloat16 or float32 (config key 'export.dtype')")
    raise UserError(f"{weights_path}: tensors {bad} hold NaN/inf values (the training diverged or read "
                    f"corrupted hidden states); delete {Path(weights_path).parent} (its checkpoints hold them "
                    "too) and rerun: training stops at the first non-finite step and names its cause")


def export(
    weights_path: str, mapping_path: str, target_path: str, out_dir: str, params: dict | None = None
) -> None:
    """Write out_dir/eagle3/{config.json, model.safetensors} (+ out_dir/speculators/ if asked).

    `target_path`: the target as the user configured it (target.model), recorded as given.
    `params`: the `export` config section (unset keys take the schema's defaults)."""
    p = resolve_section("export", params)
    dtype = _DTYPES[p["dtype"]]
    tensors, c = _read_weights(weights_path)
    d2t, t2d = read_mapping(mapping_path)
    if not (torch.equal(d2t, tensors["d2t"]) and torch.equal(t2d, tensors["t2d"])):
        raise UserError(
            f"{mapping_path}: differs from the mapping {weights_path} was trained with; rerun train"
        )
    target_config = read_target_config(target_path)
    if (
        int(target_config["vocab_size"]) != c.vocab_size
        or int(target_config["hidden_size"]) != c.target_hidden_size
    ):
        raise UserError(
            f"{target_path}: vocab/hidden size {target_config['vocab_size']}/{target_config['hidden_size']} "
            f"!= the draft's {c.vocab_size}/{c.target_hidden_size}; export against the training target"
        )
    names = weight_names(c)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise UserError(f"{weights_path}: missing tensors {missing}; rerun the train stage")
    _check_finite(weights_path, {n: tensors[n] for n in names})
    out = {n: tensors[n].to(dtype) for n in names}
    _check_finite(weights_path, out, f"export.dtype {p['dtype']}")
    if c.draft_vocab_size != c.vocab_size:
        out["d2t"] = d2t
    out["t2d"] = t2d
    if p["include_embed_tokens"]:
        out["embed_tokens.weight"] = load_target_head(target_path, dtype).embed_tokens
    target_ref = str(target_path)  # as configured: an absolute build path would not travel
    config = eagle3_config(c, target_ref)
    config["torch_dtype"] = p["dtype"]
    _write_dir(Path(out_dir) / "eagle3", config, out)
    variants = [key for key in HEAD_VARIANTS if getattr(c, key)]
    if variants:  # a head SGLang would load without complaint and serve as another function
        print(f"[export] {Path(out_dir) / 'eagle3'}: an EAGLE-3.1 head ({', '.join(variants)}): serve it with vLLM "
              "(>= 0.25 reads these keys). SGLang's EAGLE-3 head ignores them and would serve a different function; "
              "for SGLang train the plain head (train.norm_before_residual, norm_before_fc, fc_norm, norm_output off)",
              file=sys.stderr, flush=True)
    if p["speculators"]:
        spec = speculators_config(c, target_ref, target_config)
        spec["torch_dtype"] = p["dtype"]
        _write_dir(Path(out_dir) / "speculators", spec, out)


def _write_dir(path: Path, config: dict, tensors: dict) -> None:
    """Both files into a temp folder, then one rename: a reader never sees half a checkpoint."""
    with atomic_path(path) as tmp:
        tmp.unlink()
        tmp.mkdir()
        write_json_atomic(tmp / "config.json", config)
        save_safetensors_atomic(tmp / "model.safetensors", tensors, {"format": "pt"})
        if path.exists():  # os.replace cannot replace a non-empty folder
            import shutil

            shutil.rmtree(path)


def _draft_config(config: dict, where: Path) -> DraftConfig:
    """The draft shape of an exported config.json: ours records it whole, other exporters' standard keys."""
    ours = config.get("eagle3build") or {}
    if "draft_config" in ours:
        return DraftConfig.from_dict(ours["draft_config"])
    try:  # a checkpoint from elsewhere: the standard keys say it all
        return DraftConfig(
            hidden_size=config["hidden_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]),
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta_of(config),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size", config["vocab_size"]),
            target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
            aux_layer_ids=config.get("eagle_aux_hidden_state_layer_ids", []),
            norm_before_residual=config.get("norm_before_residual", False),
            # as vLLM reads them: norm_before_fc from eagle_config first, then the top level
            norm_before_fc=bool((config.get("eagle_config") or {}).get(
                "norm_before_fc", config.get("norm_before_fc", False))),
            fc_norm=bool(config.get("fc_norm", False)),
            norm_output=bool(config.get("norm_output", False)),
        )
    except KeyError as e:
        raise UserError(f"{where}: key {e} is missing; not an EAGLE-3 draft config") from e


def read_exported(path: str | os.PathLike) -> tuple[Path, dict, DraftConfig, dict[str, torch.Tensor]]:
    """The one reader of the exported EAGLE-3 layout (ours, or another exporter's: config.json +
    model.safetensors as vLLM and SGLang load them). Returns the folder (`path` or its eagle3/), its
    config.json, the draft config and the tensors under this package's names: `layers.0.*` (how vLLM
    and some exporters name the decoder layer) read as `midlayer.*`, and d2t/t2d made for K == V heads
    that omit them. embed_tokens only when the checkpoint ships it."""
    path = Path(path)
    if not (path / "config.json").exists() and (path / "eagle3" / "config.json").exists():
        path = path / "eagle3"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path / 'config.json'}: unreadable exported config ({e}); rerun export") from e
    c = _draft_config(config, path / "config.json")
    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise UserError(f"{path / 'model.safetensors'}: unreadable weights ({e})") from e
    layer = "layers.0."
    tensors = {("midlayer." + k[len(layer) :] if k.startswith(layer) else k): v for k, v in tensors.items()}
    if "d2t" not in tensors:  # K == V: the identity mapping
        tensors["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in tensors:
        tensors["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool)
        tensors["t2d"][torch.arange(c.draft_vocab_size) + tensors["d2t"]] = True
    return path, config, c, tensors


def load_exported(
    path: str | os.PathLike, device="cpu", dtype: torch.dtype = torch.float32, target_path: str | None = None
) -> Eagle3Draft:
    """Rebuild the draft from an exported eagle3/ dir (or its parent). embed_tokens comes from the
    checkpoint when present, else from the target (target_path, or the path recorded at export)."""
    path, config, c, tensors = read_exported(path)
    if "embed_tokens.weight" not in tensors:
        source = target_path or (config.get("eagle3build") or {}).get("target")
        if not source or not Path(source).exists():
            raise UserError(
                f"{path}: the checkpoint has no embed_tokens and the target ({source}) is not found; "
                "pass target_path="
            )
        tensors["embed_tokens.weight"] = load_target_head(source).embed_tokens
    model = Eagle3Draft(c)
    model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=True
    )
    return model.to(device=device, dtype=dtype).eval()
