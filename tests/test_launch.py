"""Training launch: one process, or torchrun with one worker per GPU inside the same Snakemake job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3build.errors import UserError
from eagle3build.train import launch as launch

ROOT = Path(__file__).resolve().parents[1]


def test_several_gpus_go_through_torchrun(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, env):
        seen["cmd"], seen["env"] = cmd, env
        seen["spec"] = json.loads(open(cmd[-1]).read())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    monkeypatch.setenv("OMP_NUM_THREADS", "32")  # the job's threads (rules/train.smk)
    launch.launch(["h0.safetensors"], "map.safetensors", {"path": "model", "revision": "abc"}, str(tmp_path / "out"),
                  str(tmp_path / "state"), {"gpus": 4, "lr": 1e-4})
    assert seen["cmd"][:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in seen["cmd"] and seen["cmd"][-2] == "eagle3build.train.launch"
    assert seen["spec"]["params"] == {"lr": 1e-4}  # `gpus` is the launcher's, not the trainer's
    assert seen["spec"]["target_revision"] == "abc"
    assert seen["env"]["NCCL_NVLS_ENABLE"] == "0"  # NVLink multicast stays off
    assert seen["env"]["OMP_NUM_THREADS"] == "8"  # the job's host threads shared by the 4 ranks
    assert not list((tmp_path / "state").glob("*.json"))  # the spec file is removed


def test_more_gpus_than_visible_names_the_key(monkeypatch, tmp_path):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(UserError, match="train.gpus"):
        launch.launch([], "m", {"path": "p"}, str(tmp_path), str(tmp_path), {"gpus": 8})


def test_failed_workers_are_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setattr(launch.subprocess, "run", lambda cmd, env: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(UserError, match="torchrun training with 2 GPUs failed"):
        launch.launch([], "m", {"path": "p"}, str(tmp_path), str(tmp_path / "s"), {"gpus": 2})


@pytest.mark.parametrize("gpus_given", [True, False])
def test_the_train_rule_passes_the_keys_given_not_the_schema_defaults(tmp_path, gpus_given):
    """Snakemake reruns a job whose params changed: the train rule's `train` param is the section as
    written, in its order, plus `gpus` (the schema's default where not given), so defaults the schema
    fills in never retrain a built tree. Read from the parsed workflow of the demo config."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings

    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    if not (model / "config.json").exists():
        pytest.skip("the demo model is absent (make setup)")
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["output_root"] = str(tmp_path / "build")
    config["target"]["model"] = str(model)
    for item in (*config["datasets"], *config["evaluate"]["sets"]):
        item["path"] = str(ROOT / item["path"])
    if not gpus_given:
        del config["train"]["gpus"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    with SnakemakeApi(OutputSettings()) as api:
        workflow = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[tmp_path / "config.yaml"]),
            snakefile=ROOT / "Snakefile",
            workdir=tmp_path,
        )._workflow  # parses the Snakefile, as a dry-run does
        param, filled = workflow.get_rule("train").params.train, workflow.config["train"]
    assert list(param.items()) == list({**config["train"], "gpus": 1}.items())
    assert set(filled) > set(param) and filled["ttt_steps"] == config["train"]["ttt_steps"]  # defaults filled
