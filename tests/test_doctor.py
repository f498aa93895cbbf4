"""Preflight checks against real tokenizers (../shared) and small model folders built here."""

from __future__ import annotations

import json
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from eagle3build import doctor
from eagle3build.errors import UserError
from eagle3build.shards import hidden_bytes_per_token, write_tokens

torch.set_num_threads(1)
SHARED = Path(__file__).resolve().parents[2] / "shared"
LLAMA31 = SHARED / "assets" / "tokenizers" / "llama3_1"
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
}  # fmt: skip
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
                    "kv_lora_rank": 512, "max_position_embeddings": 262144},
}  # fmt: skip
TOKENIZATION_X = '''
from transformers import PreTrainedTokenizerFast


class XTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class shipped with the model, like Kimi's TikTokenTokenizer."""
'''


def need_llama31():
    if not LLAMA31.exists():
        pytest.skip("../shared/assets/tokenizers/llama3_1 is absent (a clone without the shared assets)")


def model_dir(tmp_path: Path, config: dict, remote_tokenizer: bool = False) -> Path:
    """The llama3_1 tokenizer plus a config.json (no weights): enough for every preflight check."""
    need_llama31()
    d = tmp_path / "model"
    shutil.copytree(LLAMA31, d)
    (d / "config.json").write_text(json.dumps(config))
    if remote_tokenizer:
        (d / "tokenization_x.py").write_text(TOKENIZATION_X)
        tc = json.loads((d / "tokenizer_config.json").read_text())
        tc["auto_map"] = {"AutoTokenizer": [None, "tokenization_x.XTokenizer"]}
        tc["tokenizer_class"] = "XTokenizer"
        (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


def make_config(tmp_path: Path, model: Path | str, **sections) -> dict:
    cfg = {
        "output_root": str(tmp_path / "build"),
        "target": {"model": str(model), "revision": None, "trust_remote_code": False},
        "prepare": {"max_length": 2048},
        "extract": {"backend": "hf", "storage_dtype": "bf16", "aux_layer_ids": None, "vllm": {}},
        "vocab": {"draft_vocab_size": 32000},
        "train": {"gpus": 1},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def failure(config: dict, stage: str = "all") -> str:
    with pytest.raises(UserError) as e:
        doctor.preflight(config, stage)
    return str(e.value)


def test_a_good_hf_config_passes_and_reports_what_it_found(tmp_path):
    checks = by_name(doctor.preflight(make_config(tmp_path, model_dir(tmp_path, LLAMA31_8B))))
    assert all(c.status in ("ok", "skip") for c in checks.values()), checks
    assert "128256 tokens" in checks["tokenizer"].detail
    assert "[2, 16, 29, 32]" in checks["aux layer ids"].detail
    assert checks["vLLM"].status == "skip"  # backend hf needs no vLLM
    assert f"{hidden_bytes_per_token(4096, 'bf16') / 1e3:.1f} GB per million" in checks["disk"].detail


def test_vllm_backend_without_vllm_fails_with_the_fallback(tmp_path):
    if "vllm" in sys.modules or __import__("importlib").util.find_spec("vllm"):
        pytest.skip("vLLM is installed here")
    msg = failure(
        make_config(tmp_path, model_dir(tmp_path, LLAMA31_8B), extract={"backend": "vllm"}), "extract"
    )
    assert "vLLM is not installed" in msg and "extract.backend: hf" in msg


def _fake_vllm(root: Path, connector: bool, method: bool) -> None:
    pkg = root / "vllm"
    (pkg / "distributed" / "kv_transfer" / "kv_connector" / "v1").mkdir(parents=True)
    (pkg / "model_executor" / "models").mkdir(parents=True)
    for d in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    if connector:
        (pkg / "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py").write_text(
            "class ExampleHiddenStatesConnector:\n    pass\n"
        )
    if method:
        (pkg / "model_executor/models/extract_hidden_states.py").touch()
    (root / "bin").mkdir()
    (root / "bin" / "vllm").write_text("#!/bin/sh\n")
    (root / "bin" / "vllm").chmod(0o755)


@pytest.mark.parametrize(
    "connector, method, expected",
    [(False, True, "lacks the ExampleHiddenStatesConnector"), (True, False, "lacks the extract_hidden_states"),
     (True, True, None)],
)  # fmt: skip
def test_vllm_features_are_detected_by_their_public_names(tmp_path, monkeypatch, connector, method, expected):
    _fake_vllm(tmp_path / "site", connector, method)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PATH", f"{tmp_path / 'site' / 'bin'}:/usr/bin:/bin")
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    ctx = doctor.Context(make_config(tmp_path, "unused", extract={"backend": "vllm"}))
    try:
        check = doctor.check_vllm(ctx)
    finally:
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
    if expected:
        assert check.status == "fail" and expected in check.detail and "extract.backend: hf" in check.fix
    else:
        assert check.status == "ok", check


def test_mla_target_under_vllm_is_supported_and_says_what_was_checked(tmp_path):
    model = model_dir(tmp_path, KIMI_K25)
    ctx = doctor.Context(make_config(tmp_path, model, extract={"backend": "vllm"}))
    assert doctor.check_target_config(ctx).status == "ok"
    check = doctor.check_architecture(ctx)
    assert check.status == "ok" and "MLA target (kv_lora_rank 512)" in check.detail
    assert "one KV-cache group" in check.detail and "DeepSeek-V3" in check.detail
    # The memory plan counts the connector's cache on every GPU: n_ids x H x 2 bytes, not split by TP.
    length = doctor.check_max_len(ctx)
    assert "--max-model-len 2049" in length.detail  # prepare.max_length + 1, not Kimi's 262,144
    assert "KV cache 70.3 kB + hidden-state cache 57.3 kB" in length.detail  # (512 + 64) x 61 x 2; 4 x 7168 x 2
    assert "not split by tensor parallel" in length.detail
    # vLLM's DeepSeek decoder cannot capture layer 0, and no engine returns a repeated layer twice.
    for aux, expected in (([0, 30, 58], "captures layer 0"), ([2, 30, 30], "repeats a layer")):
        ctx = doctor.Context(make_config(tmp_path, model, extract={"backend": "vllm", "aux_layer_ids": aux}))
        doctor.check_target_config(ctx)
        check = doctor.check_layers(ctx)
        assert check.status == "fail" and expected in check.detail and "extract.aux_layer_ids" in check.detail
    ctx = doctor.Context(make_config(tmp_path, model, extract={"backend": "hf", "aux_layer_ids": [0, 30, 30]}))
    doctor.check_target_config(ctx)
    assert doctor.check_layers(ctx).status == "ok"  # the HF backend captures both
    ctx = doctor.Context(make_config(tmp_path, model, extract={"backend": "hf"}))
    doctor.check_target_config(ctx)
    assert doctor.check_architecture(ctx).status == "ok"
    # The text config of a multimodal target gives the layers: Kimi's default aux ids.
    assert "[2, 30, 58, 61]" in doctor.check_layers(ctx).detail


def test_remote_code_tokenizer_without_trust_names_the_key(tmp_path):
    model = model_dir(tmp_path, LLAMA31_8B, remote_tokenizer=True)
    msg = failure(make_config(tmp_path, model), "tokens")
    assert "target.trust_remote_code" in msg and "tokenization_x.XTokenizer" in msg


def test_remote_code_tokenizer_with_trust_loads_the_custom_class(tmp_path):
    model = model_dir(tmp_path, LLAMA31_8B, remote_tokenizer=True)
    checks = by_name(
        doctor.preflight(make_config(tmp_path, model, target={"trust_remote_code": True}), "tokens")
    )
    assert checks["tokenizer"].detail.startswith("XTokenizer (remote code)")
    assert "local folder" in checks["trust policy"].detail


@pytest.mark.parametrize("revision", [None, "main", "v1.0"])
def test_trusted_hub_model_needs_a_pinned_commit(tmp_path, revision):
    cfg = make_config(
        tmp_path, "someorg/some-model", target={"trust_remote_code": True, "revision": revision}
    )
    ctx = doctor.Context(cfg)
    check = doctor.check_trust_policy(ctx)
    assert check.status == "fail" and "target.revision" in check.detail and "commit" in check.fix
    assert doctor.check_tokenizer(ctx).status == "skip"  # unpinned remote code is never run
    cfg["target"]["revision"] = "0123456789abcdef0123456789abcdef01234567"
    assert doctor.check_trust_policy(doctor.Context(cfg)).status == "ok"


def test_real_qwen3_tokenizer_ids_must_fit_the_model_vocab(tmp_path):
    qwen3 = SHARED / "assets" / "tokenizers" / "qwen3"
    if not qwen3.exists():
        pytest.skip("../shared/assets/tokenizers/qwen3 is absent")
    d = tmp_path / "qwen"
    shutil.copytree(qwen3, d)
    # Qwen3's embeddings are padded: vocab_size 151936 > 151669 tokens is fine ...
    (d / "config.json").write_text(json.dumps({**LLAMA31_8B, "model_type": "qwen3", "vocab_size": 151936}))
    assert by_name(doctor.preflight(make_config(tmp_path, d), "tokens"))["vocab sizes"].status == "ok"
    # ... a model vocab smaller than the tokenizer's ids is not.
    (d / "config.json").write_text(json.dumps({**LLAMA31_8B, "model_type": "qwen3", "vocab_size": 151000}))
    msg = failure(make_config(tmp_path, d), "tokens")
    assert "ids up to 151668" in msg and "vocab_size 151000" in msg


@pytest.mark.parametrize("draft, fragment", [(200000, "exceeds"), (128256, "equals")])
def test_draft_vocab_must_be_smaller_than_the_target_vocab(tmp_path, draft, fragment):
    cfg = make_config(tmp_path, model_dir(tmp_path, LLAMA31_8B), vocab={"draft_vocab_size": draft})
    msg = failure(cfg, "tokens")
    assert "vocab.draft_vocab_size" in msg and fragment in msg


@pytest.mark.parametrize("ids", [[2, 16, 32], [16, 2, 29], [-1, 16, 29], [2, 16]])
def test_layer_ids_out_of_range_name_the_key(tmp_path, ids):
    ctx = doctor.Context(make_config(tmp_path, "unused", extract={"aux_layer_ids": ids}))
    ctx.target_config = LLAMA31_8B
    check = doctor.check_layers(ctx)
    assert check.status == "fail" and "extract.aux_layer_ids" in check.detail and "[0, 31]" in check.detail


def test_repeated_layer_ids_are_allowed(tmp_path):
    """A tiny target's default (2, 2, 2) and single-stream ablations repeat a layer; order still matters."""
    ctx = doctor.Context(make_config(tmp_path, "unused", extract={"aux_layer_ids": [29, 29, 29]}))
    ctx.target_config = LLAMA31_8B
    assert doctor.check_layers(ctx).status == "ok"


def test_max_model_len_must_hold_a_sample(tmp_path):
    ctx = doctor.Context(
        make_config(tmp_path, "unused", extract={"backend": "vllm", "vllm": {"max_model_len": 2048}})
    )
    check = doctor.check_max_len(ctx)
    assert check.status == "fail" and "extract.vllm.max_model_len" in check.fix


def test_disk_estimate_counts_tokens_not_yet_extracted(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, "unused", extract={"storage_dtype": "fp8"})
    root = Path(cfg["output_root"])
    for shard, n in (("00000", 1000), ("00001", 3000)):
        write_tokens(root / "tokens" / "ds" / f"{shard}.safetensors", [torch.zeros(n, dtype=torch.int32)],
                     [torch.ones(n, dtype=torch.uint8)], {})  # fmt: skip
    (root / "hidden" / "ds").mkdir(parents=True)
    (root / "hidden" / "ds" / "00000.safetensors").touch()  # already extracted: not counted
    ctx = doctor.Context(cfg)
    ctx.target_config = LLAMA31_8B
    need = 3000 * hidden_bytes_per_token(4096, "fp8")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, need + 2e9))
    check = doctor.check_disk(ctx)
    assert check.status == "ok" and "1 shards / 3,000 tokens" in check.detail
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, need))  # no room for the reserve
    check = doctor.check_disk(ctx)
    assert check.status == "fail" and "fp8" in check.fix


