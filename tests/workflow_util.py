"""Run the real workflow in a temp folder and read what a dry-run plans."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ["Snakefile", "rules", "scripts", "eagle3build", "profiles", "docs/report",
                  "docker/base-image"]


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


# Builds the whole DAG (every job, as if nothing were built) through Snakemake's API and writes
# {rule: [repr of the params of each distinct job]}: the values Snakemake stores and compares between runs.
_PARAMS_SCRIPT = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, Quietness, ResourceSettings

workdir, configfile, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
    workflow_api = api.workflow(snakefile=workdir / "Snakefile", workdir=workdir,
                                resource_settings=ResourceSettings(cores=1),
                                config_settings=ConfigSettings(configfiles=[Path(configfile)]))
    workflow_api.dag(DAGSettings(forceall=True))
    workflow = workflow_api._workflow
    workflow._prepare_dag(forceall=True, ignore_incomplete=True, lock_warn_only=True)
    workflow._build_dag()
    params = {}
    for job in workflow.dag.jobs:
        params.setdefault(job.rule.name, set()).add(repr(dict(job.params.items())))
Path(out).write_text(json.dumps({rule: sorted(values) for rule, values in params.items()}))
"""


def planned_params(workdir: Path, config: str = "config.test.yaml") -> dict[str, list[str]]:
    """rule -> the params of its jobs (repr, as Snakemake compares them), for every job of the DAG."""
    out = workdir / "params.json"
    proc = subprocess.run([sys.executable, "-c", _PARAMS_SCRIPT, str(workdir), config, str(out)], cwd=workdir,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def archive_workflow(commit: str, wd: Path) -> bool:
    """The workflow as it was at `commit`, into `wd` (its schema lived in schemas/ before it moved into the
    package); False where git lacks that commit (a shallow or exported checkout)."""
    parts = list(WORKFLOW_PARTS)
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:schemas"], capture_output=True).returncode == 0:
        parts.append("schemas")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *parts], capture_output=True)
    if archive.returncode != 0:
        return False
    subprocess.run(["tar", "-x", "-C", str(wd)], input=archive.stdout, check=True)
    return True
