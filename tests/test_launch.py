"""Training launch: one process, or torchrun with one worker per GPU inside the same Snakemake job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3build.errors import UserError
from eagle3build.train import launch as launch


def test_several_gpus_go_through_torchrun(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, env):
        seen["cmd"], seen["env"] = cmd, env
        seen["spec"] = json.loads(open(cmd[-1]).read())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    launch.launch(["h0.safetensors"], "map.safetensors", {"path": "model", "revision": "abc"}, str(tmp_path / "out"),
                  str(tmp_path / "state"), {"gpus": 4, "lr": 1e-4})
    assert seen["cmd"][:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in seen["cmd"] and seen["cmd"][-2] == "eagle3build.train.launch"
    assert seen["spec"]["params"] == {"lr": 1e-4}  # `gpus` is the launcher's, not the trainer's
    assert seen["spec"]["target_revision"] == "abc"
    assert seen["env"]["NCCL_NVLS_ENABLE"] == "0"  # NVLink multicast stays off
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
