"""Atomic outputs: write to a temp file in the destination folder, then rename.

A job killed at any point leaves either the old complete file or nothing under the final name,
never something that looks complete. Temp names start with '.' and end with '.tmp' so that globbing
outputs never picks them up.

A killed writer cannot remove its temp file (SIGKILL, power loss), so the next writer of the same final
name does: every writer holds an flock on its temp file while it writes, and a temp of its own final name
that nobody holds a lock on is a dead writer's leftover (the kernel drops a lock when its holder dies).
Running out of disk space is an error the user can fix: it is reported as a UserError naming the folder
and the space the file needs, and the final name keeps its previous content.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from eagle3build.errors import UserError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_MKSTEMP_TAIL = r"[a-z0-9_]{8}"  # tempfile's random part of a name


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def remove_stale_temps(final: str | os.PathLike, suffix: str = ".tmp") -> list[Path]:
    """Delete the temp files of `final` left by writers that died (no process holds their lock).
    Returns what was removed."""
    final = Path(final)
    pattern = re.compile(re.escape(f".{final.name}.") + _MKSTEMP_TAIL + re.escape(suffix))
    prefix = f".{final.name}."
    try:
        candidates = [e.name for e in os.scandir(final.parent) if e.name.startswith(prefix)]
    except FileNotFoundError:
        return []
    removed = []
    for name in candidates:
        if not pattern.fullmatch(name):
            continue
        path = final.parent / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or unreadable: not ours to judge
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it (or this filesystem has no locks: liveness unknown, keep it)
            os.close(fd)
            continue
        try:
            _remove(path)  # under the lock: a writer that locks it now finds it gone and starts over
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _locked_temp(final: Path, suffix: str) -> tuple[int, Path]:
    """A new temp file next to `final`, exclusively flocked: (its fd, its path)."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=suffix, dir=final.parent)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: write unlocked (its temps are never judged stale)
            return fd, Path(tmp)
        except BaseException:  # interrupted (a signal's SystemExit) while waiting for a cleaner
            os.close(fd)
            _remove(Path(tmp))
            raise
        try:  # another writer's cleanup may have taken it between mkstemp and flock
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, Path(tmp)
        except FileNotFoundError:
            pass
        os.close(fd)


def no_space_error(final: str | os.PathLike, need_bytes: int | None, err: OSError) -> UserError:
    """The UserError for a disk that filled up while `final` was written (its temp already removed)."""
    folder = Path(final).parent
    free = shutil.disk_usage(folder).free if folder.exists() else 0
    need = f"about {need_bytes / 1e9:.3f} GB" if need_bytes else "more space than is free"
    return UserError(f"{folder}: no space left on the device while writing {Path(final).name} ({err.strerror}); "
                     f"it needs {need}, {free / 1e9:.3f} GB is free. Free space there (or move output_root) "
                     f"and rerun (the partial file was removed: {Path(final).name} is unchanged)")


def is_no_space(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in NO_SPACE


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, suffix: str = ".tmp", need_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temp path next to `final`; on success fsync and rename it onto `final`.
    Stale temps of `final` (their writer died) are removed first; a full disk raises a UserError
    (`need_bytes`: the file's size, for its message)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final, suffix)
    lock_fd, tmp = _locked_temp(final, suffix)
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as e:
        _remove(tmp)
        if is_no_space(e):
            raise no_space_error(final, need_bytes, e) from e
        raise
    finally:
        os.close(lock_fd)  # after the rename: the lock covered the temp for as long as it existed


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    data = text.encode("utf-8")
    with atomic_path(path, need_bytes=len(data)) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def metadata_strings(metadata: dict | None) -> dict[str, str]:
    """safetensors metadata (all strings) for `metadata`: values as JSON, plain text as it is (e.g. transformers'
    "format": "pt"). Text that would read back as another JSON value (a params hash such as "1436699310444e26"
    is a number to json.loads) is written quoted, so `shards.parse_metadata` gives back the text."""

    def encode(v) -> str:
        if not isinstance(v, str):
            return json.dumps(v)
        try:
            json.loads(v)
        except ValueError:
            return v
        return json.dumps(v)

    return {k: encode(v) for k, v in (metadata or {}).items()}


def save_safetensors_atomic(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    meta = metadata_strings(metadata)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    with atomic_path(path, need_bytes=need) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
