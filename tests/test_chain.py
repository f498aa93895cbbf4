"""The whole chain on CPU with a real model: regenerate -> tokens -> extract -> vocab -> train -> export ->
evaluate, run by Snakemake on stories260K; the trained head must beat an untrained one on held-back prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import STORIES
from workflow_util import copy_workflow, planned_jobs, planned_outputs, snakemake, write_config

from eagle3build.extraction.job import stop_servers

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = str(Path(__file__).parent / "data" / "chat_template.jinja")


def chain_config() -> dict:
    return {
        "output_root": "build",
        "target": {"model": str(STORIES), "chat_template": TEMPLATE},
        "datasets": [{"name": "demo", "path": str(ROOT / "data" / "demo" / "conversations.jsonl"),
                      "max_samples": 64, "regenerate": True}],
        "prepare": {"max_length": 256, "shard_size": 32},
        "regenerate": {"max_new_tokens": 64, "batch_size": 32},
        "extract": {"batch_tokens": 8192, "server_idle_s": 30},
        "vocab": {"draft_vocab_size": 256},
        "train": {"epochs": 12, "batch_tokens": 2048, "lr": 3e-3, "ttt_steps": 3, "warmup_ratio": 0.05,
                  "val_fraction": 0.1, "checkpoint_every": 50, "gpus": 0},
        "evaluate": {"sets": [{"name": "heldout", "path": str(ROOT / "data" / "demo" / "eval_questions.jsonl"),
                               "max_samples": 8}],
                     "k": [1, 3, 5], "sequential_k": [3], "max_new_tokens": 32},
    }


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path_factory.mktemp("chain"))
    write_config(wd, chain_config())
    jobs = planned_jobs(wd)
    assert jobs == {"split": 2, "regenerate": 2, "tokens_regenerated": 2, "extract": 2, "vocab_count": 2, "vocab": 1,
                    "train": 1, "export": 1, "evaluate": 1}
    snakemake(wd)
    yield wd
    stop_servers(wd / "build" / ".run")


def test_regenerated_answers_come_from_the_target(chain):
    original = [json.loads(line) for line in (ROOT / "data" / "demo" / "conversations.jsonl").read_text().splitlines()]
    regen = [json.loads(line) for line in (chain / "build" / "regen" / "demo" / "00000.jsonl").read_text().splitlines()]
    report = json.loads((chain / "build" / "regen" / "demo" / "00000.report.json").read_text())
    assert report["ok"] == len(regen) == 32 and report["failed"] == 0
    by_id = {f"demo:{i}": c for i, c in enumerate(original)}
    changed = 0
    for conv in regen:
        old = by_id[conv["id"]]
        assert [m["content"] for m in conv["messages"] if m["role"] == "user"] == \
               [m["content"] for m in old["messages"] if m["role"] == "user"]
        changed += [m["content"] for m in conv["messages"] if m["role"] == "assistant"] != \
                   [m["content"] for m in old["messages"] if m["role"] == "assistant"]
    assert changed == len(regen)


def test_trained_head_beats_an_untrained_one_on_held_back_prompts(chain, tmp_path):
    from eagle3build.atomic import save_safetensors_atomic
    from eagle3build.draft.export import export, load_exported
    from eagle3build.draft.model import DraftConfig, Eagle3Draft
    from eagle3build.draft.target import load_target_head
    from eagle3build.evaluate.hf import evaluate

    trained = json.loads((chain / "build" / "eval" / "heldout.json").read_text())
    heldout = trained["sets"]["heldout"]
    assert heldout["k"]["3"]["mismatches"] == 0  # lossless on real prompts
    assert heldout["k"]["3"]["simulation_agrees"] == heldout["turns"]
    # An untrained head of the same shape and vocabulary, exported the same way.
    exported = load_exported(str(chain / "build" / "export" / "eagle3"), target_path=str(STORIES))
    head = load_target_head(STORIES)
    torch.manual_seed(0)
    config = DraftConfig.from_dict(exported.config.to_dict())
    fresh = Eagle3Draft.from_target(config, head, exported.d2t, exported.t2d)
    weights = {n: p.detach() for n, p in fresh.named_parameters() if p.requires_grad}
    weights |= {"d2t": fresh.d2t, "t2d": fresh.t2d}
    save_safetensors_atomic(tmp_path / "draft.safetensors", weights, {"draft_config": config.to_dict()})
    export(str(tmp_path / "draft.safetensors"), str(chain / "build" / "vocab" / "mapping.safetensors"), str(STORIES),
           str(tmp_path / "export"), {"dtype": "float32"})
    target = {"path": str(STORIES), "chat_template": TEMPLATE}
    eval_set = chain_config()["evaluate"]["sets"]
    untrained = evaluate(str(tmp_path / "export" / "eagle3"), target, eval_set, str(tmp_path / "u.json"),
                         str(tmp_path / "u.png"), {"k": [3], "max_new_tokens": 32, "sequential_k": []})
    tau_trained = heldout["k"]["3"]["mean_acceptance_length"]
    tau_untrained = untrained["sets"]["heldout"]["k"]["3"]["mean_acceptance_length"]
    assert tau_trained > tau_untrained + 0.3, (tau_trained, tau_untrained)
    assert (chain / "build" / "eval" / "heldout.png").stat().st_size > 1000


def test_rerun_plans_nothing_and_a_sampling_change_reruns_regeneration(chain):
    assert planned_jobs(chain) == {}
    cfg = chain_config()
    cfg["regenerate"]["temperature"] = 0.7
    write_config(chain, cfg, "config.changed.yaml")
    jobs = planned_jobs(chain, config="config.changed.yaml")
    assert jobs.get("regenerate") == 2 and "split" not in jobs


def test_turning_regeneration_off_retokenizes_the_split_conversations(chain):
    # tokens and tokens_regenerated are one rule told apart by dataset name: switching a dataset between them
    # changes its tokens jobs' input (Snakemake's `input` trigger), and the split is kept.
    cfg = chain_config()
    cfg["datasets"][0]["regenerate"] = False
    write_config(chain, cfg, "config.plain.yaml")
    jobs = planned_jobs(chain, config="config.plain.yaml")
    assert jobs == {"tokens": 2, "extract": 2, "vocab_count": 2, "vocab": 1, "train": 1, "export": 1, "evaluate": 1}, jobs
    outs = planned_outputs(chain, "tokens", config="config.plain.yaml")
    assert sorted(outs) == sorted(f"build/tokens/demo/0000{i}.{ext}" for i in (0, 1) for ext in ("json", "safetensors"))


def test_a_dataset_listed_again_with_its_own_sampling_regenerates_only_itself(chain):
    cfg = chain_config()
    cfg["datasets"][0]["regenerate"] = {"temperature": 0.0, "seed": 0}  # the global settings, spelled out
    write_config(chain, cfg, "config.same.yaml")
    assert planned_jobs(chain, config="config.same.yaml") == {}
    # More answers per prompt: the same file again, sampled. Only the new dataset's shards regenerate.
    cfg["datasets"].append({**cfg["datasets"][0], "name": "demo_sampled", "regenerate": {"temperature": 0.7, "seed": 1}})
    write_config(chain, cfg, "config.sampled.yaml")
    jobs = planned_jobs(chain, config="config.sampled.yaml")
    assert jobs["split"] == jobs["regenerate"] == jobs["extract"] == 2 and jobs["train"] == 1, jobs  # its 2 shards
    outs = planned_outputs(chain, "regenerate", config="config.sampled.yaml")
    assert outs and all("/regen/demo_sampled/" in o for o in outs), outs
