"""Which engine image the hidden states came from, without Docker: a tree built with EAGLE3_IMAGE=img-a (as
`make docker-run` does, the image exporting it) is current for a run that names no image (a host `make
dry-run` after the container run), and stale for a run that names another one (two engines never share
hidden states). A run naming none records none for what it extracts itself, and refuses to re-extract a
shard that records an image. See docs/PRODUCTION.md, "The image and EAGLE3_IMAGE"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ROOT, SHARED, STORIES
from workflow_util import copy_workflow, planned_jobs, snakemake, write_config

from eagle3build.extraction.job import stop_servers
from eagle3build.fingerprint import shard_image

TEMPLATE = str(Path(__file__).parent / "data" / "chat_template.jinja")
ALPACA = SHARED / "assets" / "data" / "train" / "alpaca_en_demo.json"
SHARDS = ["build/hidden/alpaca/00000.safetensors", "build/hidden/alpaca/00001.safetensors"]
# What a changed image redoes: every extraction and everything after it.
EVERYTHING_AFTER_EXTRACT = {"extract": 2, "train": 1, "export": 1, "evaluate": 1}


def config(image: str | None = None) -> dict:
    return {
        "output_root": "build",
        "target": {"model": str(STORIES), "chat_template": TEMPLATE},
        "datasets": [{"name": "alpaca", "path": str(ALPACA), "max_samples": 16}],
        "prepare": {"max_length": 96, "shard_size": 8},
        "extract": {"batch_tokens": 4096, "server_idle_s": 30, **({"image": image} if image else {})},
        "vocab": {"draft_vocab_size": 64},
        "train": {"epochs": 1, "batch_tokens": 512, "lr": 1e-3, "gpus": 0},
        "evaluate": {"sets": [{"name": "q", "path": str(ROOT / "data/demo/eval_questions.jsonl"), "max_samples": 2}],
                     "k": [1, 3], "max_new_tokens": 8},
    }  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path_factory.mktemp("image"))
    write_config(wd, config())
    write_config(wd, config("img-a"), "config.img-a.yaml")
    write_config(wd, config("img-b"), "config.img-b.yaml")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_IMAGE", "img-a")
        snakemake(wd)
    yield wd
    stop_servers(wd / "build" / ".run")


@pytest.fixture
def no_image(monkeypatch):
    """The environment of a host run: no EAGLE3_IMAGE (and the configs leave extract.image null)."""
    monkeypatch.delenv("EAGLE3_IMAGE", raising=False)


def plan(wd: Path, image: str | None = None, config: str = "config.test.yaml") -> dict:
    with pytest.MonkeyPatch.context() as mp:
        if image is None:
            mp.delenv("EAGLE3_IMAGE", raising=False)
        else:
            mp.setenv("EAGLE3_IMAGE", image)
        return dict(planned_jobs(wd, config=config))


@pytest.mark.slow
def test_hidden_shards_record_the_image_they_were_made_in(built):
    assert [shard_image(str(built / s)) for s in SHARDS] == ["img-a", "img-a"]


@pytest.mark.slow
def test_a_run_naming_no_image_keeps_what_was_made_in_an_image(built):
    assert plan(built) == {}  # the host dry-run after the container run
    assert plan(built, "img-a") == {}
    assert plan(built, config="config.img-a.yaml") == {}  # extract.image names it instead


@pytest.mark.slow
def test_a_run_naming_another_image_re_extracts_everything(built):
    assert plan(built, "img-b") == EVERYTHING_AFTER_EXTRACT
    assert plan(built, config="config.img-b.yaml") == EVERYTHING_AFTER_EXTRACT
    assert plan(built, "img-a", config="config.img-b.yaml") == EVERYTHING_AFTER_EXTRACT  # extract.image wins
    assert plan(built) == {}  # dry-runs record nothing


@pytest.mark.slow
def test_a_run_naming_no_image_refuses_to_re_extract_a_shard_made_in_an_image(built, no_image):
    shard = built / SHARDS[0]
    before = shard.stat().st_mtime_ns
    proc = snakemake(built, "--force", SHARDS[0], check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert f"{SHARDS[0]} (image img-a)" in text and "EAGLE3_IMAGE" in text, text[-3000:]
    # Refused before any job started: the shard is still there, as it was.
    assert shard.stat().st_mtime_ns == before and shard_image(str(shard)) == "img-a"
    assert plan(built) == {}


@pytest.mark.slow
def test_a_shard_extracted_by_a_run_naming_no_image_records_none(built, no_image):
    os.unlink(built / SHARDS[1])
    snakemake(built)  # extracts the missing shard here, on an engine it does not name
    assert [shard_image(str(built / s)) for s in SHARDS] == ["img-a", ""]
    assert plan(built) == {}
    # The image does not take hidden states of an unnamed engine for its own: it redoes that shard only.
    assert plan(built, "img-a") == {**EVERYTHING_AFTER_EXTRACT, "extract": 1}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_IMAGE", "img-a")
        snakemake(built)  # the tree as the other tests expect it
    assert [shard_image(str(built / s)) for s in SHARDS] == ["img-a", "img-a"]
    assert plan(built) == {}


def test_shard_image_reads_the_metadata_of_any_shard_or_says_none(tmp_path):
    import torch
    from safetensors.torch import save_file

    shard = tmp_path / "a.safetensors"
    save_file({"x": torch.zeros(2)}, str(shard), metadata={"image": "reg.local/vllm:v9@sha256:ab", "n": "1"})
    assert shard_image(str(shard)) == "reg.local/vllm:v9@sha256:ab"
    save_file({"x": torch.zeros(2)}, str(shard), metadata={"format": "eagle3build.hidden"})
    assert shard_image(str(shard)) == ""  # a shard from before shards recorded their image
    (tmp_path / "short").write_bytes(b"abc")
    (tmp_path / "text").write_bytes(len(b"[1]").to_bytes(8, "little") + b"[1]")
    (tmp_path / "junk").write_bytes((5).to_bytes(8, "little") + b"\xff\xfe{{{")
    for name in ("short", "text", "junk", "absent"):
        assert shard_image(str(tmp_path / name)) == "", name
    assert shard_image(str(tmp_path)) == ""  # a folder where a shard should be
