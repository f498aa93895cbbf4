"""Staleness: the exact jobs a dry-run plans after each kind of change, on a real build (stories260K).

One module-scoped build runs the real workflow once; every test edits a copy of its config (or of the
workflow's code) and asserts what `snakemake -n` would rebuild.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SHARED, STORIES
from workflow_util import copy_workflow, planned_jobs, snakemake, write_config

from eagle3build.extraction.job import stop_servers
from eagle3build.shards import read_hidden

pytestmark = pytest.mark.slow

TEMPLATE = str(Path(__file__).parent / "data" / "chat_template.jinja")
TRAIN_DATA = SHARED / "assets" / "data" / "train"
UPSTREAM = ("split", "tokens", "extract", "vocab_count", "vocab", "regenerate")


def base_config() -> dict:
    return {
        "output_root": "build",
        "target": {"model": str(STORIES), "chat_template": TEMPLATE},
        "datasets": [{"name": "alpaca", "path": str(TRAIN_DATA / "alpaca_en_demo.json"), "max_samples": 24}],
        "prepare": {"max_length": 96, "shard_size": 8},
        "extract": {"batch_tokens": 4096, "server_idle_s": 30},
        "vocab": {"draft_vocab_size": 64},
        "train": {"epochs": 1, "batch_tokens": 512, "lr": 1e-3, "gpus": 0},
        "evaluate": {"sets": [], "k": [1, 3], "max_new_tokens": 8},
    }


def hidden_targets(config: dict, n_shards: dict[str, int]) -> list[str]:
    return [f"build/hidden/{ds}/{i:05d}.safetensors" for ds, n in n_shards.items() for i in range(n)]


UPSTREAM_TARGETS = ["build/vocab/mapping.safetensors", *hidden_targets({}, {"alpaca": 3})]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path_factory.mktemp("wf"))
    write_config(wd, base_config())
    snakemake(wd, *UPSTREAM_TARGETS)
    yield wd
    stop_servers(wd / "build" / ".run")


def plan(wd: Path, config: dict, targets=UPSTREAM_TARGETS) -> dict:
    write_config(wd, config, "config.changed.yaml")
    return dict(planned_jobs(wd, *targets, config="config.changed.yaml"))


def test_a_complete_build_plans_nothing(built):
    assert plan(built, base_config()) == {}


def test_the_train_job_gets_the_hosts_threads(built):
    """Snakemake gives a job OMP_NUM_THREADS = its threads (1 unless the rule says): the trainer's host
    side would share one core. The train job takes the run's cores (the helper runs --cores 2)."""
    proc = snakemake(built, "-n", "build/train/draft.safetensors")
    job = (proc.stdout + proc.stderr).split("rule train:")[1].split("\n\n")[0]
    assert "threads: 2" in job, job


def test_training_setting_plans_no_upstream_job(built):
    cfg = base_config()
    cfg["train"]["lr"] = 5e-4
    jobs = plan(built, cfg, targets=["build/export/eagle3/config.json"])
    assert not set(jobs) & set(UPSTREAM), jobs
    assert jobs.get("train") == 1 and jobs.get("export") == 1


def test_draft_vocab_size_plans_vocab_and_downstream_only(built):
    cfg = base_config()
    cfg["vocab"]["draft_vocab_size"] = 100
    assert plan(built, cfg) == {"vocab": 1}
    jobs = plan(built, cfg, targets=["build/export/eagle3/config.json"])
    assert jobs.get("vocab") == 1 and not set(jobs) & {"split", "tokens", "extract", "vocab_count"}


def test_new_dataset_extracts_only_its_shards(built):
    cfg = base_config()
    # Listed first, it takes split_0 from alpaca (now split_1): a rule's name is not what makes a job stale.
    cfg["datasets"].insert(0, {"name": "kto", "path": str(TRAIN_DATA / "kto_en_demo.json"), "max_samples": 16})
    targets = ["build/vocab/mapping.safetensors", *hidden_targets(cfg, {"alpaca": 3, "kto": 2})]
    assert plan(built, cfg, targets) == {"split": 2, "tokens": 2, "extract": 2, "vocab_count": 2, "vocab": 1}


