"""Staleness of what Snakemake cannot see by itself: the target's weights and tokenizer files edited in place,
a dataset's content (a folder gaining or changing a file, a large file touched or edited), a deleted hidden
shard. Each test asserts the exact jobs a dry-run of the default target plans.

The tree is built by the workflow as it was before fingerprints existed (the commit below, when git has it)
and then planned by the current one: a built tree must plan nothing after the upgrade.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SHARED, STORIES
from workflow_util import (
    WORKFLOW_PARTS,
    archive_workflow,
    copy_workflow,
    planned_jobs,
    snakemake,
    write_config,
)

from eagle3build.extraction.job import stop_servers

# The last commit whose workflow had no fingerprints (eagle3build/fingerprint.py).
BEFORE_FINGERPRINTS = "76295f0"
TEMPLATE = str(Path(__file__).parent / "data" / "chat_template.jinja")
ALPACA = SHARED / "assets" / "data" / "train" / "alpaca_en_demo.json"
# One shard of one dataset whose records changed (the others keep theirs), then what all datasets feed.
ONE_SHARD = {"split": 1, "tokens": 1, "extract": 1, "vocab_count": 1, "vocab": 1, "train": 1, "export": 1}


def config() -> dict:
    return {
        "output_root": "build",
        "target": {"model": "target", "chat_template": TEMPLATE},
        "datasets": [
            {"name": "big", "path": "inputs/big.jsonl", "max_samples": 16},
            {"name": "folder", "path": "inputs/folder", "format": "alpaca"},
        ],
        "prepare": {"max_length": 96, "shard_size": 8},
        "extract": {"batch_tokens": 4096, "server_idle_s": 30},
        "vocab": {"draft_vocab_size": 64},
        "train": {"epochs": 1, "batch_tokens": 512, "lr": 1e-3, "gpus": 0},
        "evaluate": {"sets": [], "k": [1, 3], "max_new_tokens": 8},
    }


def write_inputs(wd: Path) -> None:
    records = json.loads(ALPACA.read_text())
    shutil.copytree(STORIES, wd / "target")
    for f in (wd / "target").iterdir():
        f.chmod(0o644)
    (wd / "inputs" / "folder").mkdir(parents=True)
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    big = "\n".join(lines * 2) + "\n"
    assert len(big.encode()) > 1_000_000  # over Snakemake's checksum limit: a touch moves only its mtime
    (wd / "inputs" / "big.jsonl").write_text(big)
    for i in range(2):
        (wd / "inputs" / "folder" / f"part{i}.jsonl").write_text("\n".join(lines[100 + 8 * i:108 + 8 * i]) + "\n")


def install_old_workflow(wd: Path) -> bool:
    """The workflow of BEFORE_FINGERPRINTS into `wd`; False where git lacks that commit."""
    return archive_workflow(BEFORE_FINGERPRINTS, wd)


def install_current_workflow(wd: Path) -> None:
    for part in WORKFLOW_PARTS:
        path = wd / part
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    copy_workflow(wd)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = tmp_path_factory.mktemp("wf")
    write_inputs(wd)
    write_config(wd, config())
    if not install_old_workflow(wd):
        copy_workflow(wd)
    snakemake(wd)
    install_current_workflow(wd)
    # What the first plan after the upgrade holds; then the tree is brought up to date (a stage whose format
    # version was bumped since that commit reruns: not what these tests are about).
    first_plan = plan(wd)
    snakemake(wd)
    yield wd, first_plan
    stop_servers(wd / "build" / ".run")


@pytest.fixture
def built(tree) -> Path:
    return tree[0]


def plan(wd: Path) -> dict:
    return dict(planned_jobs(wd))


class Edit:
    """Change a file for one test; put back its bytes and its mtime afterwards."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.existed = self.path.exists()
        if self.existed:
            self.data, self.stat = self.path.read_bytes(), self.path.stat()
        return self.path

    def __exit__(self, *exc):
        if self.existed:
            self.path.write_bytes(self.data)
            os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        elif self.path.exists():
            self.path.unlink()


def version_bumps() -> set[str]:
    """The stages whose format version changed since BEFORE_FINGERPRINTS."""
    from eagle3build import FORMAT_VERSIONS

    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE_FINGERPRINTS}:eagle3build/__init__.py"],
                         capture_output=True, text=True)
    if old.returncode != 0:
        return set()
    namespace: dict = {}
    exec(compile(old.stdout, "old __init__", "exec"), namespace)
    return {k for k, v in FORMAT_VERSIONS.items() if namespace["FORMAT_VERSIONS"].get(k) != v}


