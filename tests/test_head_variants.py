"""Head variants (EAGLE-3.1 norms) and acceptance-targeting losses: each switch changes the computation,
trains, matches the inference path, and exports under the names and keys vLLM 0.25.0 reads.

The vLLM mirror below follows vllm/model_executor/models/llama_eagle3.py of vLLM 0.25.0 (the pinned
image's version): the parameters Eagle3LlamaForCausalLM creates from config.json and the renames of its
load_weights; where vLLM would skip a checkpoint tensor or leave a parameter unloaded, the mirror fails.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_model_ttt import K, random_samples, tiny_draft
from test_train import FAST, make_inputs, sharp_llama, write_mapping

from eagle3build.attention.factory import make_attention
from eagle3build.config import resolve_section
from eagle3build.draft.export import WEIGHT_NAMES, export, load_exported, weight_names
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.draft.target import load_target_head
from eagle3build.errors import ConfigError
from eagle3build.train.checkpoint import save_best
from eagle3build.train.loop import hashed_params, resolve_params, train
from eagle3build.ttt.batch import pack
from eagle3build.ttt.forward import ttt_forward
from eagle3build.ttt.loss import LOSSES, Objective, acceptance_loss, step_loss_weights, weighted_loss

torch.set_num_threads(2)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VARIANTS = {
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "speculators_default": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
}
ACCEPTANCE_LOSSES = [loss for loss in LOSSES if loss != "forward_kl"]


def variant_draft(flags: dict, seed=0) -> tuple[Eagle3Draft, Eagle3Draft, object]:
    """(plain, variant, scorer): the variant holds the plain head's weights, its own norms perturbed."""
    plain, target, scorer = tiny_draft(seed)
    config = DraftConfig.from_dict({**plain.config.to_dict(), **flags})
    variant = Eagle3Draft(config)
    missing, unexpected = variant.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("input_norm" in n or "fc_norm" in n for n in missing), missing
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in variant.named_parameters():
            if name in missing:
                param.add_(0.3 * torch.randn(param.shape, generator=g))
    return plain, variant, scorer


def stats_of(model, scorer, samples, steps=3, objective=None):
    batch = pack(samples)
    batch.greedy_in_draft = scorer.greedy_in_draft(batch.final)
    probs = scorer.draft_probs(batch.final)
    return ttt_forward(model, batch, probs, steps, make_attention("reference"), objective=objective)


# ------------------------------------------------------------------ defaults: plain EAGLE-3, unchanged
def test_the_defaults_are_the_plain_head():
    p = resolve_params({})
    assert [p[k] for k in DraftConfig.VARIANTS] == [False] * 4 and p["loss"] == "forward_kl"
    assert Objective.from_params(p) is None  # ttt_forward's own soft cross-entropy, as before
    plain, _, _ = tiny_draft()
    assert not any("input_norm" in n or "fc_norm" in n for n, _ in plain.named_parameters())
    assert weight_names(plain.config) == WEIGHT_NAMES
    # a run of an existing config keeps its identity (params hash): the new keys hash only when set
    hashed = hashed_params(p, fsdp=False)
    assert not {"norm_before_fc", "fc_norm", "norm_output", "loss", "lk_eta"} & set(hashed)
    assert hashed_params(resolve_params({"loss": "tv"}), fsdp=False)["loss"] == "tv"
    assert hashed_params(resolve_params({"fc_norm": True}), fsdp=False)["fc_norm"] is True


def test_the_two_norms_before_fc_exclude_each_other():
    plain, target, _ = tiny_draft()
    with pytest.raises(ConfigError, match="train.fc_norm"):
        DraftConfig.from_target(target, K, overrides={"norm_before_fc": True, "fc_norm": True})


