"""The trust policy: no command runs a model repo's code unless target.trust_remote_code allows it (and,
for hub ids, target.revision pins a commit). The stand-in repo's code writes a marker file when imported
(its tokenizer module and a config module named by `auto_map`), so "the code ran" is a file on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from standins import kimi
from workflow_util import ROOT, copy_workflow, snakemake, write_config

from eagle3build import FORMAT_VERSIONS
from eagle3build.errors import ConfigError
from eagle3build.shards import write_tokens
from eagle3build.trust import check_trust

SHA = "0123456789abcdef0123456789abcdef01234567"
HUB_ID = "standin-org/kimi-standin"
CONFIG_MODULE = '''"""A remote-code config module: importing it is running the repo's code."""
import os
from pathlib import Path

if os.environ.get("STANDIN_REMOTE_CODE_MARKER"):
    Path(os.environ["STANDIN_REMOTE_CODE_MARKER"]).write_text("remote config code ran\\n")

from transformers import DeepseekV3Config


class StandinConfig(DeepseekV3Config):
    pass
'''


def write_repo(folder: Path) -> Path:
    """The Kimi stand-in's tokenizer (auto_map AutoTokenizer) and a DeepSeek-V3-shaped config.json whose
    auto_map sends AutoConfig to the repo's own module; no weights (nothing here loads them)."""
    kimi.write_tokenizer(folder)
    (folder / "configuration_standin.py").write_text(CONFIG_MODULE)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "auto_map": {"AutoConfig": "configuration_standin.StandinConfig"},
        "vocab_size": kimi.vocab_size(), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4096,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


@pytest.fixture
def repo(tmp_path) -> Path:
    return write_repo(tmp_path / "kimi-standin")


@pytest.fixture
def hub(tmp_path) -> dict:
    """A Hugging Face hub cache holding the stand-in as HUB_ID at commit SHA (refs/main -> SHA), offline."""
    home = tmp_path / "hf"
    cache = home / "hub"
    entry = cache / f"models--{HUB_ID.replace('/', '--')}"
    write_repo(entry / "snapshots" / SHA)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(SHA)
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


def marker_env(tmp_path: Path, extra: dict | None = None) -> tuple[Path, dict]:
    marker = tmp_path / "REMOTE_CODE_RAN"
    # a private HF home: remote code modules are copied to HF_HOME/modules when transformers imports them
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           **(extra or {}), "STANDIN_REMOTE_CODE_MARKER": str(marker)}
    return marker, env


def run(args: list[str], env: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def conversations(path: Path) -> Path:
    record = {"messages": [{"role": "user", "content": "Hello!"},
                           {"role": "assistant", "content": "How can I help you today?"}]}
    path.write_text(json.dumps(record) + "\n")
    return path


def workflow_config(tmp_path: Path, model: str, trust: bool, revision: str | None = None) -> dict:
    return {
        "output_root": str(tmp_path / "build"),
        "target": {"model": model, "revision": revision, "trust_remote_code": trust},
        "datasets": [{"name": "chat", "path": str(conversations(tmp_path / "conv.jsonl"))}],
        "prepare": {"max_length": 64},
        "extract": {"backend": "hf"},
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return copy_workflow(tmp_path_factory.mktemp("wf"))


def dry_run(workdir: Path, tmp_path: Path, config: dict, env: dict) -> subprocess.CompletedProcess:
    name = f"config.{tmp_path.name}.yaml"
    write_config(workdir, config, name)
    return snakemake(workdir, "-n", config=name, check=False, timeout=600, env=env)


# ---------------------------------------------------------------- the policy itself
def test_policy_refuses_unpinned_hub_code_and_untrusted_repo_code(repo):
    for revision in (None, "main", "v1.0", SHA[:12]):
        with pytest.raises(ConfigError) as e:
            check_trust({"path": "org/model", "revision": revision, "trust_remote_code": True})
        assert e.value.key == "target.revision" and "40-character commit" in str(e.value)
    check_trust({"path": "org/model", "revision": SHA, "trust_remote_code": True})
    with pytest.raises(ConfigError) as e:
        check_trust({"model": str(repo), "revision": None, "trust_remote_code": False})
    assert e.value.key == "target.trust_remote_code"
    # both auto_maps are named: the tokenizer's code and the config's
    assert "tokenization_standin.StandinTikTokenTokenizer" in str(e.value)
    assert "configuration_standin.StandinConfig" in str(e.value)
    # only a real `true` grants remote code
    with pytest.raises(ConfigError, match="target.trust_remote_code"):
        check_trust({"path": str(repo), "revision": None, "trust_remote_code": "yes"})
    check_trust({"path": str(repo), "revision": None, "trust_remote_code": True})  # a local folder: no pin


# ---------------------------------------------------------------- commands, trust off
def test_dry_run_with_trust_off_refuses_and_runs_no_code(workdir, tmp_path, repo):
    marker, env = marker_env(tmp_path)
    proc = dry_run(workdir, tmp_path, workflow_config(tmp_path, str(repo), trust=False), env)
    assert proc.returncode != 0
    assert "target.trust_remote_code" in proc.stdout + proc.stderr
    assert not marker.exists()


def test_dry_run_with_trust_on_reads_the_config_without_running_code(workdir, tmp_path, repo):
    """Allowed or not, building the DAG reads config.json as JSON: the config module is never imported."""
    marker, env = marker_env(tmp_path)
    proc = dry_run(workdir, tmp_path, workflow_config(tmp_path, str(repo), trust=True), env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens" in proc.stdout + proc.stderr
    assert not marker.exists()


def test_doctor_with_trust_off_refuses_and_runs_no_code(tmp_path, repo):
    marker, env = marker_env(tmp_path)
    config = write_config(tmp_path, workflow_config(tmp_path, str(repo), trust=False))
    proc = run(["-m", "eagle3build.doctor", "--config", str(config), "--stage", "tokens"], env)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "config key 'target.trust_remote_code'" in out and "tokenization_standin" in out
    assert "[skip] tokenizer" in out  # not loaded without the code either
    assert not marker.exists()


def test_prepare_show_with_trust_off_refuses_and_runs_no_code(tmp_path, repo):
    marker, env = marker_env(tmp_path)
    shard = tmp_path / "00000.safetensors"
    write_tokens(shard, [torch.tensor([1, 2, 3])], [torch.tensor([0, 1, 1])],
                 {"tokenizer": str(repo), "revision": None, "tokenizer_class": "StandinTikTokenTokenizer",
                  "max_length": 64})
    config = write_config(tmp_path, workflow_config(tmp_path, str(repo), trust=False))
    for extra in ([], ["--config", str(config)]):
        proc = run(["-m", "eagle3build.data.prepare", "show", str(shard), *extra], env)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "config key 'target.trust_remote_code'" in proc.stderr
    assert not marker.exists()


def test_tokens_job_with_trust_off_refuses_and_runs_no_code(tmp_path, repo):
    marker, env = marker_env(tmp_path)
    conv = conversations(tmp_path / "conv.jsonl")
    log = tmp_path / "logs" / "tokens.log"
    tokenizer = {"path": str(repo), "revision": None, "trust_remote_code": False, "chat_template": None}
    spec = {
        "rule": "tokens",
        "input": {"items": [str(conv)], "names": {"conversations": str(conv), "chat_template": []}},
        "output": {"items": [str(tmp_path / "t.safetensors"), str(tmp_path / "t.json")],
                   "names": {"tokens": str(tmp_path / "t.safetensors"), "report": str(tmp_path / "t.json")}},
        "params": {"items": [tokenizer, 64, FORMAT_VERSIONS["tokens"]],
                   "names": {"tokenizer": tokenizer, "max_length": 64, "version": FORMAT_VERSIONS["tokens"]}},
        "log": [str(log)], "wildcards": {}, "config": {},
    }
    job = tmp_path / "tokens.job.json"
    job.write_text(json.dumps(spec))
    proc = run([str(ROOT / "scripts" / "tokens.py"), str(job)], env)
    assert proc.returncode == 2
    assert "config key 'target.trust_remote_code'" in proc.stderr + log.read_text()
    assert not marker.exists() and not (tmp_path / "t.safetensors").exists()


# ---------------------------------------------------------------- hub ids: trust needs a pinned commit
def test_hub_id_with_trust_on_needs_a_pinned_commit(workdir, tmp_path, hub):
    marker, env = marker_env(tmp_path, hub)
    # refs/main resolves to the snapshot: without the policy its code would load from there
    proc = dry_run(workdir, tmp_path, workflow_config(tmp_path, HUB_ID, trust=True, revision=None), env)
    assert proc.returncode != 0
    assert "config key 'target.revision'" in proc.stdout + proc.stderr
    config = write_config(tmp_path, workflow_config(tmp_path, HUB_ID, trust=True, revision=None), "unpinned.yaml")
    proc = run(["-m", "eagle3build.doctor", "--config", str(config), "--stage", "tokens"], env)
    assert proc.returncode == 2 and "config key 'target.revision'" in proc.stdout
    assert not marker.exists()

    # pinned: the DAG builds (still without running code: config.json is read from the cache as JSON) ...
    proc = dry_run(workdir, tmp_path, workflow_config(tmp_path, HUB_ID, trust=True, revision=SHA), env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not marker.exists()
    # ... and the loaders may run the repo's code from that commit
    config = write_config(tmp_path, workflow_config(tmp_path, HUB_ID, trust=True, revision=SHA), "pinned.yaml")
    proc = run(["-m", "eagle3build.doctor", "--config", str(config), "--stage", "tokens"], env)
    assert "[ ok ] trust policy" in proc.stdout and "pinned at " + SHA in proc.stdout, proc.stdout
    assert "StandinTikTokenTokenizer (remote code)" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert marker.exists()


def test_hub_id_with_trust_off_refuses_a_cached_repo_that_needs_code(tmp_path, hub):
    marker, env = marker_env(tmp_path, hub)
    script = ("from eagle3build.data.chat import load_tokenizer\n"
              f"load_tokenizer({HUB_ID!r}, {SHA!r}, trust_remote_code=False)\n")
    proc = run(["-c", script], env)
    assert proc.returncode != 0 and "config key 'target.trust_remote_code'" in proc.stderr
    assert "with target.revision pinned" in proc.stderr
    assert not marker.exists()
