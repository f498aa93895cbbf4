"""Benchmark results: bench/results/<bench>.json keeps the latest run of each device.

    {"runs": [{"device": "NVIDIA H200", "date": "2026-12-05", "commit": "c8c489b", ...the run's results...}]}

`record()` writes a run: it replaces the entry of the run's device (stamped with today's date and the
checked-out commit) and keeps every other device's. A run made on another machine (a copy of the tree
without git, say) writes its own file with `--out`; fold it into bench/results/ here with

    python3 bench/results.py merge FILE...      # each FILE's runs replace the same devices' in bench/results/

The commit is `git rev-parse --short HEAD`, or $BENCH_COMMIT where the tree has no git.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
KEYS = ("device", "date", "commit")  # every run's first keys: one run per device in a file


def commit() -> str:
    """The checked-out commit (short hash), $BENCH_COMMIT where there is no git, else 'unknown'."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS_DIR.parent,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def cpu_device() -> str:
    """The device name of a CPU run: architecture and the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU {platform.machine()}, {cores} cores"


def read_runs(path: Path) -> list[dict]:
    """The runs of a results file ([] if there is none)."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path}: not a results file (expected {{'runs': [...]}})")
    return data["runs"]


def write_runs(path: Path, runs: list[dict]) -> None:
    """Write `runs` (sorted by device) to `path` through a temp file in the same folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"runs": sorted(runs, key=lambda r: r["device"])}, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def put(path: Path, run: dict) -> Path:
    """Replace the entry of `run["device"]` in the results file `path` with `run`; keep the other devices'."""
    missing = [k for k in KEYS if not run.get(k)]
    if missing:
        raise ValueError(f"a run needs {missing}")
    write_runs(path, [r for r in read_runs(path) if r.get("device") != run["device"]] + [run])
    return path


def record(bench: str, device: str, result: dict, out: str | Path | None = None) -> Path:
    """Record `result` as the latest run of `bench` on `device`: in `out` (a .json file, or a folder that
    gets <bench>.json), by default bench/results/<bench>.json. The result's own device and commit keys give
    way to this run's, and its own date (a timestamp, say) is kept as "time". Returns the file written."""
    path = Path(out) if out else RESULTS_DIR / f"{bench}.json"
    if path.is_dir() or path.suffix != ".json":
        path = path / f"{bench}.json"
    run = {"device": device, "date": datetime.now(UTC).date().isoformat(), "commit": commit()}
    if "date" in result:
        run["time"] = result["date"]
    run.update({k: v for k, v in result.items() if k not in KEYS})
    return put(path, run)


def merge(files: list[str]) -> None:
    """Fold each file's runs into bench/results/<same name>, replacing the runs of the same devices."""
    missing = [name for name in files if not Path(name).is_file()]
    if missing:  # a typo (or an option) would otherwise merge nothing and say it did
        raise SystemExit(f"no such results file: {', '.join(missing)}")
    for name in files:
        for run in read_runs(Path(name)):
            put(RESULTS_DIR / Path(name).name, run)
        print(f"{name} -> {RESULTS_DIR / Path(name).name}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "merge":
        sys.exit(__doc__)
    merge(sys.argv[2:])