# ------------------------------------------------------------------ each switch changes what it should
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_switch_changes_the_computation(name):
    plain, variant, scorer = variant_draft(VARIANTS[name])
    samples = random_samples([12, 9])
    a, b = stats_of(plain, scorer, samples), stats_of(variant, scorer, samples)
    assert torch.equal(a.count, b.count)
    differs = ~torch.isclose(a.loss_sum, b.loss_sum, rtol=1e-4, atol=1e-5)
    if name == "norm_output":  # only what the next step reads changes: step 0 is the plain head's
        assert not differs[0] and differs[1:].all(), (a.loss_sum, b.loss_sum)
    else:
        assert differs.all(), (a.loss_sum, b.loss_sum)


@pytest.mark.parametrize("loss", ACCEPTANCE_LOSSES)
def test_each_loss_changes_the_objective_not_the_accuracy(loss):
    plain, _, scorer = tiny_draft()
    samples = random_samples([12, 9])
    kl = stats_of(plain, scorer, samples)
    other = stats_of(plain, scorer, samples, objective=Objective(loss, 3.0))
    assert torch.equal(kl.correct, other.correct) and torch.equal(kl.count, other.count)
    assert not torch.allclose(kl.loss_sum, other.loss_sum)


# ------------------------------------------------------------------ TTT == the inference path, per variant
def row_loss(loss: str, p: torch.Tensor, logits: torch.Tensor, eta: float = 3.0) -> torch.Tensor:
    """The losses written from their definitions (TV = half the L1 distance), float64."""
    p, logq = p.double(), torch.log_softmax(logits.double(), -1)
    tv = 0.5 * (p - logq.exp()).abs().sum(-1)
    if loss == "forward_kl":
        return -(p * logq).sum(-1)
    if loss == "tv":
        return tv
    if loss == "nla":
        return -torch.log(1 - tv)
    kl = F.kl_div(logq, p, reduction="none").sum(-1)
    mix = torch.exp(-eta * (1 - tv.detach()))  # the weight is not differentiated
    return mix * kl + (1 - mix) * tv


def inference_loss(model: Eagle3Draft, scorer, sample, steps: int, loss: str) -> torch.Tensor:
    """Per-step loss sums by the inference path (the evaluator's and vLLM's): step 0 is one causal
    `layer` call over fc(aux); the chain from row t then drafts with a cache cropped to t, each step
    reading `feedback` of the previous output, one RoPE position further."""
    ids, mask, hidden = sample
    n = len(ids)
    probs = scorer.draft_probs(hidden[:, 3])
    greedy_kept = scorer.greedy_in_draft(hidden[:, 3])
    sums = torch.zeros(steps, dtype=torch.float64)
    with torch.no_grad():
        out0, (k0, v0) = model.layer(ids[1:][None], model.project_aux(hidden[: n - 1, :3].flatten(1)[None]),
                                     torch.arange(n - 1)[None])
        for t in range(n - 1):
            out, cache = out0[:, t : t + 1], (k0[:, :, : t + 1], v0[:, :, : t + 1])
            for s in range(steps):
                j = t + 1 + s
                if j + 1 >= n:
                    break
                if s:
                    out, cache = model.layer(ids[j][None, None], model.feedback(out), torch.tensor([[t + s]]), cache)
                if mask[j + 1] and greedy_kept[j]:
                    sums[s] += row_loss(loss, probs[j], model.logits(out)[0, 0])
    return sums


@pytest.mark.parametrize("name,loss", [*((v, "forward_kl") for v in VARIANTS), *(("norm_output", x) for x in ACCEPTANCE_LOSSES)])
def test_training_time_test_matches_the_inference_path(name, loss):
    _, model, scorer = variant_draft(VARIANTS[name])
    sample = random_samples([11])[0]
    objective = None if loss == "forward_kl" else Objective(loss, 3.0)
    stats = stats_of(model, scorer, [sample], steps=3, objective=objective)
    expected = inference_loss(model, scorer, sample, 3, loss)
    torch.testing.assert_close(stats.loss_sum.double(), expected, rtol=1e-4, atol=1e-5)


