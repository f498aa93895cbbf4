"""Two DDP processes (gloo, CPU) train exactly what one process trains on the same global batch."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_train import FAST, make_inputs

from eagle3build.train import train

torch.set_num_threads(1)
PARAMS = {**FAST, "epochs": 3, "batch_tokens": 32, "checkpoint_every": 1000, "val_fraction": 0.2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inputs: dict, out: str) -> None:
    os.environ.update(
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        train(
            inputs["shards"],
            inputs["mapping"],
            inputs["target"],
            f"{out}/out",
            f"{out}/state",
            {**PARAMS, "grad_accum": 1},
        )
    finally:
        torch.distributed.destroy_process_group()


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
