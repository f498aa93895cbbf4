"""Warm start (train.init_from): a run starts from an exported EAGLE-3 head exactly, trains on from it, and a
head that does not fit this build is refused with an error naming the key and what differs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_train import FAST, make_inputs, write_mapping

from eagle3build.draft.export import export
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.errors import ConfigError
from eagle3build.train import loop
from eagle3build.train.data import load_inputs
from eagle3build.train.warm_start import MIN_OVERLAP, head_files, map_lm_head, warm_start

torch.set_num_threads(2)
SHAPE = {k: FAST[k] for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A head trained for a few steps on the tiny target, exported (fp32, so equality is exact)."""
    root = tmp_path_factory.mktemp("warm_start")
    inputs = make_inputs(root)
    out = root / "source"
    summary = loop.train(inputs["shards"], inputs["mapping"], inputs["target"], str(out / "out"), str(out / "state"),
                         {**FAST, "epochs": 8})  # fmt: skip
    export(str(out / "out" / "draft.safetensors"), inputs["mapping"], inputs["target"], str(root / "export"),
           {"dtype": "float32"})  # fmt: skip
    first_loss = json.loads((out / "out" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    return {**inputs, "export": root / "export", "eagle3": root / "export" / "eagle3", "summary": summary,
            "fresh_first_loss": first_loss}  # fmt: skip


def exported(head) -> dict[str, torch.Tensor]:
    return load_file(str(head["eagle3"] / "model.safetensors"))


def build_draft(head, mapping=None, **overrides) -> Eagle3Draft:
    """The draft train() builds before its first step (fresh initialisation, target lm_head rows)."""
    target, data, d2t, t2d = load_inputs(head["shards"], mapping or head["mapping"], head["target"], None, 48)
    torch.manual_seed(0)
    config = DraftConfig.from_target(target, len(d2t), data.layer_ids[:3], {**SHAPE, **overrides})
    return Eagle3Draft.from_target(config, target, d2t, t2d, True)


def copy_head(head, dest: Path, edit_config=None, edit_tensors=None) -> Path:
    """A copy of the exported head with its config.json / tensors changed."""
    shutil.copytree(head["eagle3"], dest)
    if edit_config:
        config = json.loads((dest / "config.json").read_text())
        edit_config(config)
        (dest / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(str(dest / "model.safetensors"))
        tensors = edit_tensors(tensors)
        save_file(tensors, str(dest / "model.safetensors"))
    return dest


def test_warm_start_copies_every_trained_weight(head):
    draft = build_draft(head)
    report = warm_start(draft, str(head["export"]))  # an export's out_dir: its eagle3/ is found
    assert report == {"init_from": str(head["export"]), "lm_head": "copied", "draft_vocab_overlap": 1.0}
    weights = exported(head)
    for name, param in draft.named_parameters():
        if name != "embed_tokens.weight":
            assert torch.equal(param.detach(), weights[name]), name


def test_train_starts_from_the_head_exactly_and_trains_on(head, tmp_path, monkeypatch):
    # without optimiser steps the weights train writes are its initial ones: the head's
    monkeypatch.setattr(loop, "optimizer_step", lambda *a, **k: torch.tensor(0.0))
    params = {**FAST, "epochs": 1, "init_from": str(head["eagle3"])}
    summary = loop.train(
        head["shards"], head["mapping"], head["target"], str(tmp_path / "a"), str(tmp_path / "sa"), params
    )
    written, weights = load_file(str(tmp_path / "a" / "draft.safetensors")), exported(head)
    for name in weights:
        if name not in ("d2t", "t2d"):
            assert torch.equal(written[name], weights[name]), name
    assert summary["warm_start"]["lm_head"] == "copied"
    monkeypatch.undo()
    # with them it trains on from the head: its first loss is the trained head's, far below a fresh start's
    summary = loop.train(head["shards"], head["mapping"], head["target"], str(tmp_path / "b"), str(tmp_path / "sb"),
                         {**params, "epochs": 2})  # fmt: skip
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if x["split"] == "train"]
    assert all(torch.isfinite(torch.tensor(losses))) and summary["steps"] == len(losses)
    assert losses[0] < 0.8 * head["fresh_first_loss"], (losses[0], head["fresh_first_loss"])
    assert summary["params_hash"] != head["summary"]["params_hash"]


def test_unset_init_from_keeps_the_runs_identity():
    """Runs without a warm start hash as before the key existed, so their checkpoints still resume."""
    p = loop.resolve_params({"lr": 1e-3})
    assert "init_from" not in loop.hashed_params(p, fsdp=False) and p["init_from"] is None
    # the head variants and the loss at their plain values are left out too (tests/test_head_variants.py)
    # and so are the memory switches, which change no weight (tests/test_recompute.py)
    unhashed = ("fsdp", "init_from", *loop.HEAD_VARIANT_KEYS, *loop.TRAIN_MEMORY_KEYS)
    assert loop.hashed_params(p, fsdp=False) == {k: v for k, v in p.items() if k not in unhashed}


def test_a_changed_head_is_another_run(head, tmp_path):
    other = copy_head(
        head, tmp_path / "other", edit_tensors=lambda t: {**t, "norm.weight": t["norm.weight"] * 2}
    )
    p = loop.resolve_params({"init_from": str(head["eagle3"])})
    q = loop.resolve_params({"init_from": str(other)})
    a, b = loop.hashed_params(p, False)["init_from"], loop.hashed_params(q, False)["init_from"]
    assert a["sha256"]["config.json"] == b["sha256"]["config.json"]
    assert a["sha256"]["model.safetensors"] != b["sha256"]["model.safetensors"]


def test_another_exporters_layout_is_read_the_same(head, tmp_path):
    """layers.0.* names, no eagle3build section in config.json: the standard keys and names suffice."""

    def foreign(config):
        del config["eagle3build"]

    def layers0(tensors):
        return {
            ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
            for k, v in tensors.items()
        }

    other = copy_head(head, tmp_path / "foreign", foreign, layers0)
    draft = build_draft(head)
    warm_start(draft, str(other))
    weights = exported(head)
    assert torch.equal(
        draft.midlayer.self_attn.q_proj.weight.detach(), weights["midlayer.self_attn.q_proj.weight"]
    )


def expect_refusal(draft, init_from, *fragments):
    with pytest.raises(ConfigError) as e:
        warm_start(draft, str(init_from))
    message = str(e.value)
    assert e.value.key == "train.init_from" and "config key 'train.init_from'" in message
    for fragment in fragments:
        assert fragment in message, message


def test_heads_that_do_not_fit_are_refused_naming_the_key_and_the_fix(head, tmp_path):
    def hidden(config):
        config["eagle3build"]["draft_config"]["hidden_size"] = 64

    expect_refusal(build_draft(head), copy_head(head, tmp_path / "h", hidden), "hidden_size 64 != this build's 32",
                   "a head for another target")  # fmt: skip
    expect_refusal(build_draft(head, intermediate_size=40), head["eagle3"],
                   "intermediate_size 48 != this build's 40", "set train.intermediate_size: 48")  # fmt: skip
    expect_refusal(
        build_draft(head, num_key_value_heads=4), head["eagle3"], "set train.num_key_value_heads: 2"
    )
    small = write_mapping(tmp_path / "small.safetensors", 128, list(range(48)))
    expect_refusal(build_draft(head, mapping=small), head["eagle3"], "draft_vocab_size 64 != this build's 48",
                   "set vocab.draft_vocab_size: 64")  # fmt: skip

    def aux(config):
        config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]
        config["eagle3build"]["draft_config"]["aux_layer_ids"] = [1, 2, 4]

    expect_refusal(
        build_draft(head), copy_head(head, tmp_path / "a", aux), "set extract.aux_layer_ids: [1, 2, 4]"
    )
    expect_refusal(build_draft(head), tmp_path / "missing", "no config.json or model.safetensors")


def test_a_plain_head_is_refused_by_a_variant_build_even_where_its_config_omits_the_switch(head, tmp_path):
    """A head published without the variant keys is the plain head as vLLM serves it: a norm_before_fc build
    (configs/kimi-k2.5.yaml's) must not put a fresh norm in front of its fc."""
    def foreign(config):
        del config["eagle3build"]
        for key in DraftConfig.VARIANTS:
            config.pop(key, None)

    plain = copy_head(head, tmp_path / "plain", foreign)
    expect_refusal(build_draft(head, norm_before_fc=True), plain, "norm_before_fc False != True",
                   "set train.norm_before_fc: false")  # fmt: skip
    expect_refusal(build_draft(head, norm_output=True), head["eagle3"], "set train.norm_output: false")
    warm_start(build_draft(head), str(plain))  # the plain build takes it


def test_a_head_of_another_mapping_has_its_rows_moved_by_token(head, tmp_path):
    """This build keeps target ids 8..71, the head 0..63: the 56 shared tokens take the head's rows, the
    8 new ones keep the target's lm_head rows (init_lm_head_from_target)."""
    shifted = write_mapping(tmp_path / "shifted.safetensors", 128, list(range(8, 72)))
    draft = build_draft(head, mapping=shifted)
    initial = draft.lm_head.weight.detach().clone()
    report = warm_start(draft, str(head["eagle3"]))
    assert report["lm_head"] == "remapped by target token id" and report["draft_vocab_overlap"] == 56 / 64
    head_lm = exported(head)["lm_head.weight"]
    lm = draft.lm_head.weight.detach()
    for draft_id in range(64):
        token = draft_id + 8
        assert torch.equal(lm[draft_id], head_lm[token] if token < 64 else initial[draft_id]), draft_id
    assert torch.equal(draft.d2t, torch.full((64,), 8))  # this build's mapping stays


def test_a_head_of_a_mostly_different_vocabulary_is_refused(head, tmp_path):
    disjoint = write_mapping(tmp_path / "disjoint.safetensors", 128, list(range(40, 104)))  # 24 of 64 shared
    expect_refusal(build_draft(head, mapping=disjoint), head["eagle3"], "holds only 38%", "vocab mapping")
    assert MIN_OVERLAP == 0.5


def test_map_lm_head_by_target_ids():
    head_lm = torch.arange(4.0)[:, None].repeat(1, 2)  # rows 0..3 for target ids 10, 11, 12, 13
    head_d2t = torch.full((4,), 10)
    ours = torch.tensor([1, 1, 9, 9])  # target ids 1, 2, 11, 12
    weight, overlap = map_lm_head(head_lm, head_d2t, ours, torch.full((4, 2), -1.0), 16)
    assert weight[:, 0].tolist() == [-1.0, -1.0, 1.0, 2.0] and overlap == 0.5


def test_head_files_are_the_rule_inputs_only_when_set(head, tmp_path):
    assert head_files(None) == []
    folder = head["eagle3"]
    assert head_files(str(head["export"])) == [str(folder / "config.json"), str(folder / "model.safetensors")]
    with pytest.raises(ConfigError, match="train.init_from.*nowhere"):
        head_files(str(tmp_path / "nowhere"))


def train_job(dry_run: str) -> str:
    """The train job's block of a dry-run's output."""
    found = re.search(r"^rule train:\n(.*?)(?:\n\n|\Z)", dry_run, re.S | re.M)
    assert found, dry_run[-3000:]
    return found.group(1)


def test_the_train_rule_takes_the_heads_files_as_inputs_only_when_set(tmp_path):
    """With train.init_from the head's files are inputs of the train job (a changed head retrains) and
    init_from is in its params; unset, the job is as before; a missing head stops the plan naming the key."""
    from conftest import STORIES
    from test_workflow import base_config
    from workflow_util import copy_workflow, planned_params, snakemake, write_config

    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path / "wf")
    folder = tmp_path / "published" / "eagle3"
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_text("{}")
    config = base_config()
    config["train"]["init_from"] = str(folder.parent)
    write_config(wd, config)
    block = train_job(snakemake(wd, "-n", "build/train/draft.safetensors").stdout)
    inputs = next(line for line in block.splitlines() if line.strip().startswith("input:"))
    assert str(folder / "config.json") in inputs and str(folder / "model.safetensors") in inputs
    assert "'init_from': " + repr(str(folder.parent)) in planned_params(wd)["train"][0]
    del config["train"]["init_from"]
    write_config(wd, config)
    block = train_job(snakemake(wd, "-n", "build/train/draft.safetensors").stdout)
    assert "published" not in block and "init_from" not in planned_params(wd)["train"][0]
    config["train"]["init_from"] = str(tmp_path / "nowhere")
    write_config(wd, config)
    proc = snakemake(wd, "-n", "build/train/draft.safetensors", check=False)
    assert proc.returncode != 0 and "train.init_from" in proc.stdout + proc.stderr
