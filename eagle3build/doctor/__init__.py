"""Preflight: fail in seconds, with the fix, before a run that would fail after hours.

`python -m eagle3build.doctor --config config.yaml [--stage extract]` prints every check and its
result; the workflow calls `preflight(config, "extract")` before its jobs run, which raises a UserError
listing every failure. Nothing here starts an engine or loads weights: vLLM is inspected through
importlib and its public module names, the target through its config.json and tokenizer.

One module per area, each check a function of the `Context` that returns a `Check`:
- target.py: trust policy (remote code needs a pinned revision), target config, tokenizer (under the
  configured trust policy), vocab sizes (tokenizer ids and the draft vocab must fit the target vocab),
  aux layer ids;
- mask.py: the assistant-only loss mask of a probe conversation (masked tokens decode to exactly the
  assistant parts), with the tokenizer the tokenizer check loaded;
- engine.py: vLLM (extract_hidden_states + ExampleHiddenStatesConnector), architecture (MLA targets are
  unsupported by the connector), sequence length (max_model_len);
- machine.py: GPUs and GPU memory, the training attention kernel (train.attention: flash), free disk;
- devices.py: each GPU's compute capability, memory and shared memory (the flex kernel tiles training
  uses there), and whether the extraction server's tensor-parallel plan fits (weights / TP + KV cache +
  hidden-state cache per GPU vs memory x gpu_memory_utilization);
- data.py: hf: datasets without a pinned revision (a change upstream would never rerun anything).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from eagle3build.doctor.context import Check, Context
from eagle3build.doctor.data import check_dataset_revisions
from eagle3build.doctor.devices import check_devices, check_train_memory
from eagle3build.doctor.engine import check_architecture, check_max_len, check_vllm
from eagle3build.doctor.machine import check_attention, check_disk, check_gpus
from eagle3build.doctor.mask import check_mask
from eagle3build.doctor.target import (
    check_layers,
    check_target_config,
    check_tokenizer,
    check_trust_policy,
    check_vocab,
)
from eagle3build.errors import UserError

STAGES = ("all", "tokens", "extract", "train")
CHECKS: list[tuple[str, Callable[[Context, str], Check], set[str]]] = [
    ("trust", lambda c, s: check_trust_policy(c), {"all", "tokens", "extract", "train"}),
    ("config", lambda c, s: check_target_config(c), {"all", "tokens", "extract", "train"}),
    ("tokenizer", lambda c, s: check_tokenizer(c), {"all", "tokens", "extract"}),
    ("mask", lambda c, s: check_mask(c), {"all", "tokens", "extract"}),
    ("vocab", lambda c, s: check_vocab(c), {"all", "tokens", "extract", "train"}),
    ("layers", lambda c, s: check_layers(c), {"all", "extract", "train"}),
    ("vllm", lambda c, s: check_vllm(c), {"all", "extract"}),
    ("architecture", lambda c, s: check_architecture(c), {"all", "extract"}),
    ("length", lambda c, s: check_max_len(c), {"all", "extract"}),
    ("gpus", check_gpus, {"all", "extract", "train"}),
    ("devices", check_devices, {"all", "extract", "train"}),
    ("attention", lambda c, s: check_attention(c), {"all", "train"}),
    ("train memory", check_train_memory, {"all", "train"}),
    ("disk", lambda c, s: check_disk(c), {"all", "extract"}),
    ("datasets", lambda c, s: check_dataset_revisions(c), {"all", "tokens", "extract"}),
]


def preflight(config: dict, stage: str = "all", echo: Callable[[Check], None] | None = None) -> list[Check]:
    """Run the checks a stage needs; raise UserError listing the failures. `echo` sees each result."""
    if stage not in STAGES:
        raise UserError(f"unknown preflight stage '{stage}'; one of {', '.join(STAGES)}")
    ctx = Context(config)
    checks = []
    for key, run, stages in CHECKS:
        if stage in stages:
            try:
                check = run(ctx, stage)
            except Exception as e:  # a check must never hide the others
                check = Check(key, "fail", f"{type(e).__name__}: {e}")
            checks.append(check)
            if echo:
                echo(check)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        lines = "\n".join(
            f"  - {c.name}: {c.detail}" + (f"\n    fix: {c.fix}" if c.fix else "") for c in failed
        )
        raise UserError(f"preflight found {len(failed)} problem(s) before the '{stage}' stage:\n{lines}")
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3build.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="config.yaml", help="the workflow config (default config.yaml)")
    parser.add_argument("--stage", default="all", choices=STAGES, help="check only what this stage needs")
    args = parser.parse_args(argv)
    try:
        from eagle3build.config import load_config

        config = load_config(args.config)
        print(f"eagle3build doctor: {args.config}, stage {args.stage}")
        preflight(config, args.stage, echo=print)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("all checks passed")
    return 0
