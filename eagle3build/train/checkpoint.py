"""A run's state on disk, and the stage's outputs written from it.

State lives in `state_dir/<params hash>/`: `ckpt-<step>.safetensors` (model, AdamW moments, RNG states
as tensors; step, optimiser settings, scheduler and best score as JSON metadata) written atomically
every `checkpoint_every` steps, `best.safetensors` (the best weights under their export names) and
`metrics.jsonl`. A run with the same inputs and params resumes from the last checkpoint; other params
hash to another folder, so an incompatible state is never resumed and none is lost. One trainer at a
time uses `state_dir` (`own_state_dir`: an flock a dead trainer does not hold).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3build import FORMAT_VERSIONS
from eagle3build.atomic import atomic_path, save_safetensors_atomic, write_json_atomic
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.engine.process import try_lock
from eagle3build.errors import UserError
from eagle3build.shards import parse_metadata
from eagle3build.train.distributed import Dist, load_fsdp_state
from eagle3build.train.metrics import log, truncate_metrics


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def params_hash(
    p: dict,
    hidden_paths: list[str],
    mapping_path: str,
    target_config: dict,
    micro_per_step: int,
    target_revision,
) -> str:
    """Identity of a run: what it trains on and how. A resumed run must match it exactly."""
    identity = {
        "format_version": FORMAT_VERSIONS["train"],
        "params": p,
        "micro_batches_per_step": micro_per_step,
        "shards": [[str(x), os.path.getsize(x)] for x in hidden_paths],
        "mapping": _file_digest(mapping_path),
        "target": {k: target_config.get(k) for k in sorted(target_config) if not k.startswith("_")},
        "target_revision": target_revision,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def group_param_names(model: Eagle3Draft, optimizer) -> list[list[str]]:
    """The names of the optimiser's parameters, group by group."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def local_full_state(model: Eagle3Draft, optimizer) -> tuple[dict, dict]:
    """Trainable weights and the optimiser state keyed by parameter name (single process or DDP)."""
    param_names = [n for names in group_param_names(model, optimizer) for n in names]
    opt_state = optimizer.state_dict()
    state = {param_names[idx]: value for idx, value in opt_state["state"].items()}
    return model.trainable_state_dict(), {"state": state, "param_groups": opt_state["param_groups"]}


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = state
    return out


def _set_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng.cpu"])
    if torch.cuda.is_available():
        cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


# ============================================================================================ save
def save_checkpoint(
    run_dir: Path,
    step: int,
    model: Eagle3Draft,
    optimizer,
    scheduler,
    extra: dict,
    keep: int,
    full_state=None,
) -> None:
    """Write `ckpt-<step>` and delete all but the newest `keep`. `full_state` (FSDP2): the (model
    tensors, optimiser state) pair that `fsdp_full_state` gathered on rank 0; without it the state is
    read from `model` and `optimizer`."""
    model_tensors, opt_state = full_state or local_full_state(model, optimizer)
    tensors = {f"model.{n}": t.float() for n, t in model_tensors.items()}
    for name, state in opt_state["state"].items():
        for key, value in state.items():
            tensors[f"optim.{name}.{key}"] = value.detach().cpu()
    tensors.update(_rng_tensors())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt_state["param_groups"]]
    sched = scheduler.state_dict()  # lr_lambdas are plain functions: stored as nulls, rebuilt by train()
    meta = {"step": step, "optimizer_groups": groups, "scheduler": sched, **extra}
    path = run_dir / f"ckpt-{step:08d}.safetensors"
    try:
        save_safetensors_atomic(path, {k: v.contiguous() for k, v in tensors.items()}, meta)
    except UserError as e:  # a full disk: the older checkpoints are still there, a rerun resumes from them
        previous = latest_checkpoint(run_dir)
        kept = f"; the run resumes from {previous.name} when rerun" if previous else ""
        raise UserError(f"{e}{kept}") from e
    for old in sorted(run_dir.glob("ckpt-*.safetensors"))[:-keep]:
        old.unlink()


def save_best(
    run_dir: Path, draft: Eagle3Draft, config: DraftConfig, step: int, val, trainable: dict | None = None
) -> None:
    """`best.safetensors`: the trainable weights (`trainable`: gathered ones, FSDP2), the lm_head also when
    frozen, plus d2t/t2d under the EAGLE-3 names, fp32, with the draft config, step and validation metrics
    as metadata."""
    trainable = draft.trainable_state_dict() if trainable is None else trainable
    tensors = {n: t.float().cpu() for n, t in trainable.items()}
    if "lm_head.weight" not in tensors:  # train.freeze_lm_head: the head still ships its (frozen) rows
        tensors["lm_head.weight"] = draft.lm_head.weight.detach().float().cpu()
    tensors["d2t"], tensors["t2d"] = draft.d2t.cpu(), draft.t2d.cpu()
    save_safetensors_atomic(
        run_dir / "best.safetensors", tensors, {"draft_config": config.to_dict(), "step": step, "val": val}
    )


def write_outputs(out: Path, run_dir: Path, summary: dict) -> None:
    """The stage's outputs: the best weights, the run's metrics and its summary."""
    for name, source in (("draft.safetensors", "best.safetensors"), ("metrics.jsonl", "metrics.jsonl")):
        # a full disk is a UserError that names the space needed (atomic_path)
        with atomic_path(out / name, need_bytes=(run_dir / source).stat().st_size) as tmp:
            shutil.copyfile(run_dir / source, tmp)
    write_json_atomic(out / "summary.json", summary)


