"""Warm start (`train.init_from`): fine-tune a published EAGLE-3 head instead of a freshly initialised one.

The head is a folder in the layout the engines load (config.json + model.safetensors, as
eagle3build.draft.export writes it and other teams publish theirs: `midlayer.*` or `layers.0.*`
names, `d2t`/`t2d`, optional `embed_tokens`), read by draft.export.read_exported. Before any weight
is copied it must fit this build, else a ConfigError names train.init_from, what differs and the key
that would make it fit:
- shapes: hidden size, heads, kv heads, head dim, intermediate size, the target's hidden size and
  vocabulary, the draft vocabulary size; the draft's RoPE base; its variant switches
  (norm_before_residual, norm_before_fc, fc_norm, norm_output), a key its config.json lacks read as off,
  as vLLM reads it (a plain head published before the switches existed is plain); the aux layers it was
  trained on (the target's layers feeding `fc`);
- the vocabulary mapping: a head trained with this build's d2t is copied as it is. One trained with
  another mapping of the same size has its lm_head rows moved to this build's draft ids by target
  token id; rows for tokens the head never predicted keep this build's initialisation (the target's
  lm_head rows under init_lm_head_from_target). At least MIN_OVERLAP of this build's draft tokens
  must be in the head's vocabulary: below that most of the output layer would start fresh and the
  head is not the warm start it claims to be.
The frozen embedding stays the target's. A resumed run continues from its checkpoint, not the head;
the head's files are part of the run's identity (`head_identity`), so a replaced head starts afresh.

Torch is imported inside the functions: `head_files` runs where the workflow is planned.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from eagle3build.errors import ConfigError, UserError

KEY = "train.init_from"
MIN_OVERLAP = 0.5
HEAD_FILES = ("config.json", "model.safetensors")
# draft-shape field -> how this build could be made to match the head (None: a head for another target)
SHAPE_FIXES = {
    "hidden_size": None,
    "target_hidden_size": None,
    "vocab_size": None,
    "num_attention_heads": "train.num_attention_heads",
    "num_key_value_heads": "train.num_key_value_heads",
    "head_dim": "train.head_dim",
    "intermediate_size": "train.intermediate_size",
    "draft_vocab_size": "vocab.draft_vocab_size",
}


def head_folder(init_from: str) -> Path:
    """The folder holding the head's files: `init_from` itself or its eagle3/ (an export's out_dir)."""
    path = Path(init_from)
    if not (path / "config.json").exists() and (path / "eagle3" / "config.json").exists():
        path = path / "eagle3"
    return path


def head_files(init_from: str | None) -> list[str]:
    """The head's files, the train rule's inputs when init_from is set (a changed head retrains)."""
    if not init_from:
        return []
    folder = head_folder(init_from)
    missing = [name for name in HEAD_FILES if not (folder / name).is_file()]
    if missing:
        raise ConfigError(
            KEY,
            f"{init_from}: no {' or '.join(missing)} there (nor in its eagle3/); point it at an EAGLE-3 head "
            "folder (config.json + model.safetensors, e.g. `huggingface-cli download ORG/HEAD --local-dir DIR`)",
        )
    return [str(folder / name) for name in HEAD_FILES]


def head_identity(init_from: str) -> dict:
    """What the run's params hash records of the head: its path and the digests of its files."""
    digests = {}
    for path in head_files(init_from):
        with open(path, "rb") as f:
            digests[Path(path).name] = hashlib.file_digest(f, "sha256").hexdigest()
    return {"path": str(init_from), "sha256": digests}