def test_gpu_checks_skip_on_cpu_and_count_devices_on_gpu(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, "unused", extract={"backend": "vllm", "vllm": {"tensor_parallel_size": 8}})
    ctx = doctor.Context(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor.check_gpus(ctx, "extract").status == "skip"
    props = namedtuple("props", "total_memory")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props(80e9))
    check = doctor.check_gpus(ctx, "extract")
    assert check.status == "fail" and "needs 8 GPUs, 4 visible" in check.detail
    cfg["extract"]["vllm"]["tensor_parallel_size"] = 4
    assert doctor.check_gpus(doctor.Context(cfg), "extract").status == "ok"


def test_command_line_prints_each_check_and_exits_2_on_failure(tmp_path, capsys):
    import yaml

    model = model_dir(tmp_path, LLAMA31_8B)
    cfg = make_config(tmp_path, model, extract={"aux_layer_ids": [2, 16, 40]})
    cfg["datasets"] = [{"name": "demo", "path": str(tmp_path / "d.jsonl")}]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert doctor.main(["--config", str(path), "--stage", "extract"]) == 2
    out, err = capsys.readouterr()
    assert "[ ok ] tokenizer" in out and "[fail] aux layer ids" in out
    assert "error: preflight found 1 problem" in err and "extract.aux_layer_ids" in err


