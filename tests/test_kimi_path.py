"""The Kimi-K2.5 path end to end on CPU: the real configs/kimi-k2.5.yaml, with the model, the data and the
sizes swapped for stand-ins (tests/standins/kimi.py: a slow tiktoken tokenizer loaded through auto_map
remote code with a thinking template, and a tiny random DeepSeek-V3, MLA + MoE), through the real
workflow: split -> tokens -> extract (HF backend, fp8 storage as Kimi's) -> vocab -> train -> export ->
evaluate. Then the preflight of that config (the issue's bar: it names no blocked stage), also with
extract.backend and evaluate.backend vllm as Kimi runs them.

Everything not swapped is Kimi's: trust_remote_code, prepare.thinking, fp8 storage, the vLLM server
settings the doctor plans with (TP 8, max_model_len derived), the regenerate section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open
from standins.kimi import write_target
from workflow_util import ROOT, copy_workflow, snakemake, write_config

from eagle3build.data.chat import load_tokenizer
from eagle3build.extraction.job import stop_servers
from eagle3build.shards import read_hidden, read_meta, read_tokens

pytestmark = pytest.mark.slow  # one real workflow run, about 1.5 minutes on 2 cores

KIMI_CONFIG = ROOT / "configs" / "kimi-k2.5.yaml"
AUX = [1, 2, 3]  # of 4 layers: no 0 (vLLM cannot capture layer 0 of a DeepSeek-family target), distinct
EOT = "<|im_end|>"
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def conversations(n: int) -> list[dict]:
    """Thinking turns (reasoning_content) and a tool call with its result, as Kimi's regeneration writes them."""
    rows = []
    for i in range(n):
        if i % 2:
            messages = [
                {"role": "user", "content": f"The weather in Paris, day {i}?"},
                {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 degrees"},
                {"role": "assistant", "content": "Sunny, 21 degrees.", "reasoning_content": "The tool answered."},
            ]
            rows.append({"messages": messages, "tools": TOOLS})
        else:
            messages = [
                {"role": "system", "content": "Think first."},
                {"role": "user", "content": f"What is 6 times {i}?"},
                {"role": "assistant", "content": f"It is {6 * i}.", "reasoning_content": f"6 times {i} is {6 * i}."},
            ]
            rows.append({"messages": messages})
    return rows


def derived_config(kimi: dict, model: Path, data: Path, questions: Path) -> dict:
    """configs/kimi-k2.5.yaml with the stand-ins and CPU sizes; every other key stays Kimi's."""
    cfg = json.loads(json.dumps(kimi))
    cfg["output_root"] = "build"
    cfg["target"].update(model=str(model), revision=None)  # a local folder: nothing to pin
    cfg["datasets"] = [{"name": "kimi", "path": str(data), "format": "openai"}]
    cfg["prepare"].update(max_length=256, shard_size=8)
    cfg["extract"].update(backend="hf", aux_layer_ids=AUX, devices=["cpu"], server_idle_s=30, batch_tokens=2048)
    cfg["extract"]["vllm"]["shared_storage_path"] = None  # the run folder, not /dev/shm
    cfg["vocab"]["draft_vocab_size"] = 64
    cfg["train"].update(gpus=1, epochs=1, max_steps=3, ttt_steps=2, batch_tokens=512, checkpoint_every=3,
                        log_every=1, lr=1e-3)
    cfg["evaluate"].update(backend="hf", k=[1, 2], max_new_tokens=8, device="cpu",
                           sets=[{"name": "mt_bench", "path": str(questions), "max_samples": 2}])
    return cfg


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    model = write_target(root / "target")
    config = json.loads((model / "config.json").read_text())
    config.update(scoring_func="sigmoid", topk_method="noaux_tc")  # as Kimi's and DeepSeek-V3's config.json
    (model / "config.json").write_text(json.dumps(config, indent=1))
    data = root / "kimi.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(16)))
    questions = root / "questions.jsonl"
    questions.write_text("".join(
        json.dumps({"question_id": i, "category": "reasoning", "turns": [f"What is 6 times {i}?"]}) + "\n"
        for i in range(2)
    ))
    kimi = yaml.safe_load(KIMI_CONFIG.read_text())
    cfg = derived_config(kimi, model, data, questions)
    wd = copy_workflow(root / "wf")
    write_config(wd, cfg)
    proc = snakemake(wd, timeout=1500)
    yield {"wd": wd, "cfg": cfg, "kimi": kimi, "model": model, "log": proc.stdout + proc.stderr}
    stop_servers(wd / "build" / ".run")


def test_the_kimi_config_loads_and_keeps_its_choices(kimi_run):
    from eagle3build.config import load_config

    cfg = load_config(KIMI_CONFIG)
    assert cfg["target"]["trust_remote_code"] is True and cfg["prepare"]["thinking"] == "served"
    assert cfg["extract"]["backend"] == "vllm" and cfg["extract"]["storage_dtype"] == "fp8"
    assert cfg["extract"]["vllm"]["tensor_parallel_size"] == 8 and cfg["extract"]["vllm"]["max_model_len"] is None
    assert cfg["evaluate"]["backend"] == "vllm" and cfg["evaluate"]["vllm"]["tensor_parallel_size"] == 8
    assert "allow_mla" not in json.dumps(cfg)
    # the derived config is Kimi's but for the stand-ins
    derived = load_config(kimi_run["wd"] / "config.test.yaml")
    assert derived["prepare"]["thinking"] == "served" and derived["extract"]["storage_dtype"] == "fp8"


def test_every_stage_ran(kimi_run):
    out = kimi_run["wd"] / "build"
    log = kimi_run["log"]
    for rule in ("tokens", "extract", "vocab", "train", "export", "evaluate"):
        assert f"rule {rule}:" in log or f"localrule {rule}:" in log, rule
    assert sorted(p.name for p in (out / "hidden" / "kimi").glob("*.safetensors")) == ["00000.safetensors",
                                                                                       "00001.safetensors"]
    assert (out / "vocab" / "mapping.safetensors").is_file()
    assert (out / "export" / "eagle3" / "model.safetensors").is_file()
    # the EAGLE-3.1 head the config asks for, under the key and weight name vLLM loads
    exported = json.loads((out / "export" / "eagle3" / "config.json").read_text())
    assert kimi_run["kimi"]["train"]["norm_before_fc"] and exported["norm_before_fc"] is True
    hidden = json.loads((kimi_run["model"] / "config.json").read_text())["hidden_size"]
    with safe_open(str(out / "export" / "eagle3" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("input_norm.weight").get_shape() == [3 * hidden]
    # training released the devices the idle extraction server held (a TP-8 vLLM server keeps ~90% of
    # every GPU until its idle timeout): nothing of extraction runs any more
    assert "train: stopped 1 extraction server(s)" in (out / "logs" / "train.log").read_text()
    assert not list((out / ".run").glob("hf-server-*.json"))


def test_the_mask_covers_exactly_the_assistant_parts(kimi_run):
    tok = load_tokenizer(str(kimi_run["model"]), trust_remote_code=True)
    assert not tok.is_fast  # the token-id mask, not offsets
    shard = read_tokens(kimi_run["wd"] / "build" / "tokens" / "kimi" / "00000.safetensors")
    runs = {}
    for i in range(shard.num_samples):
        ids, mask = (t.tolist() for t in shard.sample(i))
        trained = [tok.decode([t for t, m in zip(ids, mask, strict=True) if m])]
        runs[tok.decode(ids)] = trained[0]
    texts = list(runs)
    thinking = next(t for t in texts if "What is 6 times 0?" in t)
    # the newest turn's thinking is trained as Kimi serves it (prepare.thinking: served)
    assert runs[thinking] == "<think>6 times 0 is 0.</think>It is 0." + EOT
    tool = next(t for t in texts if "day 1?" in t)
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    assert runs[tool] == ("<think>Call the tool.</think>" + call + EOT
                          + "<think>The tool answered.</think>Sunny, 21 degrees." + EOT)
    assert "## Return of call_0\nsunny, 21 degrees" in tool  # the tool's answer is context, not trained


def test_hidden_shards_are_fp8_with_the_configured_layer_ids(kimi_run):
    path = kimi_run["wd"] / "build" / "hidden" / "kimi" / "00000.safetensors"
    meta = read_meta(path)
    assert meta["storage_dtype"] == "fp8" and meta["backend"] == "hf"
    assert list(meta["layer_ids"]) == [*AUX, 4]  # the aux ids, then the final id N
    shard = read_hidden(path)
    tokens = read_tokens(kimi_run["wd"] / "build" / "tokens" / "kimi" / "00000.safetensors")
    assert shard.num_samples == tokens.num_samples
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        dtypes = {name: str(f.get_slice(name).get_dtype()) for name in f.keys()}
    assert "F8_E4M3" in dtypes.values(), dtypes


def test_export_names_the_aux_ids_for_vllm_and_sglang(kimi_run):
    config = json.loads((kimi_run["wd"] / "build" / "export" / "eagle3" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM reads these as they are
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]  # SGLang adds 1
    assert config["eagle3build"]["target"] == str(kimi_run["model"])  # as configured


def test_the_eval_report_exists(kimi_run):
    report = json.loads((kimi_run["wd"] / "build" / "eval" / "mt_bench.json").read_text())
    assert report["backend"] == "hf" and report["k"] == [1, 2]
    result = report["sets"]["mt_bench"]
    assert result["questions"] == 2 and result["turns"] == 2
    assert (kimi_run["wd"] / "build" / "eval" / "mt_bench.png").is_file()
    for k in ("1", "2"):
        row = result["k"][k]
        assert row["mean_acceptance_length"] >= 1 and set(row["per_category"]) == {"reasoning"}


def stub_vllm(root: Path) -> Path:
    """What the doctor inspects of an installed vLLM 0.25.0 (the pinned image's), without vLLM: its
    distribution metadata, the public module names of extract_hidden_states and the hidden-states
    connector, and a `vllm` program on PATH. Nothing of it runs."""
    pkg = root / "vllm"
    connector = pkg / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    models = pkg / "model_executor" / "models"
    for folder in (connector, models):
        folder.mkdir(parents=True)
    for folder in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    (connector / "example_hidden_states_connector.py").write_text("class ExampleHiddenStatesConnector:\n    pass\n")
    (models / "extract_hidden_states.py").touch()
    dist = root / "vllm-0.25.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.0\n")
    (root / "bin").mkdir()
    (root / "bin" / "vllm").write_text("#!/bin/sh\nexit 1\n")
    (root / "bin" / "vllm").chmod(0o755)
    return root


def make_doctor(workdir: Path, config: dict, name: str, vllm: Path | None = None) -> subprocess.CompletedProcess:
    """`make doctor CONFIG=...`, as the issue's bar runs it, in the workflow copy."""
    path = write_config(workdir, config, name)
    env = {**os.environ, "PYTHONPATH": f"{workdir}:{ROOT}"}  # the workflow copy's package, if it has one
    if vllm:
        env.update(PYTHONPATH=f"{vllm}:{workdir}:{ROOT}", PATH=f"{vllm / 'bin'}:{os.environ['PATH']}")
    return subprocess.run(["make", "-f", str(ROOT / "Makefile"), "doctor", f"CONFIG={path}",
                           f"PYTHON={sys.executable}", "GPUS=0"], cwd=workdir, capture_output=True,
                          text=True, timeout=300, env=env)


def as_kimi_serves(cfg: dict) -> dict:
    """The derived config with extraction and evaluation through vLLM, as configs/kimi-k2.5.yaml runs them."""
    cfg = json.loads(json.dumps(cfg))
    cfg["extract"]["backend"] = cfg["evaluate"]["backend"] = "vllm"
    del cfg["extract"]["devices"]
    return cfg


def test_doctor_names_no_blocked_stage(kimi_run, tmp_path):
    proc = make_doctor(kimi_run["wd"], kimi_run["cfg"], "doctor.hf.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[fail]" not in proc.stdout and "all checks passed" in proc.stdout
    assert "[ ok ] mask" in proc.stdout and "token ids (no offsets)" in proc.stdout
    # as Kimi runs: vLLM for extraction and evaluation, TP 8, max_model_len from prepare.max_length
    proc = make_doctor(kimi_run["wd"], as_kimi_serves(kimi_run["cfg"]), "doctor.vllm.yaml", stub_vllm(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[fail]" not in proc.stdout and "all checks passed" in proc.stdout
    checks = {line[7:].split(":")[0]: line[:6] for line in proc.stdout.splitlines() if line.startswith("[")}
    for name in ("trust policy", "target config", "tokenizer", "mask", "aux layer ids", "vLLM", "architecture",
                 "sequence length"):
        assert checks[name] == "[ ok ]", (name, proc.stdout)
    assert "MLA target" in proc.stdout and "none 0 (model_type deepseek_v3)" in proc.stdout
    assert "--max-model-len 257" in proc.stdout and "TP 8" in proc.stdout
    assert "vLLM 0.25.0: extract_hidden_states + ExampleHiddenStatesConnector" in proc.stdout
    assert "never aborts" in proc.stdout  # vLLM < 0.33 crashes on an aborted queued request


def test_doctor_without_vllm_names_only_the_missing_engine(kimi_run):
    """Outside the image the one problem is the machine's, with its fix: no stage of the path is refused."""
    proc = make_doctor(kimi_run["wd"], as_kimi_serves(kimi_run["cfg"]), "doctor.novllm.yaml")
    assert proc.returncode != 0
    failed = [line for line in proc.stdout.splitlines() if line.startswith("[fail]")]
    assert failed == ["[fail] vLLM: vLLM is not installed in this Python"], proc.stdout
    assert "make docker-run" in proc.stdout and "extract.backend: hf and evaluate.backend: hf" in proc.stdout
    # evaluation through vLLM needs it too, even when extraction does not
    cfg = as_kimi_serves(kimi_run["cfg"])
    cfg["extract"]["backend"] = "hf"
    proc = make_doctor(kimi_run["wd"], cfg, "doctor.evalvllm.yaml")
    failed = [line for line in proc.stdout.splitlines() if line.startswith("[fail]")]
    assert failed == ["[fail] vLLM: vLLM is not installed in this Python"], proc.stdout
    assert "set evaluate.backend: hf" in proc.stdout


KIMI_K25_CONFIG = {  # what moonshotai/Kimi-K2.5's config.json states about the text model (no weights here)
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
        "num_hidden_layers": 61, "num_attention_heads": 64, "vocab_size": 163840, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "n_routed_experts": 384, "num_experts_per_tok": 8,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "max_position_embeddings": 262144,
    },
}  # fmt: skip


def test_doctor_on_the_kimi_config_with_a_stand_in_folder(tmp_path):
    """The bar as written: `make doctor CONFIG=configs/kimi-k2.5.yaml` with only target.model pointing at
    a stand-in folder (Kimi's config.json, the Kimi-like remote-code tokenizer, a safetensors index for
    the weights' size) and every other key Kimi's: no check fails where vLLM is installed."""
    from standins.kimi import write_tokenizer

    model = write_tokenizer(tmp_path / "Kimi-K2.5")
    (model / "config.json").write_text(json.dumps(KIMI_K25_CONFIG))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 595_000_000_000}}))
    cfg = yaml.safe_load(KIMI_CONFIG.read_text())
    cfg["target"].update(model=str(model), revision=None)
    wd = tmp_path / "wd"
    wd.mkdir()
    proc = make_doctor(wd, cfg, "kimi.yaml", stub_vllm(tmp_path / "site"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[fail]" not in proc.stdout
    for expected in ("[ ok ] mask", "[ ok ] aux layer ids: aux [2, 30, 58] + final 61", "[ ok ] vLLM: vLLM 0.25.0",
                     "[ ok ] architecture: MLA target", "--max-model-len 4097", "StandinTikTokenTokenizer"):
        assert expected in proc.stdout, (expected, proc.stdout)
    # the hub datasets without a pinned revision are a warning, not a blocked stage
    assert "[warn] datasets" in proc.stdout
