"""Two DDP or FSDP2 processes (gloo, CPU) train exactly what one process trains on the same global batch."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_train import FAST, make_inputs

from eagle3build.train.loop import train

PARAMS = {**FAST, "epochs": 3, "batch_tokens": 32, "checkpoint_every": 1000, "val_fraction": 0.2}


@pytest.fixture(autouse=True)
def one_thread():
    """The single-process reference runs here with the workers' one thread: the same float sums. (A module-level
    setting would be overridden by whichever test module pytest imports last.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inputs: dict, out: str, params: dict | None = None) -> None:
    os.environ.update(
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    if (params or {}).get("fsdp"):
        _expect_fsdp2_shards()
    try:
        train(
            inputs["shards"],
            inputs["mapping"],
            inputs["target"],
            f"{out}/out",
            f"{out}/state",
            params or {**PARAMS, "grad_accum": 1},
        )
    finally:
        torch.distributed.destroy_process_group()


def _expect_fsdp2_shards() -> None:
    """Make this rank's train() fail unless FSDP2 really shards the weights (each rank holds part)."""
    from torch.distributed.tensor import DTensor

    from eagle3build.train import loop as train_mod

    shard = train_mod.shard_fsdp2

    def checked(module, device):
        module = shard(module, device)
        weight = module.draft.fc.weight
        assert isinstance(weight, DTensor) and weight.to_local().shape[0] < weight.shape[0], type(weight)
        return module

    train_mod.shard_fsdp2 = checked


def _last_state(out) -> dict:
    ckpt = sorted(out.glob("state/*/ckpt-*.safetensors"))[-1]
    return {k: v for k, v in load_file(str(ckpt)).items() if k.startswith(("model.", "optim."))}


def test_two_ranks_equal_one_process_with_the_same_global_batch(tmp_path):
    inputs = make_inputs(tmp_path / "in", n_shards=1, samples_per_shard=8)
    single = train(
        inputs["shards"],
        inputs["mapping"],
        inputs["target"],
        str(tmp_path / "single" / "out"),
        str(tmp_path / "single" / "state"),
        {**PARAMS, "grad_accum": 2},
    )
    mp.spawn(_worker, args=(2, _free_port(), inputs, str(tmp_path / "ddp")), nprocs=2, join=True)
    ddp_summary = (tmp_path / "ddp" / "out" / "summary.json").read_text()
    assert '"world_size": 2' in ddp_summary
    a, b = _last_state(tmp_path / "single"), _last_state(tmp_path / "ddp")
    assert single["steps"] >= 3 and set(a) == set(b)
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-5), (name, (a[name] - b[name]).abs().max())
    # the runs really moved the weights (not a trivially equal pair of untouched models)
    assert float(a["optim.fc.weight.exp_avg"].abs().sum()) > 0


FSDP_PARAMS = {**PARAMS, "epochs": 4, "checkpoint_every": 2, "keep_checkpoints": 100}


def test_fsdp2_two_ranks_equal_one_process_and_resume_exactly(tmp_path):
    """FSDP2 (train.fsdp) with gradient accumulation: 2 ranks x 2 micro-batches == 1 process x 4;
    gathered checkpoints and the final weights match, and a resume from a mid-run FSDP2 checkpoint
    continues bit-for-bit."""
    inputs = make_inputs(tmp_path / "in", n_shards=1, samples_per_shard=8)
    single = train(
        inputs["shards"],
        inputs["mapping"],
        inputs["target"],
        str(tmp_path / "single" / "out"),
        str(tmp_path / "single" / "state"),
        {**FSDP_PARAMS, "grad_accum": 4},
    )
    fsdp_params = {**FSDP_PARAMS, "grad_accum": 2, "fsdp": True}
    mp.spawn(
        _worker, args=(2, _free_port(), inputs, str(tmp_path / "fsdp"), fsdp_params), nprocs=2, join=True
    )
    summary = json.loads((tmp_path / "fsdp" / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["params"]["fsdp"] is True
    assert summary["steps"] == single["steps"] >= 4 and summary["best_step"] == single["best_step"]
    a, b = _last_state(tmp_path / "single"), _last_state(tmp_path / "fsdp")
    assert set(a) == set(b) and any(k.endswith(".exp_avg_sq") for k in b)
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-5), (name, (a[name] - b[name]).abs().max())
    assert float(a["optim.fc.weight.exp_avg"].abs().sum()) > 0
    # the final weights (written by rank 0 from the gathered shards) equal the single process's
    wa = load_file(str(tmp_path / "single" / "out" / "draft.safetensors"))
    wb = load_file(str(tmp_path / "fsdp" / "out" / "draft.safetensors"))
    assert set(wa) == set(wb) and "lm_head.weight" in wb
    for name in wa:
        assert wa[name].shape == wb[name].shape and wa[name].dtype == wb[name].dtype, name
        assert torch.allclose(wa[name].double(), wb[name].double(), atol=1e-6, rtol=1e-5), name

    # resume: drop every checkpoint after step 2, run again; the result is the uninterrupted run's
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp" / "state", resumed / "state")
    ckpts = sorted(resumed.glob("state/*/ckpt-*.safetensors"))
    assert [c.name for c in ckpts][:1] == ["ckpt-00000002.safetensors"] and len(ckpts) >= 2
    for c in ckpts[1:]:
        c.unlink()
    mp.spawn(_worker, args=(2, _free_port(), inputs, str(resumed), fsdp_params), nprocs=2, join=True)
    again = json.loads((resumed / "out" / "summary.json").read_text())
    assert again["resumed_from_step"] == 2 and again["params_hash"] == summary["params_hash"]
    c = _last_state(resumed)
    assert set(c) == set(b)
    for name in b:
        assert torch.equal(b[name], c[name]), (name, (b[name] - c[name]).abs().max())
