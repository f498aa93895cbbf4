"""A rule's params are what Snakemake compares between runs: a changed value reruns the rule and all that
follows. Defaults moving between the code and the schema must therefore leave every rule's params as
they were for an existing config (the values below are those the workflow planned before the package
took its defaults from the schema), or a built tree would rebuild.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ROOT, SHARED, SMOLLM2, STORIES
from test_chain import chain_config
from test_workflow import base_config
from workflow_util import copy_workflow, planned_params, write_config

TEMPLATE = str(Path(__file__).parent / "data" / "chat_template.jinja")
DEMO_TARGET = "models/SmolLM2-135M-Instruct"
EXPORT = {"speculators": False, "dtype": "bfloat16", "include_embed_tokens": False}
# The export format changed on purpose (SGLang's eagle_config ids, the target as configured): only export
# and evaluate rerun. The evaluate report changed on purpose (T > 0 read off the target's samples): only
# evaluate reruns. Every other version stays 1.
EXPORT_VERSION = 2
EVALUATE_VERSION = 2


def stories(*keys: str) -> dict:
    target = {"path": str(STORIES), "revision": None, "trust_remote_code": False, "chat_template": TEMPLATE,
              "dtype": "auto"}
    return {k: target[k] for k in keys}


def demo_target(*keys: str) -> dict:
    target = {"path": DEMO_TARGET, "revision": None, "trust_remote_code": False, "chat_template": None,
              "dtype": "auto"}
    return {k: target[k] for k in keys}


def expected_demo() -> dict:
    return {
        "all": {},
        "evaluate": {
            "target": demo_target("path", "revision", "trust_remote_code", "chat_template", "dtype"),
            "eval_set": {"name": "demo_heldout", "path": "data/demo/eval_questions.jsonl", "max_samples": None},
            "settings": {"k": [1, 2, 3, 4, 5, 6, 7], "max_new_tokens": 48, "max_samples": None, "sequential_k": [3]},
            "version": EVALUATE_VERSION,
        },
        "export": {"export": EXPORT, "target": demo_target("path", "revision"), "out_dir": "build/export",
                   "version": EXPORT_VERSION},
        "extract": {"target": demo_target("path", "revision", "trust_remote_code", "dtype"), "backend": "hf",
                    "storage_dtype": "bf16", "aux_layer_ids": [2, 15, 27], "image": "", "version": 1,
                    "run_dir": "build/.run"},
        "split_0": {"dataset": {"name": "demo", "path": "data/demo/conversations.jsonl", "format": "auto",
                                "split": None, "max_samples": None},
                    "shards": 3, "shard_size": 64, "version": 1},
        "tokens": {"tokenizer": demo_target("path", "revision", "trust_remote_code", "chat_template"),
                   "max_length": 2048, "version": 1},
        "train": {"train": {"lr": 0.0003, "epochs": 3, "ttt_steps": 4, "batch_tokens": 1024, "val_fraction": 0.1,
                            "gpus": 1},
                  "target": demo_target("path", "revision"), "state_dir": "build/train/state", "version": 1},
        "vocab": {"draft_vocab_size": 4096, "vocab_size": 49152, "version": 1},
        "vocab_count": {"vocab_size": 49152, "version": 1},
    }  # fmt: skip


def expected_workflow_test() -> dict:
    alpaca = str(SHARED / "assets" / "data" / "train" / "alpaca_en_demo.json")
    return {
        "all": {},
        "export": {"export": EXPORT, "target": stories("path", "revision"), "out_dir": "build/export",
                   "version": EXPORT_VERSION},
        "extract": {"target": stories("path", "revision", "trust_remote_code", "dtype"), "backend": "hf",
                    "storage_dtype": "bf16", "aux_layer_ids": [2, 2, 2], "image": "", "version": 1,
                    "run_dir": "build/.run"},
        "split_0": {"dataset": {"name": "alpaca", "path": alpaca, "format": "auto", "split": None, "max_samples": 24},
                    "shards": 3, "shard_size": 8, "version": 1},
        "tokens": {"tokenizer": stories("path", "revision", "trust_remote_code", "chat_template"), "max_length": 96,
                   "version": 1},
        "train": {"train": {"epochs": 1, "batch_tokens": 512, "lr": 0.001, "gpus": 0},
                  "target": stories("path", "revision"), "state_dir": "build/train/state", "version": 1},
        "vocab": {"draft_vocab_size": 64, "vocab_size": 512, "version": 1},
        "vocab_count": {"vocab_size": 512, "version": 1},
    }  # fmt: skip


def expected_chain_test() -> dict:
    demo = ROOT / "data" / "demo"
    return {
        "all": {},
        "evaluate": {
            "target": stories("path", "revision", "trust_remote_code", "chat_template", "dtype"),
            "eval_set": {"name": "heldout", "path": str(demo / "eval_questions.jsonl"), "max_samples": 8},
            "settings": {"k": [1, 3, 5], "max_new_tokens": 32, "max_samples": None, "sequential_k": [3]},
            "version": EVALUATE_VERSION,
        },
        "export": {"export": EXPORT, "target": stories("path", "revision"), "out_dir": "build/export",
                   "version": EXPORT_VERSION},
        "extract": {"target": stories("path", "revision", "trust_remote_code", "dtype"), "backend": "hf",
                    "storage_dtype": "bf16", "aux_layer_ids": [2, 2, 2], "image": "", "version": 1,
                    "run_dir": "build/.run"},
        "regenerate": {
            "target": stories("path", "revision", "trust_remote_code", "chat_template", "dtype"),
            "sampling": {"backend": "hf", "model": None, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 64,
                         "seed": 0, "drop_truncated": False},
            "version": 1,
        },
        "split_0": {"dataset": {"name": "demo", "path": str(demo / "conversations.jsonl"), "format": "auto",
                                "split": None, "max_samples": 64},
                    "shards": 2, "shard_size": 32, "version": 1},
        "tokens_regenerated": {"tokenizer": stories("path", "revision", "trust_remote_code", "chat_template"),
                               "max_length": 256, "version": 1},
        "train": {"train": {"epochs": 12, "batch_tokens": 2048, "lr": 0.003, "ttt_steps": 3, "warmup_ratio": 0.05,
                            "val_fraction": 0.1, "checkpoint_every": 50, "gpus": 0},
                  "target": stories("path", "revision"), "state_dir": "build/train/state", "version": 1},
        "vocab": {"draft_vocab_size": 256, "vocab_size": 512, "version": 1},
        "vocab_count": {"vocab_size": 512, "version": 1},
    }  # fmt: skip


def assert_params(workdir: Path, config: str, expected: dict) -> None:
    """Same rules, and for each one the same values in the same order (Snakemake compares their repr)."""
    planned = planned_params(workdir, config)
    assert sorted(planned) == sorted(expected)
    for rule, values in expected.items():
        assert planned[rule] == [repr(values)], rule


def test_the_demo_config_keeps_every_rule_param(tmp_path):
    if not SMOLLM2.exists():
        pytest.skip("models/SmolLM2-135M-Instruct is absent (run `make setup`)")
    wd = copy_workflow(tmp_path)
    for part in ("models", "data", "config.yaml"):
        os.symlink(ROOT / part, wd / part)
    assert_params(wd, "config.yaml", expected_demo())


@pytest.mark.parametrize("config, expected", [(base_config, expected_workflow_test),
                                              (chain_config, expected_chain_test)])  # fmt: skip
def test_the_tests_configs_keep_every_rule_param(tmp_path, config, expected):
    if not STORIES.exists():
        pytest.skip("../shared/assets is absent")
    wd = copy_workflow(tmp_path)
    write_config(wd, config())
    assert_params(wd, "config.test.yaml", expected())