def test_the_evaluators_two_decoders_agree_on_a_variant():
    """acceptance.chain_proposals (the teacher-forced evaluator) equals step-by-step `layer` decoding."""
    from eagle3build.evaluate.acceptance import chain_proposals

    _, model, _ = variant_draft(VARIANTS["speculators_default"])
    ids, _, hidden = random_samples([10])[0]
    k = 3
    proposals = chain_proposals(model, ids, hidden[:, :3].flatten(1), k)  # [k, T]
    with torch.no_grad():
        out0, (k0, v0) = model.layer(ids[1:][None], model.project_aux(hidden[:-1, :3].flatten(1)[None]), torch.arange(9)[None])
        for t in range(9 - k):
            out, cache = out0[:, t : t + 1], (k0[:, :, : t + 1], v0[:, :, : t + 1])
            for s in range(k):
                token = model.draft_to_target(model.logits(out).argmax(-1))
                assert int(token) == int(proposals[s, t]), (t, s)
                out, cache = model.layer(token, model.feedback(out), torch.tensor([[t + s + 1]]), cache)


# ------------------------------------------------------------------ the acceptance losses: gradients, bf16
class _Logits:
    """A stand-in draft whose logits are its hidden input (acceptance_loss's only use of the model)."""

    def logits(self, hidden, fused=None):
        return hidden


def test_the_tv_loss_gradient_is_the_acceptance_gradient():
    g = torch.Generator().manual_seed(0)
    M, S, Kv = 3, 2, 7
    z = torch.randn(M, S, Kv, generator=g, dtype=torch.float64) * 2
    p = torch.softmax(torch.randn(M, Kv, generator=g, dtype=torch.float64) * 2, -1)
    weight = torch.ones(M, S)
    zt = z.float().requires_grad_(True)
    loss_sum, _, _ = acceptance_loss(_Logits(), None, zt, p.float(), weight, "tv", 3.0)
    loss_sum.sum().backward()
    # 1. autograd of the reference formula, 0.5 * sum |p - q|, in float64
    zr = z.clone().requires_grad_(True)
    row_loss("tv", p[:, None], zr).sum().backward()
    torch.testing.assert_close(zt.grad.double(), zr.grad, rtol=1e-4, atol=1e-6)
    # 2. the closed form: d(1 - alpha)/dz_j = -(q_j [q_j < p_j] - q_j * sum_{v: q_v < p_v} q_v)
    q = torch.softmax(z, -1)
    below = (q < p[:, None]).double()
    closed = -(q * below - q * (q * below).sum(-1, keepdim=True))
    torch.testing.assert_close(zr.grad, closed, rtol=1e-9, atol=1e-12)
    # 3. central finite differences of the reference
    eps = 1e-6
    for idx in [(0, 0, 0), (1, 1, 3), (2, 0, 6)]:
        up, down = z.clone(), z.clone()
        up[idx] += eps
        down[idx] -= eps
        fd = (row_loss("tv", p[:, None], up).sum() - row_loss("tv", p[:, None], down).sum()) / (2 * eps)
        assert math.isclose(float(fd), float(zr.grad[idx]), rel_tol=1e-5, abs_tol=1e-8)


