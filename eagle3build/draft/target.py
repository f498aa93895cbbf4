"""The three tensors of the target model that the draft head needs, read without loading the model.

Training needs the target's token embedding (the draft's frozen `embed_tokens`), its final RMSNorm and
its `lm_head` (to recompute the target distribution from the stored final residual stream). A target
can be hundreds of GB, so the tensors are read one by one with `safe_open` from a single
`model.safetensors` or from the shards an index (`model.safetensors.index.json`) names.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3build.config import read_model_config
from eagle3build.errors import UserError

# Where the decoder lives inside the checkpoint, most common first. Multimodal wrappers nest the
# language model one or two levels down.
_PREFIXES = (
    "model.",
    "",
    "language_model.model.",
    "model.language_model.",
    "language_model.",
    "transformer.",
)
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


@dataclass
class TargetShape:
    """The target config's values the draft's shape derives from (DraftConfig.from_target): its width, vocab,
    depth and the shape of one decoder layer (the draft's own unless overridden)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float

    @classmethod
    def from_config(cls, config: dict) -> TargetShape:
        """From the text model's config.json (read_target_config). An MLA target has no KV groups: its
        num_key_value_heads is its head count, and without head_dim a head is hidden / heads wide."""
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(config["num_hidden_layers"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            intermediate_size=int(config.get("intermediate_size", 4 * hidden)),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta_of(config),
        )


@dataclass
class TargetHead(TargetShape):
    """Embedding, final norm and lm_head of the target plus the config values the draft needs."""

    embed_tokens: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself for tied targets)
    model_type: str = "llama"
    tie_word_embeddings: bool = False
    config: dict = field(default_factory=dict, repr=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: statistics in fp32, result cast back before the learned scale."""
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def read_target_config(target_path: str | os.PathLike) -> dict:
    """The text model's config.json (the `text_config` of a multimodal wrapper)."""
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise UserError(
            f"{path}: missing; the target must be a local Hugging Face model dir (config.json + safetensors)"
        )
    config = read_model_config(str(target_path))
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads"):
        if key not in config:
            raise UserError(f"{path}: key '{key}' is missing; is this a decoder-only language model?")
    return config


def rope_theta_of(config: dict) -> float:
    """rope_theta from transformers >= 5 (`rope_parameters`) or older (`rope_theta`) configs."""
    params = config.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.get("rope_theta", 10000.0))


def _weight_files(target_path: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file holding it."""
    index = target_path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index}: not a valid safetensors index ({e}); re-download the model") from e
        return {name: target_path / file for name, file in weight_map.items()}
    files = sorted(target_path.glob("*.safetensors"))
    if not files:
        raise UserError(
            f"{target_path}: no *.safetensors weights found; convert the model with save_pretrained"
        )
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update({name: file for name in f.keys()})
    return names


def _read(files: dict[str, Path], name: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name).to(dtype)
    except Exception as e:
        raise UserError(f"{files[name]}: cannot read tensor '{name}' ({e}); the file is corrupted") from e


def load_target_head(target_path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> TargetHead:
    """Read embed_tokens, the final norm and lm_head (tied: the embedding) and the target's config."""
    target_path = Path(target_path)
    config = read_target_config(target_path)
    files = _weight_files(target_path)
    prefix = next(
        (p for p in _PREFIXES if f"{p}embed_tokens.weight" in files and f"{p}norm.weight" in files), None
    )
    if prefix is None:
        raise UserError(
            f"{target_path}: found no '*embed_tokens.weight' + '*norm.weight' pair in the weights; "
            "only Llama-style decoders (model.embed_tokens / model.norm / lm_head) are supported"
        )
    embed = _read(files, f"{prefix}embed_tokens.weight", dtype)
    norm = _read(files, f"{prefix}norm.weight", dtype)
    head_name = next((n for n in _LM_HEAD_NAMES if n in files), None)
    tied = bool(config.get("tie_word_embeddings", False)) or head_name is None
    lm_head = embed if tied else _read(files, head_name, dtype)
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    if embed.shape[1] != hidden or lm_head.shape[1] != hidden:
        raise UserError(f"{target_path}: embed/lm_head width {embed.shape[1]} != config hidden_size {hidden}")
    if lm_head.shape[0] < vocab:
        raise UserError(f"{target_path}: lm_head has {lm_head.shape[0]} rows < config vocab_size {vocab}")
    return TargetHead(
        **asdict(TargetShape.from_config(config)),
        embed_tokens=embed[:vocab],
        norm=norm,
        lm_head=lm_head[:vocab],
        model_type=str(config.get("model_type", "llama")),
        tie_word_embeddings=tied,
        config=config,
    )
