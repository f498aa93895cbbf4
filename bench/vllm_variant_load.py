"""Every head variant's export served by vLLM, with its τ against the project's HF evaluator on the same export.

    python3 bench/vllm_variant_load.py --target models/SmolLM2-135M-Instruct \
        --draft build-quality/eagle3/export/eagle3 --set mt_bench=data/assets/eval/mt_bench_question.jsonl:128:first \
        --limit 24 --out $OUT/vllm_variant_load.json
    python3 bench/vllm_variant_load.py --smoke --work W --out W/vllm_variant_load.json   # CPU, fake engine

Each variant (`plain` and every DraftConfig.VARIANTS switch, one at a time) is the plain weights of the trained head
--draft (fc, the layer, norm, lm_head as trained; a variant head's own norms dropped) with that switch on: a new
norm (`input_norm`, `fc_norm.*`) at ones. That head is not trained for the switch, but both evaluators read the
same weights, so a config key that vLLM ignored or applied otherwise would show as a τ that differs from the
evaluator's, and a weight it could not load as a server that does not start. Each goes through `export` (the
stage's code) and `bench/vllm_eval_compare.py`'s comparison: the HF evaluator and `vllm serve
--speculative-config` on the first --limit questions of each --set, at temperature 0 (no server without the
draft: its answers and speed are not the point here). Reports per variant: whether the server loaded it, τ of
both, their relative difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import vllm_common as vc
import vllm_eval_compare as vec
from safetensors.torch import save_file

from eagle3build.draft.export import WEIGHT_NAMES, export, load_exported, weight_names
from eagle3build.draft.model import DraftConfig, Eagle3Draft
from eagle3build.train.checkpoint import save_best

BENCH = "vllm_variant_load"


def variant_export(trained_dir: str, target: str, flag: str | None, out: Path) -> str:
    """The plain weights of the head in `trained_dir` (its own variant norms, if any, dropped) with `flag` on
    (None: plain), exported to out/export/eagle3."""
    trained = load_exported(trained_dir, dtype=torch.float32, target_path=target)
    own_norms = set(weight_names(trained.config)) - set(WEIGHT_NAMES)  # the export's variant-only tensors
    weights = {n: t for n, t in trained.state_dict().items() if n not in own_norms}
    config = dataclasses.replace(trained.config, **{key: key == flag for key in DraftConfig.VARIANTS})
    model = Eagle3Draft(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    new = set(weight_names(config)) - set(WEIGHT_NAMES)
    if unexpected or set(missing) != new:
        raise RuntimeError(f"{flag}: unexpected {unexpected}, missing {missing} beyond the new norms {sorted(new)}")
    out.mkdir(parents=True, exist_ok=True)
    save_best(out, model, config, 1, None)
    save_file({"d2t": model.d2t.cpu(), "t2d": model.t2d.cpu()}, str(out / "mapping.safetensors"))
    export(str(out / "best.safetensors"), str(out / "mapping.safetensors"), target, str(out / "export"), {})
    return str(out / "export" / "eagle3")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vec.add_compare_args(p, BENCH, "a random plain head")
    p.set_defaults(limit=24)
    p.add_argument("--variants", nargs="*", default=["plain", *DraftConfig.VARIANTS])
    args = p.parse_args()
    unknown = set(args.variants) - {"plain", *DraftConfig.VARIANTS}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}: plain or one of {DraftConfig.VARIANTS}")
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-variants-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.chat_template, args.draft, questions = vec.smoke_inputs(work)
        args.target, args.fake, args.set = str(vec.STORIES), True, [f"stories={questions}:8"]
    if not (args.target and args.draft and args.set):
        p.error("--target, --draft and a --set are required (or --smoke)")
    args.temperature, args.baseline = None, False  # vec.compare_set's knobs: greedy, one server per variant
    target = {"path": str(Path(args.target).resolve()), "chat_template": args.chat_template}
    sets = dict(spec.split("=", 1) for spec in args.set)
    result = {"command": " ".join(sys.argv), "engine": "fake" if args.fake else "vllm", "k": args.k,
              "plain_from": args.draft, "variants": {}}
    for variant in args.variants:
        out = work / variant
        row: dict = {"loaded": False}
        try:
            draft = variant_export(args.draft, target["path"], None if variant == "plain" else variant, out)
            row["config_keys"] = {k: json.loads(Path(draft, "config.json").read_text())[k] for k in DraftConfig.VARIANTS}
            run = argparse.Namespace(**{**vars(args), "draft": draft, "work": str(out)})
            row["sets"] = {name: vec.compare_set(run, target, name, spec) for name, spec in sets.items()}
            row["loaded"] = True
        except Exception as e:  # noqa: BLE001 - a variant the engine refuses is a result, the next one runs
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
            print(f"{variant}: {row['error']}", flush=True)
        result["variants"][variant] = row
    from results import record

    print("recorded in", record(BENCH, vc.device_name(), result, args.out))
    return 0 if all(r["loaded"] for r in result["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