def test_a_dataset_setting_redoes_that_dataset(built):
    # Each dataset's split rule (split_<i>) carries its settings as params: a reading setting redoes its shards.
    cfg = base_config()
    cfg["datasets"][0]["format"] = "alpaca"  # was auto: the same records, but how they are read changed
    assert plan(built, cfg) == {"split": 3, "tokens": 3, "extract": 3, "vocab_count": 3, "vocab": 1}


@pytest.mark.parametrize("change", ["aux_layer_ids", "max_length", "revision", "storage_dtype"])
def test_settings_that_change_hidden_states_plan_all_extraction(built, change):
    cfg = base_config()
    if change == "aux_layer_ids":
        cfg["extract"]["aux_layer_ids"] = [1, 2, 3]
    elif change == "max_length":
        cfg["prepare"]["max_length"] = 80
    elif change == "revision":
        cfg["target"]["revision"] = "0123abcd"
    else:
        cfg["extract"]["storage_dtype"] = "fp8"
    jobs = plan(built, cfg)
    assert jobs.get("extract") == 3, jobs
    assert "split" not in jobs


def test_prepare_thinking_changes_tokens_only_when_not_the_default(built):
    cfg = base_config()
    cfg["prepare"]["thinking"] = "served"  # the default, written out: the same params
    assert plan(built, cfg) == {}
    cfg["prepare"]["thinking"] = "train"
    jobs = plan(built, cfg)
    assert jobs.get("tokens") == 3 and "split" not in jobs, jobs


def test_runtime_knobs_plan_nothing(built):
    cfg = base_config()
    cfg["extract"].update(batch_tokens=123, server_idle_s=5, devices=["cpu"])
    assert plan(built, cfg) == {}


def test_deleting_one_shard_plans_that_shard_only(built):
    victim = built / "build" / "hidden" / "alpaca" / "00001.safetensors"
    saved = victim.read_bytes()
    victim.unlink()
    try:
        assert plan(built, base_config()) == {"extract": 1}
    finally:
        victim.write_bytes(saved)
        os.utime(victim, (time.time() - 1, time.time() - 1))


def test_code_edit_keeps_hidden_states_but_version_bump_rebuilds(tmp_path, built):
    wd = tmp_path / "wf"
    shutil.copytree(built, wd, symlinks=True)
    extract_py = wd / "eagle3build" / "extraction" / "job.py"
    extract_py.write_text(extract_py.read_text() + "\n# an unrelated edit\n")
    assert plan(wd, base_config()) == {}
    # A `git pull` that changes how the rules hand their jobs over (their run: blocks) redoes nothing either:
    # Snakemake's `code` trigger, off in the profiles, would rerun every job of every rule whose block changed.
    for smk in (wd / "rules").glob("*.smk"):
        smk.write_text(smk.read_text().replace("stage_command(", "stage_command(  "))
    for script in (wd / "scripts").glob("*.py"):
        script.write_text(script.read_text() + "\n# an unrelated edit\n")
    assert plan(wd, base_config()) == {}
    init = wd / "eagle3build" / "__init__.py"
    init.write_text(init.read_text().replace('"hidden": 1', '"hidden": 2'))
    jobs = plan(wd, base_config())
    assert jobs.get("extract") == 3 and "tokens" not in jobs


def test_sigkill_mid_extraction_leaves_nothing_complete_and_rerun_is_partial(tmp_path):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path / "wf")
    cfg = base_config()
    cfg["datasets"][0]["max_samples"] = 48
    cfg["prepare"]["shard_size"] = 8  # 6 shards
    write_config(wd, cfg)
    targets = hidden_targets(cfg, {"alpaca": 6})
    snakemake(wd, *[t.replace("hidden", "tokens") for t in targets])
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", "--configfile", "config.test.yaml", "--cores", "1",
                             *targets, "--resources", "gpu=1"], cwd=wd, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hidden = wd / "build" / "hidden" / "alpaca"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(hidden.glob("*.safetensors"))) < 2:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    stop_servers(wd / "build" / ".run")
    done = sorted(hidden.glob("*.safetensors"))
    assert 2 <= len(done) < 6, "kill the run while it is extracting"
    for path in done:  # whatever carries a final name is complete and readable
        shard = read_hidden(path)
        assert shard.hidden.shape[0] == int(shard.meta["num_tokens"])
    snakemake(wd, "--unlock")
    jobs = planned_jobs(wd, *targets)
    # Shards whose job finished are kept; a shard renamed into place just before the kill, whose job
    # Snakemake had not yet recorded as finished, is conservatively redone (it is marked incomplete).
    assert set(jobs) == {"extract"} and 6 - len(done) <= jobs["extract"] <= 6 - len(done) + 1, jobs
    snakemake(wd, *targets)
    stop_servers(wd / "build" / ".run")
    assert len(list(hidden.glob("*.safetensors"))) == 6


