"""Wall time and GPU busy share per stage of a workflow run, from Snakemake's logs and a utilisation trace.

    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 1 > gpu.csv &
    make run CONFIG=configs/smollm2-gpu.yaml
    python3 bench/workflow_gpu_report.py .snakemake/log/*.snakemake.log --gpu gpu.csv --out report.json

Per rule: jobs, wall span (first start to last finish), the time at least one of its jobs ran (union of
its job intervals), job-seconds (sum), and the mean GPU utilisation and peak memory over that union.
The workflow's own share: the run's wall time (each log's first line to its last event) less the union of
every job's interval, i.e. the seconds no job ran (DAG building, preflight, scheduling). Job start and
finish come from the log's timestamps (1 s resolution).
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
START = re.compile(r"^(?:local)?rule (\S+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\S+)\)$")
LOG_DATE = re.compile(r"^\s+Date: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)$")


def parse_log(path: Path) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(first timestamp, last timestamp, [(rule, start, end)]) of one Snakemake log."""
    stamp = first = last = None
    pending: dict[str, tuple[str, float]] = {}
    started: tuple[str, float] | None = None
    jobs = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if m := LOG_DATE.match(line):
            first = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        elif m := STAMP.match(line):
            stamp = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y").timestamp()
            last = stamp
        elif (m := START.match(line)) and stamp is not None:
            started = (m.group(1), stamp)
        elif (m := JOBID.match(line)) and started is not None:
            pending[m.group(1)] = started
            started = None
        elif (m := FINISHED.match(line)) and m.group(1) in pending:
            rule, start = pending.pop(m.group(1))
            jobs.append((rule, start, stamp))
    return first or 0.0, last or 0.0, jobs


def union_seconds(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def read_gpu(path: Path) -> list[tuple[float, float, float]]:
    """[(unix time, utilisation %, memory MiB)] from nvidia-smi's csv,noheader lines."""
    rows = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(parts[1].split()[0]), float(parts[2].split()[0])))
        except ValueError:
            continue
    return rows


def gpu_over(samples: list[tuple[float, float, float]], spans: list[tuple[float, float]]) -> dict:
    inside = [(u, m) for t, u, m in samples if any(a <= t <= b + 1 for a, b in spans)]
    if not inside:
        return {"gpu_util_mean": None, "gpu_mem_peak_mib": None}
    return {"gpu_util_mean": round(sum(u for u, _ in inside) / len(inside), 1),
            "gpu_mem_peak_mib": max(m for _, m in inside)}


def report(logs: list[Path], gpu: Path | None) -> dict:
    samples = read_gpu(gpu) if gpu else []
    runs, jobs = [], []
    for log in logs:
        first, last, log_jobs = parse_log(log)
        runs.append({"log": log.name, "wall_s": last - first, "jobs": len(log_jobs)})
        jobs += log_jobs
    by_rule: dict[str, list[tuple[float, float]]] = {}
    for rule, a, b in jobs:  # split_0, split_1, ...: one rule per dataset, one stage
        by_rule.setdefault(re.sub(r"_\d+$", "", rule), []).append((a, b))
    rules = {}
    for rule, intervals in sorted(by_rule.items(), key=lambda kv: min(a for a, _ in kv[1])):
        spans = union_seconds(intervals)
        rules[rule] = {"jobs": len(intervals), "span_s": max(b for _, b in intervals) - min(a for a, _ in intervals),
                       "running_s": sum(b - a for a, b in spans), "job_s": sum(b - a for a, b in intervals),
                       **gpu_over(samples, spans)}
    wall = sum(r["wall_s"] for r in runs)
    busy = sum(b - a for a, b in union_seconds([(a, b) for _, a, b in jobs]))
    return {"runs": runs, "rules": rules, "wall_s": wall, "jobs_running_s": busy,
            "workflow_only_s": wall - busy, "workflow_only_share": (wall - busy) / wall if wall else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path, help="Snakemake logs of the run, in order")
    p.add_argument("--gpu", type=Path, help="nvidia-smi csv trace (timestamp, utilization.gpu, memory.used)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = report(args.logs, args.gpu)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