@pytest.mark.parametrize("loss", ACCEPTANCE_LOSSES)
def test_every_acceptance_loss_matches_its_definition_and_gradient(loss):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 3, 9, generator=g, dtype=torch.float64) * 3
    p = torch.softmax(torch.randn(4, 9, generator=g, dtype=torch.float64) * 3, -1)
    weight = (torch.rand(4, 3, generator=g) < 0.7).float()
    zt = z.float().requires_grad_(True)
    loss_sum, _, count = acceptance_loss(_Logits(), None, zt, p.float(), weight, loss, 2.0)
    zr = z.clone().requires_grad_(True)
    ref = (weight.double() * row_loss(loss, p[:, None], zr, eta=2.0)).sum(0)
    torch.testing.assert_close(loss_sum.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(count, weight.sum(0))
    loss_sum.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(zt.grad.double(), zr.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ACCEPTANCE_LOSSES)
def test_acceptance_losses_stay_finite_on_bf16_extremes(loss):
    """bf16 logits far apart, target rows with exact zeros and a draft that puts ~no mass on them."""
    Kv = 64
    z = torch.full((2, 2, Kv), -60.0)
    z[..., 0] = 60.0  # the draft is certain of token 0
    p = torch.zeros(2, Kv)
    p[:, 5] = 1.0  # the target is certain of token 5: alpha underflows to 0
    zt = z.to(torch.bfloat16).requires_grad_(True)
    loss_sum, _, _ = acceptance_loss(_Logits(), None, zt, p, torch.ones(2, 2), loss, 3.0)
    assert torch.isfinite(loss_sum).all()
    loss_sum.sum().backward()
    assert torch.isfinite(zt.grad.float()).all()


# ------------------------------------------------------------------ a few steps of training reduce the loss
@pytest.mark.parametrize("name,loss", [*((v, "forward_kl") for v in VARIANTS), *(("plain", x) for x in ACCEPTANCE_LOSSES)])
def test_a_few_steps_reduce_the_loss(name, loss):
    model = variant_draft(VARIANTS[name])[1] if name in VARIANTS else tiny_draft()[0]
    scorer = tiny_draft()[2]
    objective = None if loss == "forward_kl" else Objective(loss, 3.0)
    samples = random_samples([14, 10, 12], seed=3)
    batch = pack(samples)
    batch.greedy_in_draft = scorer.greedy_in_draft(batch.final)
    probs = scorer.draft_probs(batch.final)
    weights = step_loss_weights(3, 0.8)
    optimizer = torch.optim.Adam([q for q in model.parameters() if q.requires_grad], lr=1e-2)
    losses = []
    for _ in range(12):
        stats = ttt_forward(model, batch, probs, 3, make_attention("reference"), objective=objective)
        loss_value = weighted_loss(stats, stats.count, weights)
        optimizer.zero_grad()
        loss_value.backward()
        optimizer.step()
        losses.append(float(loss_value.detach()))
    assert losses[-1] < 0.8 * losses[0], losses


# ------------------------------------------------------------------ export: what vLLM 0.25.0 reads
def vllm_025_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters (name -> shape) Eagle3LlamaForCausalLM of vLLM 0.25.0 creates from config.json."""
    h, ht = config["hidden_size"], config.get("target_hidden_size", config["hidden_size"])
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd, inter = config.get("head_dim", h // heads), config["intermediate_size"]
    eagle = config.get("eagle_config") or {}
    n_aux = config.get("num_aux_hidden_states") or len(eagle.get("eagle_aux_hidden_state_layer_ids") or [0] * 3)
    layer = "model.layers.0."
    params = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.fc.weight": (h, ht * n_aux),
        "model.norm.weight": (h,),
        layer + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, 2 * h),
        layer + "self_attn.o_proj.weight": (h, heads * hd),
        layer + "mlp.gate_up_proj.weight": (2 * inter, h),
        layer + "mlp.down_proj.weight": (h, inter),
        layer + "input_layernorm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "hidden_norm.weight": (h,),
        "lm_head.weight": (config.get("draft_vocab_size") or config["vocab_size"], h),
        "draft_id_to_target_id": (config.get("draft_vocab_size") or config["vocab_size"],),
    }
    if bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False))):
        params["model.input_norm.weight"] = (ht * n_aux,)
    if config.get("fc_norm", False):
        params.update({f"model.fc_norm.{i}.weight": (ht,) for i in range(n_aux)})
    return params


def vllm_025_load(config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Eagle3LlamaForCausalLM.load_weights of vLLM 0.25.0, strict: every tensor lands in a parameter
    of its shape (vLLM raises for an unknown name and silently skips `input_norm.*` when norm_before_fc
    is off), and every parameter is loaded (vLLM would leave it at its initial value)."""
    params = vllm_025_parameters(config)
    eagle = config.get("eagle_config") or {}
    norm_before_fc = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
    stacked = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
               ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}
    heads = config["num_attention_heads"]
    kv, hd = config["num_key_value_heads"], config["head_dim"]
    rows = {"q": heads * hd, "k": kv * hd, "v": kv * hd, 0: config["intermediate_size"], 1: config["intermediate_size"]}
    filled: dict[str, int] = {}
    for name, tensor in tensors.items():
        assert name not in ("mask_hidden",), name
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        if "input_norm." in name:
            assert norm_before_fc, f"{name} would be skipped: norm_before_fc is off in config.json"
        name = name.replace("midlayer.", "layers.0.")
        for short, (fused, shard) in stacked.items():
            if short in name:
                target = name.replace(short, fused)
                assert target in params, f"vLLM has no parameter {target}"
                assert tuple(tensor.shape) == (rows[shard], params[target][1]), (name, tensor.shape)
                filled[target] = filled.get(target, 0) + tensor.shape[0]
                break
        else:
            assert name in params, f"vLLM has no parameter {name} (it refuses the checkpoint)"
            assert tuple(tensor.shape) == params[name], (name, tuple(tensor.shape), params[name])
            filled[name] = filled.get(name, 0) + tensor.shape[0]
    skipped = {"model.embed_tokens.weight"} if "embed_tokens.weight" not in tensors else set()
    if "d2t" not in tensors:
        skipped.add("draft_id_to_target_id")
    unloaded = {n for n in params if n not in skipped and filled.get(n) != params[n][0]}
    assert not unloaded, f"parameters vLLM would leave unloaded: {sorted(unloaded)}"