def test_kimi_config_is_valid_and_refused_until_pinned(tmp_path):
    from eagle3build.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "kimi-k2.5.yaml")
    assert (
        cfg["extract"]["aux_layer_ids"] == [2, 30, 58] and cfg["extract"]["vllm"]["tensor_parallel_size"] == 8
    )
    assert cfg["target"]["trust_remote_code"] is True and cfg["extract"]["storage_dtype"] == "fp8"
    ctx = doctor.Context(cfg)
    check = doctor.check_trust_policy(ctx)
    assert check.status == "fail" and "PIN-ME" in check.detail
    assert doctor.check_tokenizer(ctx).status == "skip"  # its remote code is not run unpinned
    ctx.full_config, ctx.target_config = KIMI_K25, KIMI_K25["text_config"]  # what the hub config holds
    assert doctor.check_architecture(ctx).status == "ok"  # MLA: one KV-cache group
    assert doctor.check_layers(ctx).status == "ok" and doctor.check_max_len(ctx).status == "ok"


def test_attention_kernel_is_checked_on_the_gpu_only(tmp_path, monkeypatch):
    """train.attention flash is run against fp32 math where a GPU is visible; a kernel that fails
    there names the key; elsewhere the check is skipped (training runs it on its own GPU)."""
    from eagle3build.attention import kernel as kernel_attention

    cfg = make_config(tmp_path, "unused", train={"attention": "flash"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor.check_attention(doctor.Context(cfg)).status == "skip"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def fake_check(impl, device):
        calls.append((impl, device))
        if len(calls) == 1:  # the first check meets a torch whose kernel does not run
            raise RuntimeError("attention kernel 'flash' does not run in torch X on cuda: TypeError: ...")
        return {"out": 1e-3, "dq": 4e-3}

    monkeypatch.setattr(kernel_attention, "check_kernel", fake_check)
    check = doctor.check_attention(doctor.Context(cfg))
    assert check.status == "fail" and "'flash' does not run" in check.detail and "train.attention: flex" in check.fix
    check = doctor.check_attention(doctor.Context(cfg))
    assert check.status == "ok" and "dq 4.0e-03" in check.detail
    assert calls == [("flash", "cuda"), ("flash", "cuda")]
    cfg["train"]["attention"] = "flex"
    assert doctor.check_attention(doctor.Context(cfg)).status == "ok" and len(calls) == 2


def test_a_deepseek_v3_router_vllm_would_compute_otherwise_is_flagged(tmp_path):
    """vLLM defaults scoring_func to softmax; DeepSeek-V3 routes with sigmoid (what HF computes). A config
    that does not say so (as transformers writes it) gives other states under the vllm backend."""
    written = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
               "num_hidden_layers": 8, "vocab_size": 1000, "kv_lora_rank": 16, "n_routed_experts": 8}
    ctx = doctor.Context(make_config(tmp_path, "unused", extract={"backend": "vllm"}))
    ctx.full_config = ctx.target_config = written
    check = doctor.check_architecture(ctx)
    assert check.status == "warn" and "scoring_func: sigmoid" in check.fix and "topk_method: noaux_tc" in check.fix
    ctx.full_config = ctx.target_config = {**written, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    assert doctor.check_architecture(ctx).status == "ok"
