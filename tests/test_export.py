"""The exported checkpoint obeys the engines' loading rules and reloads into the same draft."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from test_train import FAST, make_inputs

from eagle3build.draft.export import WEIGHT_NAMES, export, load_exported
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.errors import UserError
from eagle3build.train.loop import train

torch.set_num_threads(2)

REQUIRED_CONFIG = {
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "draft_vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "tie_word_embeddings",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    inputs = make_inputs(root, n_shards=1, samples_per_shard=4)
    train(
        inputs["shards"],
        inputs["mapping"],
        inputs["target"],
        str(root / "train"),
        str(root / "state"),
        {**FAST, "epochs": 1},
    )
    return inputs, root


def test_export_follows_the_eagle3_loading_rules(trained):
    inputs, root = trained
    export(
        str(root / "train" / "draft.safetensors"),
        inputs["mapping"],
        inputs["target"],
        str(root / "export"),
        {"speculators": True},
    )
    config = json.loads((root / "export" / "eagle3" / "config.json").read_text())
    assert REQUIRED_CONFIG <= set(config)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == 128 and config["draft_vocab_size"] == 64  # target V, draft K
    assert config["target_hidden_size"] == 32
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]  # from the shards: (2, N//2, N-3), N = 6
    target_config = json.loads((root / "target" / "config.json").read_text())
    assert config["rope_theta"] == target_config["rope_parameters"]["rope_theta"]
    with safe_open(str(root / "export" / "eagle3" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in names}
    assert names == set(WEIGHT_NAMES) | {
        "d2t",
        "t2d",
    }  # nothing the engines do not know (no fc.bias, no embed)
    h, k = 32, 64
    c = DraftConfig.from_dict(config["eagle3build"]["draft_config"])
    heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "lm_head.weight": (k, h),
        "norm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
    }
    for name, shape in shapes.items():
        assert tuple(tensors[name].shape) == shape, name
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["t2d"].shape == (128,) and int(tensors["t2d"].sum()) == k
    kept = torch.arange(k) + tensors["d2t"]  # target_id = draft_id + d2t[draft_id]
    assert torch.equal(kept, torch.arange(64)) and bool(tensors["t2d"][kept].all())
    spec = json.loads((root / "export" / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["norm_before_residual"] is False
    assert "verifier" in spec["speculators_config"]


def test_reloaded_head_gives_the_trained_logits(trained):
    inputs, root = trained
    export(
        str(root / "train" / "draft.safetensors"),
        inputs["mapping"],
        inputs["target"],
        str(root / "fp32"),
        {"dtype": "float32"},
    )
    reloaded = load_exported(root / "fp32")
    # the trained head, rebuilt from train's own output
    with safe_open(str(root / "train" / "draft.safetensors"), framework="pt") as f:
        c = DraftConfig.from_dict(json.loads(f.metadata()["draft_config"]))
        weights = {k: f.get_tensor(k) for k in f.keys()}
    from eagle3build.draft.target import load_target_head

    trained_model = Eagle3Draft(c)
    trained_model.load_state_dict(
        {**weights, "embed_tokens.weight": load_target_head(inputs["target"]).embed_tokens}
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (1, 6), generator=g)
    aux = torch.randn(1, 6, 3 * 32, generator=g)
    pos = torch.arange(6)[None]
    outs = []
    for model in (trained_model, reloaded):
        with torch.no_grad():
            hidden, _ = model.layer(ids, model.project_aux(aux), pos)
            outs.append(model.logits(hidden))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert torch.equal(reloaded.draft_to_target(torch.arange(64)), torch.arange(64))
    # bf16 export reloads close to the fp32 one
    export(
        str(root / "train" / "draft.safetensors"), inputs["mapping"], inputs["target"], str(root / "bf16"), {}
    )
    bf16 = load_exported(root / "bf16" / "eagle3", dtype=torch.float32)
    with torch.no_grad():
        hidden, _ = bf16.layer(ids, bf16.project_aux(aux), pos)
        assert torch.allclose(bf16.logits(hidden), outs[0], atol=0.05 * outs[0].abs().max())


def test_export_refuses_a_mapping_that_was_not_trained_with(trained, tmp_path):
    inputs, root = trained
    from test_train import write_mapping

    other = write_mapping(tmp_path / "other.safetensors", 128, list(range(1, 65)))
    with pytest.raises(UserError, match="other.safetensors: differs from the mapping"):
        export(str(root / "train" / "draft.safetensors"), other, inputs["target"], str(tmp_path / "x"), {})
    assert not (tmp_path / "x" / "eagle3").exists()


# ---------------------------------------------------------------- the aux ids as each engine reads them
def vllm_captures(draft: dict, num_layers: int) -> list[int]:
    """The target layers whose input vLLM feeds the draft, read as vLLM does. gpu_model_runner's
    `_get_eagle3_aux_layers_from_config`: the draft config's top-level `eagle_aux_hidden_state_layer_ids`
    when it is a non-empty list (newer versions then try `eagle_config`'s), else the target model's default
    (2, N//2, N-3). The target's forward (models/llama.py, deepseek_v2.py) then captures
    `hidden_states + residual` before layer idx for each idx in that tuple: the ids are used as they are."""
    ids = draft.get("eagle_aux_hidden_state_layer_ids")
    if not (ids and isinstance(ids, (list, tuple))):
        nested = draft.get("eagle_config")
        ids = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
    if not (ids and isinstance(ids, (list, tuple))):
        ids = (2, num_layers // 2, num_layers - 3)
    return [idx for idx in range(num_layers) if idx in tuple(ids)]


def sglang_captures(draft: dict, num_layers: int) -> list[int]:
    """The same, read as SGLang does. model_runner: `eagle_config["eagle_aux_hidden_state_layer_ids"]`
    inside a try/except (anything missing: None); the target's `set_eagle3_layers_to_capture`:
    layers_to_capture = [2, N//2, N-3] for None, else [val + 1 for val in ids] ("for the ith layer, it
    takes the output of the (i-1)th layer"); its forward captures before layer i for i in layers_to_capture."""
    try:
        ids = draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except Exception:
        ids = None
    to_capture = [2, num_layers // 2, num_layers - 3] if ids is None else [val + 1 for val in ids]
    return [i for i in range(num_layers) if i in to_capture]


def retrained_with(root, aux_layer_ids: list[int], out):
    """train's output with other aux ids in its draft config (the weights do not depend on them here)."""
    from safetensors.torch import save_file

    with safe_open(str(root / "train" / "draft.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    draft_config = json.loads(meta["draft_config"])
    draft_config["aux_layer_ids"] = aux_layer_ids
    save_file(tensors, str(out), {**meta, "draft_config": json.dumps(draft_config)})
    return str(out)


@pytest.mark.parametrize("aux", [[1, 2, 4], [0, 3, 5]])
def test_vllm_and_sglang_both_read_back_the_trained_aux_ids(trained, tmp_path, aux):
    inputs, root = trained
    n = json.loads((root / "target" / "config.json").read_text())["num_hidden_layers"]  # 6: default [2, 3, 3]
    export(retrained_with(root, aux, tmp_path / "draft.safetensors"), inputs["mapping"], inputs["target"],
           str(tmp_path / "export"), {})
    config = json.loads((tmp_path / "export" / "eagle3" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == aux  # vLLM's convention: ours
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in aux]  # SGLang's
    assert vllm_captures(config, n) == aux
    assert sglang_captures(config, n) == aux
    # Without the nested key (what the export wrote before) SGLang silently used its default layers.
    top_level_only = {k: v for k, v in config.items() if k != "eagle_config"}
    assert sglang_captures(top_level_only, n) != aux and vllm_captures(top_level_only, n) == aux


def test_config_records_the_target_as_configured(trained, tmp_path, monkeypatch):
    """No absolute build path in config.json: the target as written in the config (a hub id, or a path,
    relative when it was relative), which is what the engines and load_exported resolve where it is used."""
    inputs, root = trained
    monkeypatch.chdir(root)
    export(str(root / "train" / "draft.safetensors"), inputs["mapping"], "target", str(tmp_path / "export"),
           {"speculators": True})
    for kind in ("eagle3", "speculators"):
        text = (tmp_path / "export" / kind / "config.json").read_text()
        assert str(root) not in text and str(tmp_path) not in text
    assert json.loads((tmp_path / "export" / "eagle3" / "config.json").read_text())["eagle3build"]["target"] == "target"
    spec = json.loads((tmp_path / "export" / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "target"  # vLLM serves this as the target
    assert load_exported(tmp_path / "export").config.draft_vocab_size == 64  # the recorded path, from here