def portable_config() -> dict:
    """base_config with the model and data by relative path, as a checkout on another host has them."""
    cfg = base_config()
    cfg["target"] = {"model": "models/stories", "chat_template": "data/chat_template.jinja"}
    cfg["datasets"] = [{"name": "alpaca", "path": "data/alpaca_en_demo.json", "max_samples": 16}]
    return cfg


def fresh_checkout(path: Path, cfg: dict) -> Path:
    """Another host's checkout: the workflow, and the model and data copied afresh (new mtimes)."""
    wd = copy_workflow(path)
    shutil.copytree(STORIES, wd / "models" / "stories", copy_function=shutil.copy)
    (wd / "data").mkdir()
    for asset in (TRAIN_DATA / "alpaca_en_demo.json", TEMPLATE):
        shutil.copy(asset, wd / "data")
    write_config(wd, cfg)
    return wd


def test_a_build_moved_to_another_host_plans_nothing(tmp_path):
    """The output root and Snakemake's records, copied into another checkout whose model and data were copied
    afresh (newer files than every output, new mtimes): the plan there is empty, and an `lr` edit plans what
    it plans at home."""
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    cfg = portable_config()
    first = fresh_checkout(tmp_path / "first", cfg)
    snakemake(first)
    stop_servers(first / "build" / ".run")
    time.sleep(1.1)  # every file of the second checkout is newer than every output
    second = fresh_checkout(tmp_path / "second", cfg)
    # What docs/PRODUCTION.md ("Moving a build") says to carry; tar keeps the files' mtimes.
    archive = tmp_path / "build.tar"
    subprocess.run(["tar", "-cf", archive, "--exclude=build/.run", "build", ".snakemake/metadata"], cwd=first, check=True)
    subprocess.run(["tar", "-xf", archive], cwd=second, check=True)
    assert planned_jobs(second) == {}
    cfg["train"]["lr"] = 5e-4
    for wd in (first, second):
        write_config(wd, cfg, "config.changed.yaml")
    retrain = planned_jobs(second, config="config.changed.yaml")
    assert retrain == planned_jobs(first, config="config.changed.yaml") and set(retrain) == {"train", "export"}


def test_tokens_built_on_a_cpu_host_are_not_built_again(tmp_path):
    """docs/PRODUCTION.md ("Moving a build"): the tokens and vocabulary counts built on one host (`--until
    vocab_count`), carried with Snakemake's records into another checkout with fresh copies of the model and
    data: its plan starts at the vocabulary and the extractions."""
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    cfg = portable_config()
    cpu = fresh_checkout(tmp_path / "cpu", cfg)
    snakemake(cpu, "--until", "vocab_count")  # and the tokens it counts
    assert not (cpu / "build" / "hidden").exists()
    time.sleep(1.1)  # every file of the GPU host's checkout is newer than every output
    gpu = fresh_checkout(tmp_path / "gpu", cfg)
    archive = tmp_path / "upto-tokens.tar"
    subprocess.run(["tar", "-cf", archive, "build/data", "build/tokens", "build/vocab", ".snakemake/metadata"],
                   cwd=cpu, check=True)
    subprocess.run(["tar", "-xf", archive], cwd=gpu, check=True)
    jobs = planned_jobs(gpu)
    assert set(jobs) == {"extract", "vocab", "train", "export"}, jobs
    assert jobs["extract"] == planned_jobs(cpu)["extract"] == 2  # 16 samples in shards of 8
