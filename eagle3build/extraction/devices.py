"""The devices of the HF extraction backend, seen from the shard jobs (which import no torch).

The device list is found once per run and host (`visible_devices`, remembered in the run dir), and each
shard job takes one device for its duration (`device_slot`): an exclusive flock on that device's slot file,
so concurrent jobs never share a GPU and a crashed job frees its slot automatically.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3build.atomic import write_json_atomic
from eagle3build.engine.process import try_lock


def visible_devices(spec, run_dir: str | os.PathLike | None = None) -> list[str]:
    """The devices `extract.devices` names; "auto": every CUDA device torch sees, else the CPU."""
    if spec in (None, "auto"):
        return _cuda_devices(run_dir) or ["cpu"]
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    return [f"cuda:{d}" if isinstance(d, int) or str(d).isdigit() else str(d) for d in spec]


def _cuda_devices(run_dir: str | os.PathLike | None) -> list[str]:
    """torch's CUDA devices, remembered in run_dir for the rest of the run (`forget_devices` at its start and
    end), keyed on what decides them here: the host (a container has its own) and the two
    variables that select GPUs. Only the first job of a run on a host pays for importing torch."""
    key = {"host": socket.gethostname(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "NVIDIA_VISIBLE_DEVICES": os.environ.get("NVIDIA_VISIBLE_DEVICES")}
    cache = Path(run_dir) / f"devices-{key['host']}.json" if run_dir is not None else None
    if cache is not None:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
            known = json.loads(cache.read_text())
            if known["key"] == key:
                return list(known["devices"])
    import torch

    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]
    if cache is not None:
        write_json_atomic(cache, {"key": key, "devices": devices})
    return devices


def forget_devices(run_dir: str | os.PathLike) -> None:
    """Drop the remembered device lists: the next run looks again (GPUs may come and go between runs)."""
    for cache in Path(run_dir).glob("devices-*.json"):
        cache.unlink(missing_ok=True)


@contextlib.contextmanager
def device_slot(run_dir: str | os.PathLike, devices: list[str], poll_s: float = 0.2) -> Iterator[int]:
    """Hold an exclusive flock on one device's slot file for the duration of a shard job.

    flock is released by the kernel when the holder dies, so a SIGKILLed job never leaks a device.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for index, _ in enumerate(devices):
            fd = try_lock(run_dir / f"slot-{index}.lock")
            if fd is None:
                continue
            try:
                yield index
            finally:
                os.close(fd)  # releases the lock
            return
        time.sleep(poll_s)
