"""The target as a transformers causal LM in this process: on a device, in eval mode, with the ids that
end its generations. The regenerate and evaluate stages load it this way (its tokenizer:
`data.chat.load_target_tokenizer`); `target` is the workflow's target dict (path, revision,
trust_remote_code, chat_template, dtype).
"""

from __future__ import annotations

from eagle3build.errors import UserError
from eagle3build.trust import check_trust, target_path, trusted

__all__ = ["eos_token_ids", "load_target_model", "resolve_device", "target_path"]


def resolve_device(device: str):
    """'auto' = cuda when available, else cpu; anything else is a torch device name."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_target_model(target: dict, device):
    """Causal LM in eval mode on `device`: bf16 on GPU, fp32 on CPU unless target['dtype'] says otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    check_trust(target)
    dtype = target.get("dtype") or "auto"
    if dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        target_path(target),
        revision=target.get("revision"),
        trust_remote_code=trusted(target),
        dtype=dtype,
    )
    return model.to(device).eval()


def eos_token_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos:
        raise UserError(f"'{model.name_or_path}' defines no eos token; generation could never stop")
    return eos
