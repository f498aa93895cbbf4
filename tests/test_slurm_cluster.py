"""The demo through profiles/slurm on a live SLURM cluster (cluster/slurm-one-node.sh brings one up on a
single machine): jobs are submitted with the resources the profile declares, GPU jobs get their counted
GPUs and never share them, a killed workflow resumes without redoing finished jobs, and a rerun plans
nothing. Skips (with the reason) where no cluster answers."""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from tree_util import MODEL, ROOT, copy_worktree, job_stats, nothing_planned


@functools.cache
def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "no SLURM client here (cluster/slurm-one-node.sh sets up a one-node cluster)"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"sinfo did not answer: no live cluster ({err})"
    if states.returncode != 0 or not re.search(r"^(idle|mixed|allocated)", states.stdout, re.M):
        return f"no SLURM node is up: {(states.stdout + states.stderr).strip()[:200]}"
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401
    except ImportError:
        return "snakemake-executor-plugin-slurm is not installed (requirements-dev.txt)"
    if not (ROOT / MODEL / "config.json").exists():
        return f"{MODEL} is not built (make setup)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_cluster_problem()), reason=_cluster_problem() or "")]

PROFILE = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
# There is no accounting database on a one-node test cluster: job states come from squeue (finished jobs
# stay visible for MinJobAge) and no account is looked up.
# The plugin deletes the logs of successful jobs, whose names carry the SLURM job ids read back here.
SLURM_ARGS = ["--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "5",
              "--slurm-no-account", "--slurm-keep-successful-logs"]  # fmt: skip
UNIT_MB = {"M": 1, "G": 1024, "T": 1024 * 1024}


def smk(*args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--workflow-profile", "profiles/slurm",
            "--configfile", "config.yaml", *SLURM_ARGS, *args]  # fmt: skip


@pytest.fixture(scope="module")
def tree():
    # Not under pytest's private temp folder: a cluster node must see the tree at the same path.
    dest = Path(tempfile.mkdtemp(prefix="e3-slurm-", dir=os.environ.get("EAGLE3_CLUSTER_TMP", "/var/tmp")))
    copy_worktree(dest)
    yield dest
    shutil.rmtree(dest, ignore_errors=True)


def slurm_jobs(tree: Path, rule: str) -> list[dict[str, str]]:
    """`scontrol show job` of every SLURM job the plugin submitted for `rule` (ids from its log names)."""
    jobs = []
    for log in sorted((tree / ".snakemake/slurm_logs" / f"rule_{rule}").rglob("*.log")):
        out = subprocess.run(["scontrol", "show", "job", log.stem], capture_output=True, text=True).stdout
        fields = dict(re.findall(r"(\S+?)=(\S*)", out))
        if fields:
            jobs.append(fields)
    return jobs


def test_demo_killed_then_resumed(tree):
    start = time.monotonic()
    log = (tree / "run1.log").open("w")
    first = subprocess.Popen(smk(), cwd=tree, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    hidden = tree / "build/hidden/demo"
    # Kill the workflow once the first hidden shard exists: split and tokens are done, GPU jobs are queued.
    while first.poll() is None and not any(hidden.glob("*.safetensors")) and time.monotonic() - start < 1200:
        time.sleep(2)
    assert first.poll() is None, (tree / "run1.log").read_text()[-3000:]
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: the plugin cancels its queued and running jobs
    first.wait(timeout=300)
    assert not (tree / "build/export/eagle3/config.json").exists()
    time.sleep(2)
    mine = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True).stdout
    assert not any(job for job in mine.splitlines() if "RUNNING" in job or "PENDING" in job), mine

    second = subprocess.run(smk(), cwd=tree, capture_output=True, text=True, timeout=1800)
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-5000:]
    stats = job_stats(text)
    assert stats and not any(r.startswith(("split_", "tokens")) for r in stats), stats  # kept, not redone
    assert {"train", "export", "evaluate"} <= set(stats), stats
    for out in ("build/export/eagle3/config.json", "build/export/eagle3/model.safetensors",
                "build/eval/demo_heldout.json"):  # fmt: skip
        assert (tree / out).is_file(), out


def test_jobs_got_the_resources_the_profile_declares(tree):
    declared = PROFILE["set-resources"]
    for rule in ("tokens", "extract", "vocab_count", "vocab", "train", "export", "evaluate"):
        jobs = slurm_jobs(tree, rule)
        assert jobs, f"no SLURM job of {rule} is known to scontrol"
        want = declared[rule]
        for job in jobs:
            assert job["NumCPUs"] == str(want["cpus_per_task"]), (rule, job["NumCPUs"])
            mem = job["MinMemoryNode"]
            mem_mb = float(mem[:-1]) * UNIT_MB[mem[-1]] if mem[-1] in UNIT_MB else float(mem)
            assert round(mem_mb) == want["mem_mb"], (rule, mem)
            assert job["TimeLimit"].startswith(f"{want['runtime'] // 60:02d}:") or want["runtime"] >= 1440, job
            if "gpu" in want:
                assert job.get("TresPerJob") == f"gres:gpu:{want['gpu']}", (rule, job.get("TresPerJob"))
            else:
                assert "gpu" not in job.get("TresPerJob", ""), (rule, job.get("TresPerJob"))
    for job in slurm_jobs(tree, "split_0"):
        assert job["NumCPUs"] == str(PROFILE["default-resources"]["cpus_per_task"])


def test_gpu_jobs_never_share_the_counted_gpus(tree):
    """Each GPU rule asks for all 8 GPUs of the node: SLURM runs them one at a time."""
    spans = []
    for rule in ("extract", "train", "evaluate"):
        for job in slurm_jobs(tree, rule):
            if job["JobState"] == "COMPLETED":
                spans.append((datetime.fromisoformat(job["StartTime"]), datetime.fromisoformat(job["EndTime"]), rule))
    assert len(spans) >= 3, spans
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        assert start >= end, f"{a} and {b} held GPUs at the same time"


def test_rerun_plans_nothing(tree):
    proc = subprocess.run(smk("-n"), cwd=tree, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and nothing_planned(proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