@pytest.fixture(scope="module")
def export_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants_export")
    target = sharp_llama(root / "target")
    mapping = write_mapping(root / "mapping.safetensors", 128, list(range(0, 128, 2)))
    return root, str(target), mapping


@pytest.mark.parametrize("name", ["plain", *VARIANTS])
def test_every_variant_exports_what_vllm_loads_and_reloads_for_the_evaluator(export_inputs, name, tmp_path, capsys):
    from safetensors import safe_open

    from eagle3build.draft.vocab import read_mapping

    root, target_path, mapping = export_inputs
    target = load_target_head(target_path)
    d2t, t2d = read_mapping(mapping)
    flags = VARIANTS.get(name, {})
    config = DraftConfig.from_target(target, len(d2t), [2, 3, 3], {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                                    "intermediate_size": 48, **flags})
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(config, target, d2t, t2d)
    with torch.no_grad():
        for module in draft.modules():
            if hasattr(module, "eps"):
                module.weight.add_(0.2 * torch.randn_like(module.weight))
    save_best(tmp_path, draft, config, 1, None)
    export(str(tmp_path / "best.safetensors"), mapping, target_path, str(tmp_path / "export"), {"speculators": True})
    # SGLang would load a variant and serve another function without a word: the export log says so
    said = capsys.readouterr().err
    assert ("serve it with vLLM" in said and "SGLang" in said) == (name != "plain"), said

    exported = json.loads((tmp_path / "export" / "eagle3" / "config.json").read_text())
    for key in DraftConfig.VARIANTS:  # the keys vLLM reads, top level
        assert exported[key] is getattr(config, key), key
    with safe_open(str(tmp_path / "export" / "eagle3" / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert set(tensors) == set(weight_names(config)) | {"d2t", "t2d"}
    vllm_025_load(exported, tensors)
    # speculators format: vLLM's update_eagle3 reads the same four keys at its top level
    spec = json.loads((tmp_path / "export" / "speculators" / "config.json").read_text())
    assert {k: spec[k] for k in DraftConfig.VARIANTS} == {k: getattr(config, k) for k in DraftConfig.VARIANTS}
    assert not set(DraftConfig.VARIANTS) & set(spec["transformer_layer_config"])

    # the evaluator's loader rebuilds the same head, variant included, from ours and a foreign config
    reloaded = load_exported(tmp_path / "export", dtype=torch.float32)
    assert all(getattr(reloaded.config, k) == getattr(config, k) for k in DraftConfig.VARIANTS)
    foreign = {k: v for k, v in exported.items() if k != "eagle3build"}
    (tmp_path / "export" / "eagle3" / "config.json").write_text(json.dumps(foreign))
    from_foreign = load_exported(tmp_path / "export", dtype=torch.float32, target_path=target_path)
    assert all(getattr(from_foreign.config, k) == getattr(config, k) for k in DraftConfig.VARIANTS)
    g = torch.Generator().manual_seed(0)
    ids, aux, pos = torch.randint(0, 128, (1, 6), generator=g), torch.randn(1, 6, 96, generator=g), torch.arange(6)[None]
    outs = []
    for model in (draft.eval(), from_foreign):
        with torch.no_grad():
            out, cache = model.layer(ids, model.project_aux(aux), pos)
            out2, _ = model.layer(ids[:, -1:], model.feedback(out[:, -1:]), torch.tensor([[6]]), cache)
            outs.append(model.logits(torch.cat([out, out2], 1)))
    torch.testing.assert_close(outs[1], outs[0], rtol=0.02, atol=0.02 * float(outs[0].abs().max()))


def test_the_mirror_catches_what_vllm_would_not_load(export_inputs, tmp_path):
    """The mirror is not vacuous: an input_norm without its key, or a variant key without its weights."""
    config = {"hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
              "intermediate_size": 6, "vocab_size": 10, "draft_vocab_size": 10, "target_hidden_size": 4,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    c = DraftConfig(4, 2, 1, 2, 6, 1e-5, 1e4, 64, 10, 10, 4, [1, 2, 3], norm_before_fc=True)
    model = Eagle3Draft(c)
    tensors = {n: t for n, t in model.state_dict().items() if n not in ("embed_tokens.weight", "d2t", "t2d")}
    with pytest.raises(AssertionError, match="norm_before_fc is off"):
        vllm_025_load(config, tensors)
    vllm_025_load({**config, "norm_before_fc": True}, tensors)
    with pytest.raises(AssertionError, match="unloaded"):
        vllm_025_load({**config, "norm_before_fc": True, "fc_norm": True}, tensors)


# ------------------------------------------------------------------ the train stage with a variant and a loss
def test_the_train_stage_runs_a_variant_with_an_acceptance_loss(tmp_path):
    inputs = make_inputs(tmp_path, n_shards=1, samples_per_shard=4)
    params = {**FAST, "epochs": 1, "norm_before_fc": True, "norm_output": True, "loss": "lk_hybrid"}
    summary = train(inputs["shards"], inputs["mapping"], inputs["target"], str(tmp_path / "train"),
                    str(tmp_path / "state"), params)
    assert summary["draft_config"]["norm_before_fc"] and summary["draft_config"]["norm_output"]
    assert math.isfinite(summary["last_train"]["loss"])
    export(str(tmp_path / "train" / "draft.safetensors"), inputs["mapping"], inputs["target"], str(tmp_path / "export"))
    exported = json.loads((tmp_path / "export" / "eagle3" / "config.json").read_text())
    assert exported["norm_before_fc"] is True and exported["norm_output"] is True
    reloaded = load_exported(tmp_path / "export")
    assert reloaded.config.norm_before_fc and hasattr(reloaded, "input_norm")
    assert resolve_section("train", {"loss": "lk_hybrid"})["lk_eta"] == 3.0