@pytest.mark.slow
def test_a_tree_built_before_fingerprints_plans_nothing(tree):
    wd, first_plan = tree
    # The stages upstream of extraction (the expensive part) plan nothing unless their own version changed.
    stage_rules = {"split": "split", "tokens": "tokens", "hidden": "extract", "vocab": "vocab_count"}
    bumped = version_bumps()
    for stage, rule in stage_rules.items():
        if stage in bumped:
            break
        assert rule not in first_plan, first_plan
    if not bumped:
        assert first_plan == {}
    assert plan(wd) == {}  # and the baselines recorded on the first plan change nothing either


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json", "tokenizer.model"])
def test_an_edited_tokenizer_file_reruns_tokens_and_all_that_follows(built, name):
    with Edit(built / "target" / name) as path:
        path.write_bytes(path.read_bytes() + b"\n")
        assert plan(built) == {"tokens": 4, "extract": 4, "vocab_count": 4, "vocab": 1, "train": 1, "export": 1}
    assert plan(built) == {}  # the same bytes again: the outputs were made from them


@pytest.mark.slow
def test_a_touched_tokenizer_file_reruns_nothing(built):
    with Edit(built / "target" / "tokenizer_config.json") as path:
        os.utime(path)
        assert plan(built) == {}


@pytest.mark.slow
def test_weights_changed_in_place_rerun_extraction(built):
    from safetensors.torch import load_file, save_file

    with Edit(built / "target" / "model.safetensors") as path:
        size = path.stat().st_size
        tensors = load_file(path)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] + 1  # same names, dtypes and shapes: same size and header
        save_file(tensors, path, metadata={"format": "pt"})
        assert path.stat().st_size == size
        assert plan(built) == {"extract": 4, "train": 1, "export": 1}
    assert plan(built) == {}


@pytest.mark.slow
def test_touched_weights_rerun_nothing(built):
    """A weight file with a new mtime and the same bytes (copied afresh, downloaded again) is the same target."""
    with Edit(built / "target" / "model.safetensors") as path:
        os.utime(path, (time.time() + 60, time.time() + 60))
        assert plan(built) == {}


@pytest.mark.slow
def test_an_edited_model_config_reruns_extraction(built):
    with Edit(built / "target" / "config.json") as path:
        path.write_text(path.read_text() + "\n")
        assert plan(built) == {"extract": 4, "train": 1, "export": 1}


@pytest.mark.slow
def test_a_file_added_to_a_folder_dataset_splits_only_its_new_shard(built):
    records = json.loads(ALPACA.read_text())[300:308]
    with Edit(built / "inputs" / "folder" / "part2.jsonl") as path:
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
        # 24 records: 3 shards, the first two holding the records they held
        assert plan(built) == ONE_SHARD
    assert plan(built) == {}


@pytest.mark.slow
def test_a_file_edited_in_a_folder_dataset_resplits_its_shard(built):
    with Edit(built / "inputs" / "folder" / "part1.jsonl") as path:
        path.write_text(path.read_text().replace('"instruction": "', '"instruction": "Please: ', 1))
        assert plan(built) == ONE_SHARD  # part1 holds shard 1's records


def touch_into_the_future(path) -> None:
    """A newer mtime and nothing else: what `touch`, a copy or a checkout does to a dataset."""
    future = time.time() + 60
    os.utime(path, (future, future))


@pytest.mark.slow
def test_a_touched_large_dataset_reruns_nothing(built):
    with Edit(built / "inputs" / "big.jsonl") as path:
        touch_into_the_future(path)
        assert plan(built) == {}


@pytest.mark.slow
def test_an_edited_large_dataset_resplits_the_edited_shard(built):
    with Edit(built / "inputs" / "big.jsonl") as path:
        path.write_text(path.read_text().replace('"instruction": "', '"instruction": "Please: ', 1))
        assert plan(built) == ONE_SHARD  # the first record: shard 0


@pytest.mark.slow
def test_a_deleted_hidden_shard_is_extracted_again_by_a_plain_run(built):
    with Edit(built / "build" / "hidden" / "folder" / "00001.safetensors") as path:
        path.unlink()
        assert plan(built) == {"extract": 1, "train": 1, "export": 1}
    assert plan(built) == {}


# ---------------------------------------------------------------- appending to a dataset of 1,000 shards
# The last commit whose split rule had one param for the whole dataset's content: its trees must plan nothing.
BEFORE_SHARD_DIGESTS = "717c76c"
MANY = 1999  # records, 2 a shard: 1,000 shards, the last one holding one record

