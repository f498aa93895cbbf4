"""Run the real workflow in a temp folder and read what a dry-run plans."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ["Snakefile", "rules", "scripts", "schemas", "eagle3build", "profiles", "docs/report"]


def copy_workflow(dest: Path) -> Path:
    """A private copy of the workflow (so a test may edit its code) sharing nothing mutable with the repo."""
    for part in WORKFLOW_PARTS:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)
    return dest


def write_config(workdir: Path, config: dict, name: str = "config.test.yaml") -> Path:
    path = workdir / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake(workdir: Path, *args: str, config: str = "config.test.yaml", check: bool = True,
              timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--configfile", config, "--cores", "2", *args, "--resources", "gpu=1"]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def planned_jobs(workdir: Path, *targets: str, config: str = "config.test.yaml") -> Counter:
    """rule -> number of jobs a dry-run plans (split_N rules are counted as 'split')."""
    proc = snakemake(workdir, "-n", *targets, config=config)
    text = proc.stdout + proc.stderr
    jobs: Counter = Counter()
    if "Nothing to be done" in text:
        return jobs
    table = re.search(r"Job stats:\njob\s+count\n[-\s]+\n(.*?)\ntotal", text, re.S)
    assert table, text[-3000:]
    for line in table.group(1).splitlines():
        rule, count = line.split()
        if rule != "all":
            jobs[re.sub(r"^split_\d+$", "split", rule)] += int(count)
    return jobs


def planned_outputs(workdir: Path, rule: str, config: str = "config.test.yaml") -> list[str]:
    """The output files of the jobs of `rule` that a dry-run plans."""
    proc = snakemake(workdir, "-n", config=config)
    text = proc.stdout + proc.stderr
    outs = []
    for block in re.split(r"\n(?=\[|rule |localrule )", text):
        if re.match(rf"(local)?rule {rule}:", block.strip()):
            m = re.search(r"output: (.*)", block)
            if m:
                outs += [o.strip() for o in m.group(1).split(",")]
    return outs
