"""A copy of the work tree as a user has it (tracked and untracked files, not ignored ones) plus the
built default target, for tests that run the whole project somewhere else (a container, a cluster)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path("models/SmolLM2-135M-Instruct")


def copy_worktree(dest: Path, with_model: bool = True) -> Path:
    """`dest` gets every file git does not ignore, and the model folder copied (a bind mount or another
    node does not follow a symlink out of the tree)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file() and "__pycache__" not in src.parts:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    if with_model:
        shutil.copytree(ROOT / MODEL, dest / MODEL)
    return dest


def nothing_planned(text: str) -> bool:
    return "Nothing to be done" in text


def job_stats(text: str) -> dict[str, int]:
    """rule -> count from the 'Job stats' table Snakemake prints before running (split_N kept apart)."""
    stats: dict[str, int] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "Job stats:":
            for row in lines[i + 3 :]:
                parts = row.split()
                if len(parts) != 2 or not parts[1].isdigit() or parts[0] == "total":
                    break
                stats[parts[0]] = int(parts[1])
            break
    return stats