# ============================================================================================ ownership
OWNER_LOCK = ".trainer.lock"  # in the state folder: flocked by the trainer that uses it
_owned: dict[str, int] = {}  # state folders this process owns: real path -> the lock's fd


def own_state_dir(state_dir: str | os.PathLike, d: Dist | None = None) -> None:
    """Make this process (rank 0 of `d`; other ranks do nothing) the one trainer of `state_dir`, before
    anything in it is read or written; a UserError naming the folder and the holder's pid if another
    trainer has it. The lock is an flock: a trainer that dies (killed with -9 included) releases it, so a
    stale lock never blocks a rerun."""
    if d is not None and not d.main:
        return
    folder = Path(state_dir)
    key = os.path.realpath(folder)
    if key in _owned:  # this process's earlier train() call in the same folder (it ended in an error)
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = try_lock(folder / OWNER_LOCK)
    if fd is None:
        try:
            holder = (folder / OWNER_LOCK).read_text().split()
        except OSError:
            holder = []
        who = f"pid {holder[0]} on host {holder[1]}" if len(holder) >= 2 else "a process that is starting"
        raise UserError(
            f"{folder}: another trainer is using this checkpoint folder ({who}); two trainers would overwrite "
            f"each other's checkpoints and metrics. Wait for it to finish or stop it "
            f"(kill {holder[0] if holder else '<pid>'}), then rerun")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    _owned[key] = fd


def release_state_dir(state_dir: str | os.PathLike) -> None:
    """Give up the ownership `own_state_dir` took (the lock file stays: removing it would race)."""
    fd = _owned.pop(os.path.realpath(state_dir), None)
    if fd is not None:
        os.close(fd)


# ============================================================================================ resume
def _read_checkpoint(path: Path, expected_hash: str) -> tuple[dict, dict[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = parse_metadata(f.metadata())
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise UserError(
            f"{path}: unreadable checkpoint ({e}); delete it to resume from the one before"
        ) from e
    if meta.get("params_hash") != expected_hash:
        raise UserError(
            f"{path}: checkpoint of params hash {meta.get('params_hash')!r}, expected {expected_hash!r}; "
            "it was moved here from another run; delete it"
        )
    return meta, tensors


def load_checkpoint(
    path: Path, model: Eagle3Draft, optimizer, scheduler, expected_hash: str, fsdp_module=None
) -> dict:
    """Restore a checkpoint into `model` and `optimizer`; with `fsdp_module` (the FSDP2-sharded
    TTTModule around `model`; collective, every rank reads the file) each rank keeps its shards."""
    meta, tensors = _read_checkpoint(path, expected_hash)
    trainable = model.trainable_state_dict()
    for name, value in trainable.items():
        stored = tensors.get(f"model.{name}")
        if stored is None or stored.shape != value.shape:
            raise UserError(
                f"{path}: tensor model.{name} is missing or has shape "
                f"{None if stored is None else tuple(stored.shape)} != {tuple(value.shape)}; delete it"
            )
    weights = {name: tensors[f"model.{name}"] for name in trainable}
    groups = list(zip(meta["optimizer_groups"], group_param_names(model, optimizer), strict=True))
    state = {}
    for name in (n for _, names in groups for n in names):
        entry = {
            k.rsplit(".", 1)[1]: v
            for k, v in tensors.items()
            if k.startswith(f"optim.{name}.") and k.count(".") == name.count(".") + 2
        }
        if entry:
            state[name] = entry
    if fsdp_module is not None:
        load_fsdp_state(fsdp_module, optimizer, weights, state, groups)
    else:
        _load_local_state(model, optimizer, weights, state, groups)
    scheduler.load_state_dict(meta["scheduler"])
    _set_rng(tensors)
    return meta


def _load_local_state(
    model: Eagle3Draft, optimizer, weights: dict, state: dict, groups: list[tuple[dict, list[str]]]
) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name])
    index = {name: i for i, name in enumerate(n for _, names in groups for n in names)}
    param_groups = [{**saved, "params": [index[n] for n in names]} for saved, names in groups]
    optimizer.load_state_dict(
        {"state": {index[n]: v for n, v in state.items()}, "param_groups": param_groups}
    )


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(run_dir.glob("ckpt-*.safetensors"))
    return found[-1] if found else None


def resume(
    run_dir: Path, model: Eagle3Draft, optimizer, scheduler, fsdp_module, total_steps: int, d: Dist
) -> tuple[int, dict]:
    """(the step to start at, the best score so far): the newest checkpoint of this run restored, or a
    fresh start. Metric lines a killed run wrote after its last checkpoint are dropped."""
    start_step, best = 0, {"score": None, "step": None, "val": None}
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        # the run's folder is named by its params hash
        meta = load_checkpoint(ckpt, model, optimizer, scheduler, run_dir.name, fsdp_module)
        start_step, best = int(meta["step"]), meta["best"]
        log(f"resuming {run_dir} at step {start_step}/{total_steps}", d)
    else:
        state_dir = run_dir.parent
        others = (
            sorted(x.name for x in state_dir.glob("*") if x.is_dir() and x.name != run_dir.name)
            if state_dir.is_dir()
            else []
        )
        note = f" (checkpoints of other params kept in {state_dir}: {', '.join(others)})" if others else ""
        log(f"starting fresh: params hash {run_dir.name}{note}", d)
    if d.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(run_dir / "metrics.jsonl", start_step, d)
    return start_step, best
