"""The EAGLE-3 draft head: one Llama decoder layer fed by the target's fused hidden states.

Parameter names are exactly those of the EAGLE-3 checkpoint that vLLM and SGLang load
(`fc`, `midlayer.*`, `norm`, `lm_head`, buffers `d2t`/`t2d`; the EAGLE-3.1 variants' `input_norm` and
`fc_norm.{0,1,2}`), so exporting is a rename-free copy.

The decoder layer is split into `qkv` (norms, projections, RoPE) and `finish` (attention output
projection, residual, MLP) so that training-time test (eagle3build/ttt/forward.py) can run its own attention pattern
between them, while inference uses `layer` with an ordinary causal KV cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from eagle3build.config import default_aux_layer_ids
from eagle3build.draft.target import TargetHead, TargetShape, rms_norm
from eagle3build.errors import ConfigError


@dataclass
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary V
    draft_vocab_size: int  # K
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    # Head variants, each under the config.json key vLLM (>= 0.25) reads; all off = plain EAGLE-3.
    norm_before_residual: bool = False  # the layer's residual is the hidden_norm'ed input, not the raw one
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`, [3*Ht]) over the concatenated aux states
    fc_norm: bool = False  # one RMSNorm per aux state (`fc_norm.{0,1,2}`, [Ht] each) before fc
    norm_output: bool = False  # feed the post-norm output (`norm`) back to the next draft step

    # The head variants (config.json keys of these names; eagle3build.draft.export)
    VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    # Draft-shape keys a user may override; everything else follows from the target and the mapping.
    OVERRIDABLE = (
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rope_theta",
        "max_position_embeddings",
        "norm_before_residual",
        "hidden_size",
        "norm_before_fc",
        "fc_norm",
        "norm_output",
    )

    @classmethod
    def from_target(
        cls,
        target: TargetShape,
        draft_vocab_size: int,
        aux_layer_ids: list[int] | None = None,
        overrides: dict | None = None,
    ) -> DraftConfig:
        """Default draft shape = the target's layer shape (a TargetHead, or TargetShape.from_config of its
        config alone); `overrides` (None values ignored) change it."""
        config = cls(
            hidden_size=target.hidden_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            aux_layer_ids=list(aux_layer_ids or default_aux_layer_ids(target.num_hidden_layers)),
        )
        for key, value in (overrides or {}).items():
            if value is None:
                continue
            if key not in cls.OVERRIDABLE:
                raise ConfigError(
                    f"train.{key}", f"not a draft-shape key; use one of {list(cls.OVERRIDABLE)}"
                )
            setattr(config, key, type(getattr(config, key))(value))
        if config.hidden_size != target.hidden_size:
            # embed_tokens is the target's (frozen, and shared by the engines when not exported)
            raise ConfigError(
                "train.hidden_size",
                f"{config.hidden_size} != the target's hidden size "
                f"{target.hidden_size}; the draft shares the target's embedding, leave it null",
            )
        if config.num_attention_heads % config.num_key_value_heads:
            raise ConfigError(
                "train.num_key_value_heads",
                f"{config.num_key_value_heads} does not divide "
                f"num_attention_heads {config.num_attention_heads}",
            )
        if config.norm_before_fc and config.fc_norm:
            # vLLM would apply both in a row; speculators refuses the pair: one norm before fc is the variant
            raise ConfigError(
                "train.fc_norm", "norm_before_fc and fc_norm are two placements of one norm; enable one of them"
            )
        if len(config.aux_layer_ids) != 3:
            raise ConfigError(
                "extract.aux_layer_ids", f"EAGLE-3 needs exactly 3 aux layers, got {config.aux_layer_ids}"
            )
        return config

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class FusedWeights:
    """Runtime-only concatenations of the draft's projection weights (see Eagle3Draft.fused_weights)."""

    qkv_embed: torch.Tensor  # [(nh + 2 * nkv) * hd, H]: q/k/v's embedding half, input_layernorm's scale folded in
    qkv_hidden: torch.Tensor  # [(nh + 2 * nkv) * hd, H]: q/k/v's hidden half
    gate_up: torch.Tensor  # [2I, H]: gate_proj's and up_proj's rows interleaved (g0, u0, g1, u1, ...)
    o: torch.Tensor  # o_proj
    down: torch.Tensor  # down_proj
    lm_head: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Projections only; the attention pattern is chosen by the caller (inference or TTT)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        # Registered only when on (norms draw no random numbers): a plain head has exactly the plain
        # parameters, so its initialisation, optimiser state and export are those of plain EAGLE-3.
        if c.norm_before_fc:
            self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(3))
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        # fp64 -> fp32 constants; not a buffer so that model.to(bfloat16) cannot round them
        self.inv_freq = (
            1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        ).float()
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """Follow .to(device) with inv_freq (kept fp32: a buffer would follow .to(dtype) too), so that
        RoPE never copies it host-to-device inside a training step."""
        super()._apply(fn, recurse)
        self.inv_freq = self.inv_freq.to(self.fc.weight.device)
        return self

    def reset_parameters(self) -> None:
        """Llama-style init (normal, std 0.02); norms at one."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @classmethod
    def from_target(
        cls,
        config: DraftConfig,
        target: TargetHead,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        init_lm_head_from_target: bool = True,
    ) -> Eagle3Draft:
        model = cls(config)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.embed_tokens)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
            if init_lm_head_from_target:
                model.lm_head.weight.copy_(target.lm_head[model.draft_ids()])
        return model

    # ------------------------------------------------------------------ shared pieces
    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft id (d2t is an offset)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, head_dim] for the positions (computed in fp32)."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq.to(position_ids.device)  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, 3*Ht] (low, mid, high layers concatenated) -> the layer's input hidden [B, T, H] (`fc`),
        after `input_norm` (norm_before_fc) or the per-layer `fc_norm`s where the head has them."""
        c = self.config
        if c.norm_before_fc:
            aux = self.input_norm(aux)
        if c.fc_norm:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(3, dim=-1), strict=True)], dim=-1)
        return self.fc(aux)

    def feedback(self, pre_norm_out: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads as its hidden input: the layer's pre-norm output (plain EAGLE-3),
        or with norm_output the final `norm` of it, the same tensor the lm_head reads (EAGLE-3.1; vLLM's
        `aux_output`). The lm_head always reads `logits(pre_norm_out)`."""
        return self.norm(pre_norm_out) if self.config.norm_output else pre_norm_out

    def fused_weights(self, dtype: torch.dtype | None = None) -> FusedWeights:
        """The projection weights for a training step: q/k/v and gate/up concatenated, all optionally
        cast once (e.g. to the autocast dtype).

        One wide matmul instead of three (two) runs closer to the GPU's matrix rate, in the forward and
        in the backward. q/k/v are split by input: the embedding half (see `embed_qkv`) and the hidden
        half. Casting once per step rather than per use (autocast casts inside every call of
        a compiled region) saves, per TTT step, a cast of each weight and the fp32 accumulation of its
        gradient: the uses' gradients add up in the low dtype and are cast back once. Gradients flow
        back into the named parameters, so the checkpoint layout is unchanged. Build it once per
        training step and pass it to `qkv`/`finish`/`logits` for every TTT step.
        """
        return FusedWeights(*self.fused_weight_tensors(dtype))

    def fused_weight_tensors(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """fused_weights' tensors, in FusedWeights' field order: a tuple, which torch.compile'd code returns as is."""
        layer, H = self.midlayer, self.config.hidden_size
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)

        def cast(w):
            return w if dtype is None else w.to(dtype)

        def cat(*weights):
            return torch.cat([cast(w) for w in weights])

        return (
            cat(*(w[:, :H] * layer.input_layernorm.weight for w in qkv)),  # (n * g) @ W.T == n @ (W * g).T
            cat(*(w[:, H:] for w in qkv)),
            # interleaved, so each gate value sits beside its up value and the SiLU gate's backward can read
            # the pair once and write both gradients together (with halves [gate; up], Inductor makes it a
            # cat over the two halves, an extra pass over the weight's gradient)
            torch.stack((cast(mlp.gate_proj.weight), cast(mlp.up_proj.weight)), dim=1).flatten(0, 1),
            cast(attn.o_proj.weight),
            cast(mlp.down_proj.weight),
            cast(self.lm_head.weight),
        )

    def embed_qkv(self, input_ids: torch.Tensor, fused: FusedWeights) -> torch.Tensor:
        """The embedding half of q/k/v, [..., (nh + 2 * nkv) * hd], for `qkv(..., fused, embed_qkv)`.

        It depends on the token ids alone, and TTT step s reads the ids shifted by s: a training step
        computes it once over the ids and hands each TTT step its rows, instead of a matmul per step.
        input_layernorm's scale is folded into fused.qkv_embed, so the normed embeddings need no
        gradient and the backward computes none for this half's input (the embeddings are frozen).
        """
        embeds = self.embed_tokens(input_ids)
        normed = F.rms_norm(embeds.float(), (embeds.shape[-1],), eps=self.midlayer.input_layernorm.eps)
        return F.linear(normed.to(fused.qkv_embed.dtype), fused.qkv_embed)

    def qkv(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        fused: FusedWeights | None = None,
        embed_qkv: torch.Tensor | None = None,
    ):
        """Queries [B, nh, T, hd] and post-RoPE keys/values [B, nkv, T, hd], plus the residual.

        With `fused`, `embed_qkv` may give the embedding half precomputed (then input_ids is unused)."""
        c, layer = self.config, self.midlayer
        B, T = hidden.shape[:2]
        normed_hidden = layer.hidden_norm(hidden)
        residual = normed_hidden if c.norm_before_residual else hidden
        attn = layer.self_attn
        if fused is None:
            embeds = layer.input_layernorm(self.embed_tokens(input_ids).to(hidden.dtype))
            x = torch.cat((embeds, normed_hidden), dim=-1)  # embedding first
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        else:
            if embed_qkv is None:
                embed_qkv = self.embed_qkv(input_ids, fused)
            q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            qkv = F.linear(normed_hidden, fused.qkv_hidden) + embed_qkv
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope(position_ids, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v, residual

    def finish(
        self, attn_out: torch.Tensor, residual: torch.Tensor, fused: FusedWeights | None = None
    ) -> torch.Tensor:
        """attn_out [B, nh, T, hd] -> the layer's pre-norm output [B, T, H]."""
        B, _, T, _ = attn_out.shape
        return self.finish_rows(attn_out.transpose(1, 2).reshape(B, T, -1), residual, fused)

    def finish_rows(
        self, attn_out: torch.Tensor, residual: torch.Tensor, fused: FusedWeights | None = None
    ) -> torch.Tensor:
        """attn_out [..., T, nh * hd] (the heads side by side) -> the layer's pre-norm output [..., T, H]."""
        layer = self.midlayer
        if fused is None:
            h = residual + layer.self_attn.o_proj(attn_out)
            return h + layer.mlp(layer.post_attention_layernorm(h))
        h = residual + F.linear(attn_out, fused.o)
        gate, up = F.linear(layer.post_attention_layernorm(h), fused.gate_up).unflatten(-1, (-1, 2)).unbind(-1)
        return h + F.linear(F.silu(gate) * up, fused.down)

    def logits(self, pre_norm_out: torch.Tensor, fused: FusedWeights | None = None) -> torch.Tensor:
        """[..., H] -> draft-vocab logits [..., K]."""
        return F.linear(self.norm(pre_norm_out), self.lm_head.weight if fused is None else fused.lm_head)

    # ------------------------------------------------------------------ inference
    def layer(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """Run the decoder layer on T new positions attending causally to the cache and themselves.

        Returns the pre-norm output [B, T, H] and the extended cache (keys post-RoPE,
        [B, nkv, L+T, hd]); crop a cache by slicing dim 2.
        """
        q, k, v, residual = self.qkv(input_ids, hidden, position_ids)
        if kv_cache is not None:
            k = torch.cat((kv_cache[0], k), dim=2)
            v = torch.cat((kv_cache[1], v), dim=2)
        T, L = q.shape[2], k.shape[2]
        # query i sits at cache index L-T+i and sees every key up to that index
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.finish(out, residual), (k, v)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}


def attention_scale(config: DraftConfig) -> float:
    return 1.0 / math.sqrt(config.head_dim)
