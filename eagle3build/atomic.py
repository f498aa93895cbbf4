"""Atomic outputs: write to a temp file in the destination folder, then rename.

A job killed at any point leaves either the old complete file or nothing under the final name,
never something that looks complete. Temp names start with '.' and end with '.tmp' so that globbing
outputs never picks them up.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temp path next to `final`; on success fsync and rename it onto `final`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=suffix, dir=final.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            if tmp.is_dir():
                import shutil

                shutil.rmtree(tmp)
            else:
                tmp.unlink()
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def save_safetensors_atomic(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
