"""What a run reports: `metrics.jsonl` lines and TensorBoard scalars (rank 0), the progress bar, and the
throughput in tokens per second. Metric names are in docs/TRAINING.md (Loss and metrics)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from eagle3build.atomic import atomic_path, is_no_space, no_space_error
from eagle3build.errors import UserError
from eagle3build.train.distributed import Dist
from eagle3build.ttt.loss import summarize


def log(msg: str, d: Dist) -> None:
    if d.main:
        print(f"[train] {msg}", file=sys.stderr, flush=True)


def record(entry: dict, path: Path, writer) -> None:
    """One metrics.jsonl line, and its scalars in TensorBoard (`writer`, if any)."""
    line = json.dumps(entry) + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
    except OSError as e:  # a full disk: a torn last line at worst, which resume drops
        if is_no_space(e):
            raise no_space_error(path, len(line), e) from e
        raise
    if writer is None:
        return
    split, step = entry["split"], entry["step"]
    writer.add_scalar(f"{split}/loss", entry["loss"], step)
    writer.add_scalar(f"{split}/acceptance_length", entry["acceptance_length"], step)
    for s, (loss, acc) in enumerate(zip(entry["step_loss"], entry["step_acc"], strict=True)):
        writer.add_scalar(f"{split}/loss_step{s}", loss, step)
        writer.add_scalar(f"{split}/acc_step{s}", acc, step)
    for key in ("lr", "tokens_per_s", "grad_norm"):
        if entry.get(key) is not None:
            writer.add_scalar(f"{split}/{key}", entry[key], step)


def _metric_lines(path: Path, d: Dist) -> list[tuple[str, dict]]:
    """The (line, record) pairs of a metrics.jsonl. A torn last line (a run killed, or a disk filled, while
    writing it) is dropped with a note; any other line that is no record is an error naming it."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
                raise ValueError("not a record with an integer 'step'")
        except ValueError as e:  # JSONDecodeError is a ValueError
            if number == len(lines):
                log(f"{path}: dropped its torn last line {number} (written by a run that was stopped)", d)
                break
            raise UserError(f"{path}: line {number} is not a metrics record ({e}); the file was damaged or "
                            "edited. Delete that line (or the file: the lines after the last checkpoint are "
                            "written again) and rerun") from None
        out.append((line, entry))
    return out


def truncate_metrics(path: Path, step: int, d: Dist) -> None:
    """Drop metric lines a killed run wrote after its last checkpoint (they will be written again), and a
    torn last line."""
    if not path.exists():
        return
    keep = [line for line, entry in _metric_lines(path, d) if entry["step"] <= step]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in keep))


class TrainLog:
    """The reports of one run from `start_step` on: metric lines in `run_dir/metrics.jsonl` and
    TensorBoard (`out/tb`) from rank 0, the progress bar, and the tokens trained on."""

    def __init__(self, out: Path, run_dir: Path, start_step: int, total_steps: int, d: Dist):
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.path, self.d = run_dir / "metrics.jsonl", d
        self.writer = SummaryWriter(str(out / "tb"), purge_step=start_step + 1) if d.main else None
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="train", disable=not d.main, dynamic_ncols=True
        )
        self.tokens_seen, self.window_tokens, self.window_start = 0, 0, time.perf_counter()
        self.last_train: dict | None = None

    def step_done(self, real_tokens: int, device: torch.device) -> None:
        """Count a step's tokens (all ranks'; padding is not counted)."""
        d = self.d
        # one process: no device tensor, so no wait for the GPU here (the host runs ahead into the next step)
        step_tokens = (
            real_tokens
            if d.world_size == 1
            else int(d.all_sum(torch.tensor(float(real_tokens), device=device)))
        )
        self.tokens_seen += step_tokens
        self.window_tokens += step_tokens
        self.bar.update(1)

    def train(self, step: int, sums: torch.Tensor, weights: torch.Tensor, lr: float, grad_norm) -> None:
        """The training metrics since the last line: `sums` [3, k] (loss, correct, count per TTT step)
        summed over all ranks (collective)."""
        self.d.all_sum(sums)
        now = time.perf_counter()
        self.last_train = {
            "step": step,
            "split": "train",
            **summarize(sums[0], sums[1], sums[2], weights),
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens_per_s": self.window_tokens / max(now - self.window_start, 1e-9),
        }
        self.window_tokens, self.window_start = 0, now
        if self.d.main:
            record(self.last_train, self.path, self.writer)
            self.bar.set_postfix(
                loss=f"{self.last_train['loss']:.3f}",
                acc0=f"{self.last_train['step_acc'][0]:.3f}",
                tau=f"{self.last_train['acceptance_length']:.2f}",
            )

    def val(self, step: int, val: dict | None) -> None:
        if val is not None and self.d.main:
            record({"step": step, "split": "val", **val}, self.path, self.writer)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