# Creates every output of the DAG (empty, in dependency order) and records each job's metadata as Snakemake
# does when a job finishes: a tree "built" by that workflow at 1,000 shards in seconds, for dry-runs.
_RECORD_SCRIPT = """
import asyncio, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import (ConfigSettings, DAGSettings, ExecutionSettings, OutputSettings, Quietness,
                                      ResourceSettings)

workdir = Path(sys.argv[1])
with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
    workflow_api = api.workflow(snakefile=workdir / "Snakefile", workdir=workdir,
                                resource_settings=ResourceSettings(cores=1),
                                config_settings=ConfigSettings(configfiles=[Path(sys.argv[2])]))
    workflow_api.dag(DAGSettings(forceall=True))
    workflow = workflow_api._workflow
    workflow.execution_settings = ExecutionSettings()
    workflow._prepare_dag(forceall=True, ignore_incomplete=True, lock_warn_only=True)
    workflow._build_dag()
    levels = [list(level) for level in workflow.dag.toposorted()]
    for job in (job for level in levels for job in level):
        for f in job.output:
            Path(f).parent.mkdir(parents=True, exist_ok=True)
            Path(f).touch()

    async def record():
        for job in (job for level in levels for job in level):
            await workflow.persistence.finished(job)

    asyncio.run(record())
"""


