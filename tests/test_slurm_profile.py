"""profiles/slurm: valid for the SLURM executor plugin, with the GPU resources production needs."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "profiles" / "slurm"
RULES = {"split", "regenerate", "tokens", "tokens_regenerated", "extract", "vocab_count", "vocab", "train", "export", "evaluate"}
GPU_RULES = {"extract", "train", "evaluate"}


def profile() -> dict:
    return yaml.safe_load((PROFILE / "config.yaml").read_text())


def test_profile_targets_slurm_with_per_rule_gpu_resources():
    cfg = profile()
    assert cfg["executor"] == "slurm" and cfg["jobs"] >= 1 and cfg["latency-wait"] >= 30
    assert {"runtime", "mem_mb"} <= set(cfg["default-resources"])
    # It replaces profiles/default, so it must keep its staleness rule: no `code` trigger (a pulled
    # rule script must not rerun every extraction; test_workflow checks that on a real build).
    local = yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())
    assert cfg["rerun-triggers"] == local["rerun-triggers"] and "code" not in cfg["rerun-triggers"]
    per_rule = cfg["set-resources"]
    assert set(per_rule) <= RULES, f"unknown rules: {set(per_rule) - RULES}"
    for rule in GPU_RULES:
        res = per_rule[rule]
        assert isinstance(res["gpu"], int) and res["gpu"] >= 1, rule
        # One task owns all the job's GPUs: `tasks` would become --ntasks-per-gpu (N copies of the job)
        # and a cpus_per_gpu would be shadowed by the default cpus_per_task.
        assert "tasks" not in res and "cpus_per_gpu" not in res and res["cpus_per_task"] >= res["gpu"], rule
        assert res["runtime"] > cfg["default-resources"]["runtime"] and res["mem_mb"] >= 64000, rule
    for rule in RULES - GPU_RULES - {"split"}:
        assert "gpu" not in per_rule.get(rule, {}), rule
    assert sum(int(r.split("=")[1]) for r in cfg["resources"] if r.startswith("gpu=")) >= max(
        per_rule[r]["gpu"] for r in GPU_RULES
    )


def _workflow_config(tmp_path: Path) -> Path:
    """A config whose target is a config.json-only Llama (the DAG needs the layer count, not weights)."""
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                    "num_hidden_layers": 8, "vocab_size": 512, "num_attention_heads": 4})
    )  # fmt: skip
    data = tmp_path / "conversations.jsonl"
    rows = [{"id": f"t:{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                          {"role": "assistant", "content": f"a{i}"}]} for i in range(5)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "output_root": str(tmp_path / "build"),
        "target": {"model": str(model)},
        "datasets": [{"name": "demo", "path": str(data)}],
        "prepare": {"shard_size": 2},
        "evaluate": {"sets": [{"name": "held", "path": str(data)}]},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _dry_run(tmp_path: Path, *profile_args: str) -> str:
    if not (REPO / "Snakefile").exists():
        pytest.skip("the workflow's Snakefile is not written yet")
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        pytest.skip("snakemake-executor-plugin-slurm is not installed (requirements-dev.txt)")
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-n",
        "--configfile",
        str(_workflow_config(tmp_path)),
        *profile_args,
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def _resources_by_rule(output: str) -> dict[str, dict[str, str]]:
    found = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", output):
        head = re.match(r"(?:local)?rule (\w+):", block.strip())
        res = re.search(r"^\s*resources: (.*)$", block, re.M)
        if head and res:
            found[head.group(1)] = dict(kv.split("=", 1) for kv in res.group(1).split(", ") if "=" in kv)
    return found


def test_dry_run_as_workflow_profile_requests_the_gpus(tmp_path):
    out = _dry_run(tmp_path, "--workflow-profile", str(PROFILE))
    resources = _resources_by_rule(out)
    wanted = profile()["set-resources"]
    for rule in ("extract", "train", "evaluate"):
        assert resources[rule]["gpu"] == str(wanted[rule]["gpu"]), (rule, resources[rule])
        assert resources[rule]["cpus_per_task"] == str(wanted[rule]["cpus_per_task"]), (rule, resources[rule])
    assert "gpu" not in resources["tokens"] and resources["tokens"]["mem_mb"] == str(
        wanted["tokens"]["mem_mb"]
    )


def test_dry_run_as_global_profile_passes(tmp_path):
    _dry_run(tmp_path, "--profile", str(PROFILE))
