"""Start training in this process, or across GPUs with torchrun (DDP) — one Snakemake job either way.

    python -m eagle3build.train.launch SPEC.json     # what each torchrun worker runs
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from eagle3build.errors import UserError


def launch(hidden_paths: list[str], mapping_path: str, target: dict, out_dir: str, state_dir: str,
           params: dict) -> dict | None:
    """Train; `params["gpus"]` > 1 runs torchrun with one worker per GPU on this host."""
    params = dict(params)
    gpus = int(params.pop("gpus", 1) or 0)
    spec = {"hidden_paths": hidden_paths, "mapping_path": mapping_path, "target_path": target["path"],
            "target_revision": target.get("revision"), "out_dir": out_dir, "state_dir": state_dir, "params": params}
    if gpus <= 1:
        return run_spec(spec)
    import torch

    available = torch.cuda.device_count()
    if available < gpus:
        raise UserError(f"config key 'train.gpus' asks for {gpus} GPUs but {available} are visible; lower it "
                        f"or run on a bigger host (make run GPUS=N)")
    from eagle3build.train.checkpoint import own_state_dir, release_state_dir

    # Rank 0 takes the folder's lock; checked here too, so a second run fails with its message, not torchrun's.
    own_state_dir(state_dir)
    release_state_dir(state_dir)
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=state_dir, delete=False) as f:
        json.dump(spec, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "-m", "eagle3build.train.launch", f.name]
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
           # the job's host threads (its OMP_NUM_THREADS) split among the ranks; torchrun would pass them on whole
           "OMP_NUM_THREADS": str(rank_threads(gpus))}
    try:
        proc = subprocess.run(cmd, env=env)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise UserError(f"torchrun training with {gpus} GPUs failed (exit {proc.returncode}); see the log above")
    return None


def rank_threads(ranks: int) -> int:
    """Each of `ranks` workers' share of this job's host threads (OMP_NUM_THREADS, else torch's count)."""
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
    return max(1, threads // ranks)


def run_spec(spec: dict) -> dict:
    from eagle3build.train.loop import train

    return train(spec["hidden_paths"], spec["mapping_path"], spec["target_path"], spec["out_dir"],
                 spec["state_dir"], spec["params"], target_revision=spec.get("target_revision"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from eagle3build.engine.process import bind_to_workflow

    bind_to_workflow()  # a worker ends with torchrun (and the workflow), also when torchrun is killed with -9
    with open(argv[0]) as f:
        run_spec(json.load(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