def many_record(i: int, text: str = "") -> str:
    return json.dumps({"instruction": f"Say {i}{text}", "output": f"It is {i}."})


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = tmp_path_factory.mktemp("many")
    shutil.copytree(STORIES, wd / "target")
    (wd / "inputs").mkdir()
    (wd / "inputs" / "many.jsonl").write_text("\n".join(many_record(i) for i in range(MANY)) + "\n")
    write_config(wd, {**config(), "datasets": [{"name": "many", "path": "inputs/many.jsonl"}],
                      "prepare": {"max_length": 96, "shard_size": 2}})
    if not archive_workflow(BEFORE_SHARD_DIGESTS, wd):
        copy_workflow(wd)
    proc = subprocess.run([sys.executable, "-c", _RECORD_SCRIPT, str(wd), "config.test.yaml"], cwd=wd,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    install_current_workflow(wd)
    return wd


def planned_by_rule(wd: Path) -> dict[str, list[str]]:
    """rule -> the sorted outputs of its planned jobs (split_N as 'split'), from one dry-run."""
    text = snakemake(wd, "-n").stdout
    outs: dict[str, list[str]] = {}
    for block in re.split(r"\n(?=\[|rule |localrule )", text):
        rule = re.match(r"(?:local)?rule (\w+):", block.strip())
        output = re.search(r"output: (.*)", block)
        if rule and output and rule.group(1) != "all":
            name = re.sub(r"^split_\d+$", "split", rule.group(1))
            outs.setdefault(name, []).extend(o.strip() for o in output.group(1).split(","))
    return {rule: sorted(o) for rule, o in outs.items()}


def shard_jobs(*shards: str) -> dict[str, list[str]]:
    """The jobs that redo shards of dataset `many`, and the jobs every dataset feeds."""
    return {
        "split": [f"build/data/many/{s}.jsonl" for s in shards],
        "tokens": sorted(f"build/tokens/many/{s}.{ext}" for s in shards for ext in ("safetensors", "json")),
        "extract": [f"build/hidden/many/{s}.safetensors" for s in shards],
        "vocab_count": [f"build/vocab/counts/many/{s}.safetensors" for s in shards],
        "vocab": ["build/vocab/coverage.json", "build/vocab/mapping.safetensors"],
        "train": ["build/train/draft.safetensors", "build/train/metrics.jsonl", "build/train/summary.json"],
        "export": ["build/export/eagle3/config.json", "build/export/eagle3/model.safetensors"],
    }


@pytest.mark.slow
def test_a_tree_built_before_shard_digests_plans_nothing(many):
    assert plan(many) == {}


@pytest.mark.slow
def test_appending_to_a_dataset_re_extracts_only_the_shards_whose_content_changed(many):
    with Edit(many / "inputs" / "many.jsonl") as path:
        with open(path, "a") as f:
            f.write(many_record(MANY) + "\n" + many_record(MANY + 1) + "\n")
        # shard 999 gains a record, shard 1000 is new: the other 999 shards are not split or extracted again
        planned = planned_by_rule(many)
        expected = shard_jobs("00999", "01000")
        assert {r: planned.get(r) for r in expected} == {r: sorted(o) for r, o in expected.items()}
        assert set(planned) == set(expected)
    assert plan(many) == {}  # the content the tree was built from again


@pytest.mark.slow
def test_an_edited_middle_record_re_extracts_only_its_shard(many):
    with Edit(many / "inputs" / "many.jsonl") as path:
        lines = path.read_text().splitlines()
        lines[1001] = many_record(1001, " please")
        path.write_text("\n".join(lines) + "\n")
        planned = planned_by_rule(many)
        expected = shard_jobs("00500")
        assert {r: planned.get(r) for r in expected} == {r: sorted(o) for r, o in expected.items()}
        assert set(planned) == set(expected)


@pytest.mark.slow
def test_a_touched_dataset_of_many_shards_plans_nothing(many):
    with Edit(many / "inputs" / "many.jsonl") as path:
        touch_into_the_future(path)
        assert plan(many) == {}


def test_shard_digests_change_only_where_records_changed(tmp_path):
    from eagle3build.shardplan import shard_digests

    src = tmp_path / "d.jsonl"
    src.write_text("".join(many_record(i) + "\n" for i in range(7)))
    cache = str(tmp_path / "cache")
    before = shard_digests(str(src), "auto", None, 3, None, cache)
    assert len(before) == 3
    with open(src, "a") as f:
        f.write(many_record(7) + "\n" + many_record(8) + "\n" + many_record(9) + "\n")
    after = shard_digests(str(src), "auto", None, 3, None, cache)
    assert after[:2] == before[:2] and after[2] != before[2] and len(after) == 4
    assert shard_digests(str(src), "auto", None, 3, 8, cache)[:2] == before[:2]  # max_samples: 8 records
    assert len(shard_digests(str(src), "auto", None, 3, 8, cache)) == 3


def test_shard_changes_name_only_the_shards_that_differ_from_the_baseline(tmp_path):
    from eagle3build.fingerprint import shard_changes

    state, settings = str(tmp_path / "fp"), {"shard_size": 2, "max_samples": None}
    calls = []

    def digests(values):
        return lambda: calls.append(1) or list(values)

    assert shard_changes(state, "d", settings, False, 3, digests("abc")) == (3, {})  # the baseline, recorded
    assert shard_changes(state, "d", settings, False, 3, digests("abc")) == (3, {})
    assert len(calls) == 1  # an unchanged dataset is not read again
    assert shard_changes(state, "d", settings, True, 4, digests("abxy")) == (3, {2: "x", 3: "y"})
    assert shard_changes(state, "d", {**settings, "shard_size": 3}, True, 2, digests("pq")) == (2, {0: "p", 1: "q"})


# ---------------------------------------------------------------- the fingerprints themselves (fast)
def test_a_fingerprint_is_a_param_only_once_it_differs_from_the_first_recorded(tmp_path):
    from eagle3build.fingerprint import change_since_baseline

    state = str(tmp_path / "fp")
    assert change_since_baseline(state, "weights", "models/x", {"a": 1}) is None  # recorded as the baseline
    assert change_since_baseline(state, "weights", "models/x", {"a": 1}) is None
    changed = change_since_baseline(state, "weights", "models/x", {"a": 2})
    assert changed and changed == change_since_baseline(state, "weights", "models/x", {"a": 2})
    assert change_since_baseline(state, "weights", "models/x", {"a": 1}) is None  # back to the baseline
    assert change_since_baseline(state, "weights", "models/y", {"a": 2}) is None  # another folder: its own
    assert change_since_baseline(state, "weights", "models/z", None) is None  # a hub id: nothing to see


def test_weights_fingerprint_samples_the_data_and_sees_an_in_place_rewrite_not_a_copy(tmp_path, monkeypatch):
    from eagle3build import fingerprint
    from eagle3build.fingerprint import weights_fingerprint

    header = json.dumps({"w": {"dtype": "BF16", "shape": [1 << 20, 4096], "data_offsets": [0, 1 << 33]}})
    for i in range(8):  # 8 sparse files of 8 GiB: reading all of their data would take minutes
        with open(tmp_path / f"model-{i:05d}.safetensors", "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header.encode())
            f.truncate(8 + len(header) + (1 << 33))
    (tmp_path / "config.json").write_text("{}")
    cache = str(tmp_path / "cache")
    start = time.perf_counter()
    before = weights_fingerprint(str(tmp_path), cache)
    assert time.perf_counter() - start < 5.0  # 16 MiB read per file
    shard = tmp_path / "model-00003.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched, or copied afresh: same content
    assert weights_fingerprint(str(tmp_path), cache) == before
    with open(shard, "r+b") as f:  # rewritten in place with other values: same size and header
        for offset in range(8 + len(header), st.st_size, 1 << 26):
            f.seek(offset)
            f.write(os.urandom(1 << 20))
    assert weights_fingerprint(str(tmp_path), cache) != before
    reads = []
    original = fingerprint._sampled_hash
    monkeypatch.setattr(fingerprint, "_sampled_hash", lambda p: reads.append(p) or original(p))
    again = weights_fingerprint(str(tmp_path), cache)
    assert reads == [] and again != before  # cached by size and mtime: a later plan stats the files only
    assert weights_fingerprint(str(tmp_path), str(tmp_path / "empty-cache")) == again and len(reads) == 8
    assert weights_fingerprint("org/hub-model") is None


def test_a_weights_baseline_of_the_earlier_form_is_kept_while_the_folder_matches_it(tmp_path):
    """Trees built when the weights' fingerprint was each file's size, mtime and header hash: a folder that
    still matches that record plans nothing (its record is rewritten in the sampled form); one whose files
    moved on is a change, as it was then."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    from eagle3build.fingerprint import weights_change

    model, state, cache = tmp_path / "model", str(tmp_path / "fp"), str(tmp_path / "cache")
    model.mkdir()
    save_file({"w": torch.ones(4, 4)}, str(model / "model.safetensors"))
    (model / "config.json").write_text("{}")
    p = model / "model.safetensors"
    raw = p.read_bytes()
    header_hash = hashlib.sha256(raw[8:8 + int.from_bytes(raw[:8], "little")]).hexdigest()
    assert weights_change(state, str(model), cache) is None  # the baseline, recorded in the sampled form
    (record,) = Path(state).glob("weights-*.json")

    def legacy(mtime_ns):
        return {"weights": {p.name: [p.stat().st_size, mtime_ns, header_hash]},
                "files": {"config.json": hashlib.sha256(b"{}").hexdigest()}}

    for mtime_ns, expect_change in ((p.stat().st_mtime_ns, False), (p.stat().st_mtime_ns - 10**9, True)):
        record.write_text(json.dumps({"kind": "weights", "key": str(model), "digest": "0" * 16,
                                      "fingerprint": legacy(mtime_ns)}))
        assert bool(weights_change(state, str(model), cache)) is expect_change
        upgraded = json.loads(record.read_text())["fingerprint"]["weights"][p.name]
        assert isinstance(upgraded[1], str) is not expect_change  # rewritten in the sampled form only if matched
    record.unlink()
    assert weights_change(state, str(model), cache) is None  # recorded afresh as the baseline
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    assert weights_change(state, str(model), cache) is None  # touched: the same content


def test_dataset_fingerprint_sees_content_not_mtime(tmp_path):
    from eagle3build.fingerprint import dataset_fingerprint

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"x": 1}\n')
    cache = str(tmp_path / "cache")
    before = dataset_fingerprint(str(folder), cache)
    os.utime(folder / "a.jsonl", (time.time() + 60, time.time() + 60))
    assert dataset_fingerprint(str(folder), cache) == before
    (folder / "a.jsonl").write_text('{"x": 2}\n')
    edited = dataset_fingerprint(str(folder), cache)
    assert edited != before
    (folder / "b.jsonl").write_text('{"x": 3}\n')
    assert dataset_fingerprint(str(folder), cache) not in (before, edited)
    assert dataset_fingerprint("hf:org/data", cache) is None


def test_an_hf_dataset_revision_reaches_load_dataset(monkeypatch):
    import datasets

    from eagle3build.data.formats import count_records, iter_raw_records

    calls = []

    def load_dataset(path, split=None, **kwargs):
        calls.append((path, split, kwargs))
        return [{"instruction": "q", "output": "a"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert count_records("hf:org/data", revision="a" * 40) == 1
    assert [i for i, _ in iter_raw_records("hf:org/data", revision="a" * 40)] == [0]
    count_records("hf:org/data")
    assert calls == [("org/data", "train", {"revision": "a" * 40})] * 2 + [("org/data", "train", {})]


def test_the_doctor_warns_about_an_hf_dataset_without_revision():
    from eagle3build.doctor.context import Context
    from eagle3build.doctor.data import check_dataset_revisions

    datasets = [{"name": "chat", "path": "hf:org/chat"}, {"name": "local", "path": "data/x.jsonl"},
                {"name": "pinned", "path": "hf:org/pinned", "revision": "b" * 40}]
    check = check_dataset_revisions(Context({"datasets": datasets}))
    assert check.status == "warn" and "datasets[0] (chat)" in check.detail and "pinned" not in check.detail
    assert "revision" in check.fix
    assert check_dataset_revisions(Context({"datasets": datasets[1:]})).status == "ok"