def _aux_ids(config: dict) -> list[int] | None:
    """The head's aux layer ids in this package's (vLLM's) convention, if its config states them:
    the top-level key as is, else SGLang's nested eagle_config key, which counts one layer lower."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return [int(x) for x in config["eagle_aux_hidden_state_layer_ids"]]
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [int(x) + 1 for x in nested] if nested else None


def shape_problems(head, ours, head_json: dict) -> list[str]:
    """Each way the head's DraftConfig `head` does not fit this build's `ours`, with the fix."""
    problems = []
    for key, fix in SHAPE_FIXES.items():
        theirs, mine = getattr(head, key), getattr(ours, key)
        if theirs != mine:
            how = f"set {fix}: {theirs}" if fix else "a head for another target"
            problems.append(f"{key} {theirs} != this build's {mine} ({how})")
    stated = (head_json.get("eagle3build") or {}).get("draft_config") or head_json
    if ("rope_theta" in stated or "rope_parameters" in stated) and float(head.rope_theta) != float(
        ours.rope_theta
    ):
        problems.append(
            f"rope_theta {head.rope_theta} != {ours.rope_theta} (set train.rope_theta: {head.rope_theta})"
        )
    for key in type(ours).VARIANTS:  # the head variants (norms): a head trained with one runs only with it
        theirs, mine = bool(getattr(head, key)), bool(getattr(ours, key))
        if theirs != mine:
            problems.append(f"{key} {theirs} != {mine} (set train.{key}: {str(theirs).lower()})")
    aux = _aux_ids(head_json)
    if aux is not None and list(aux) != list(ours.aux_layer_ids):
        problems.append(
            f"trained on the target's layers {aux}, this build extracts {list(ours.aux_layer_ids)} "
            f"(set extract.aux_layer_ids: {aux})"
        )
    return problems


def map_lm_head(head_lm, head_d2t, our_d2t, init, vocab_size: int):
    """The head's lm_head rows [K, H] moved to this build's draft ids by target id (d2t: offsets,
    target id = draft id + d2t); rows of tokens the head lacks are taken from `init`. Returns
    (weight, share of this build's draft tokens found in the head's vocabulary)."""
    import torch

    row_of = torch.full((vocab_size,), -1, dtype=torch.long)
    row_of[torch.arange(len(head_d2t)) + head_d2t] = torch.arange(len(head_d2t))
    rows = row_of[torch.arange(len(our_d2t)) + our_d2t]
    found = rows >= 0
    weight = init.detach().clone()
    weight[found] = head_lm[rows[found]].to(weight.dtype)
    return weight, float(found.float().mean()) if len(found) else 0.0


def warm_start(draft, init_from: str) -> dict:
    """Copy the head `init_from` names into `draft` (an Eagle3Draft built for this run, d2t/t2d set)
    after checking it fits; returns what was done (the run's summary records it)."""
    import torch

    from eagle3build.draft.export import read_exported

    try:
        head_files(init_from)  # names train.init_from when the files are not there
        folder, head_json, head, tensors = read_exported(head_folder(init_from))
    except UserError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(KEY, f"{init_from}: {e}") from e
    problems = shape_problems(head, draft.config, head_json)
    if problems:
        raise ConfigError(KEY, f"{folder} does not fit this build: " + "; ".join(problems))
    report = {"init_from": str(init_from), "lm_head": "copied", "draft_vocab_overlap": 1.0}
    lm_head = tensors.get("lm_head.weight")
    if lm_head is not None and not torch.equal(tensors["d2t"].long().cpu(), draft.d2t.long().cpu()):
        lm_head, overlap = map_lm_head(
            lm_head,
            tensors["d2t"].long().cpu(),
            draft.d2t.long().cpu(),
            draft.lm_head.weight.cpu(),
            draft.config.vocab_size,
        )
        if overlap < MIN_OVERLAP:
            raise ConfigError(
                KEY,
                f"{folder}: its draft vocabulary (d2t) differs from this build's vocab mapping and holds only "
                f"{overlap:.0%} of this build's draft tokens (at least {MIN_OVERLAP:.0%} needed); build the "
                "vocabulary from data like the head's, or leave train.init_from unset",
            )
        tensors["lm_head.weight"] = lm_head
        report.update(lm_head="remapped by target token id", draft_vocab_overlap=round(overlap, 4))
    _copy_weights(draft, tensors, folder)
    return report


def _copy_weights(draft, tensors: dict, folder: Path) -> None:
    """Every trainable weight of `draft` from `tensors` (embed_tokens stays the target's)."""
    import torch

    wrong = []
    for name, param in draft.named_parameters():
        if name == "embed_tokens.weight":
            continue
        value = tensors.get(name)
        if value is None or tuple(value.shape) != tuple(param.shape):
            wrong.append(
                f"{name} {None if value is None else tuple(value.shape)} (needs {tuple(param.shape)})"
            )
    if wrong:
        raise ConfigError(
            KEY, f"{folder}/model.safetensors: tensors missing or of another shape: " + ", ".join(wrong)
        )
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name != "embed_tokens.weight":
                param.copy_(tensors[name].to(device=param.device, dtype=param.dtype))
