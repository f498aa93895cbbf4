"""τ of an exported EAGLE-3 head served by vLLM against the project's HF evaluator, and tokens/s with and
without speculation.

    python3 bench/vllm_eval_compare.py --target models/SmolLM2-135M-Instruct --draft build/export/eagle3 \
        --set demo_heldout=data/demo_eval_questions.jsonl:48 \
        --set mt_bench_turn1=../shared/assets/data/eval/mt_bench_question.jsonl:64:first \
        --speed-set ../shared/assets/data/eval/mt_bench_question.jsonl --speed 1:8 --speed 16:48 \
        --vllm-arg=--enforce-eager --out bench/results/vllm_eval_compare.json
    python3 bench/vllm_eval_compare.py --smoke --work W --out W/vllm_eval_compare.json   # CPU, fake engine

Each --set NAME=FILE:MAX_NEW_TOKENS[:first] (`first`: every question cut to its first turn) runs through
  hf    `eagle3build.evaluate.hf.evaluate` (the HF target in bf16 on the GPU, greedy chain decoding, k = 1..K,
        acceptance read off the target's greedy decodes, made in batches of --reference-batch-size; no
        sequential timing)
  vllm  `eagle3build.evaluate.vllm.evaluate` (`evaluate.backend: vllm`: `vllm serve --speculative-config
        {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}`, every turn a greedy
        /v1/chat/completions request at batch 1, τ from the engine's /metrics counters per category; then a
        server without the draft answers the same prompts: `mismatches` counts the turns whose answers differ)
and reports τ@K of both, their relative difference (the bar: within 5%), per category. --temperature T adds
τ at T over the same turns from both (`evaluate.temperatures: [0, T]`): vLLM's from its rejection sampler
(seeded per request), the HF evaluator's read off the target's own batched samples (docs/EVALUATION.md), under
`vllm.at_temperature` and `hf.at_temperature`, with their relative difference. The two sample different
answers, so they agree within sampling noise, not exactly.
Each --speed CONCURRENCY:QUESTIONS runs the vLLM backend on the first turns of the first QUESTIONS questions of
--speed-set with --speed-max-new-tokens, both servers, at that concurrency: tokens/s with and without the draft.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import vllm_common as vc
from safetensors.torch import save_file

from eagle3build.evaluate import hf, vllm

BENCH = "vllm_eval_compare"
STORIES = vc.ROOT.parent / "shared" / "assets" / "models" / "stories260K"
STORY_TEMPLATE = (  # stories260K has no chat template of its own
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n"
    "{% else %}Assistant: {{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def question_file(path: str, work: Path, name: str, first_turn: bool, limit: int | None = None) -> str:
    """`path` as is, or a copy of its first `limit` questions cut to their first turn."""
    if not first_turn and limit is None:
        return path
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()][:limit]
    out = work / f"{name}.jsonl"
    out.write_text("".join(json.dumps({**q, "turns": q["turns"][:1] if first_turn else q["turns"]}) + "\n"
                           for q in lines))
    return str(out)


def vllm_params(args, k: int, max_new: int, concurrency: int, temperature: float | None = None,
                baseline: bool = True) -> dict:
    env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    server = {"executable": vc.engine_executable(vc.FAKE_SPEC if args.fake else None), "env": env,
              "extra_args": list(args.vllm_arg), "gpu_memory_utilization": args.gpu_memory_utilization,
              "max_model_len": args.max_model_len, "concurrency": concurrency, "num_speculative_tokens": k,
              "baseline": baseline, "startup_timeout_s": 60 if args.fake else 900}
    sampling = {"temperatures": [0.0, temperature]} if temperature else {}
    return {"k": list(range(1, k + 1)), "max_new_tokens": max_new, "sequential_k": [], "vllm": server, **sampling}


def tau_row(report: dict, k: int) -> dict:
    row = report["k"][str(k)]
    return {"tau": row["mean_acceptance_length"], "drafts": row["drafts"], "accepted": row["accepted"],
            "rates": row["acceptance_rate_per_position"],
            "per_category": {c: v["mean_acceptance_length"] for c, v in row["per_category"].items()}}


def compare_set(args, target: dict, name: str, spec: str) -> dict:
    work, k = Path(args.work), args.k
    parts = spec.split(":")
    first = parts[-1] == "first"
    parts = parts[:-1] if first else parts
    path, max_new = ":".join(parts[:-1]), parts[-1]
    eval_set = [{"name": name, "path": question_file(path, work, name, first, args.limit)}]
    hf_report = hf.evaluate(args.draft, {**target, "dtype": args.hf_dtype}, eval_set, str(work / f"hf_{name}.json"),
                            str(work / f"hf_{name}.png"),
                            {"k": list(range(1, k + 1)), "max_new_tokens": int(max_new), "sequential_k": [],
                             "device": args.device, "sequential_samples": 0,
                             "reference_batch_size": args.reference_batch_size,
                             **({"temperatures": [0.0, args.temperature]} if args.temperature else {})})
    v_report = vllm.evaluate(args.draft, target, eval_set, str(work / f"vllm_{name}.json"),
                             str(work / f"vllm_{name}.png"), vllm_params(args, k, int(max_new), 1, args.temperature, args.baseline))
    h, v = hf_report["sets"][name], v_report["sets"][name]
    out = {"questions": v["questions"], "turns": {"hf": h["turns"], "vllm": v["turns"]}, "max_new_tokens": int(max_new),
           "hf": {**tau_row(h, k), "device": hf_report["device"], "dtype": hf_report["dtype"]},
           "vllm": {**tau_row(v, k), "mismatches_vs_target_alone": v["k"][str(k)]["mismatches"],
                    "tokens_per_s": v["k"][str(k)]["tokens_per_s"],
                    "baseline_tokens_per_s": None if v["baseline"].get("skipped") else v["baseline"]["tokens_per_s"]}}
    out["relative_difference"] = out["vllm"]["tau"] / out["hf"]["tau"] - 1
    print(f"{name}: tau@{k} vllm {out['vllm']['tau']:.4f} hf {out['hf']['tau']:.4f} "
          f"({out['relative_difference']:+.1%})", flush=True)
    for key, sampled in v.get("at_temperature", {}).items():
        hf_sampled = h["at_temperature"][key]
        for side, report in (("vllm", sampled), ("hf", hf_sampled)):
            out[side].setdefault("at_temperature", {})[key] = {
                **tau_row(report, k), "turns": report["turns"], "draft_sample_method": report["draft_sample_method"]}
        difference = sampled["k"][str(k)]["mean_acceptance_length"] / hf_sampled["k"][str(k)]["mean_acceptance_length"] - 1
        out.setdefault("at_temperature_relative_difference", {})[key] = difference
        print(f"{name}: tau@{k} at T={key} vllm {sampled['k'][str(k)]['mean_acceptance_length']:.4f} "
              f"hf {hf_sampled['k'][str(k)]['mean_acceptance_length']:.4f} ({difference:+.1%})", flush=True)
    return out


def speed(args, target: dict, concurrency: int, questions: int) -> dict:
    name = f"speed_c{concurrency}"
    eval_set = [{"name": name, "path": question_file(args.speed_set, Path(args.work), name, True, questions)}]
    report = vllm.evaluate(args.draft, target, eval_set, str(Path(args.work) / f"{name}.json"),
                           str(Path(args.work) / f"{name}.png"),
                           vllm_params(args, args.k, args.speed_max_new_tokens, concurrency))
    s = report["sets"][name]
    row = s["k"][str(args.k)]
    out = {"concurrency": concurrency, "questions": s["questions"], "max_new_tokens": args.speed_max_new_tokens,
           "spec_tokens": row["tokens"], "spec_tokens_per_s": row["tokens_per_s"],
           "base_tokens": s["baseline"]["tokens"], "base_tokens_per_s": s["baseline"]["tokens_per_s"],
           "ratio": row["speedup"], "tau": row["mean_acceptance_length"], "mismatches": row["mismatches"]}
    print(f"speed c{concurrency}: {out['spec_tokens_per_s']:.1f} vs {out['base_tokens_per_s']:.1f} tok/s "
          f"({out['ratio']:.2f}x), tau {out['tau']:.3f}", flush=True)
    return out


def smoke_inputs(work: Path) -> tuple[str, str, str]:
    """stories260K with a chat template, a random draft written by the project's export, two questions."""
    from eagle3build.draft.export import export
    from eagle3build.draft.model import DraftConfig, Eagle3Draft
    from eagle3build.draft.target import load_target_head

    if not STORIES.exists():
        sys.exit(f"--smoke needs {STORIES} (the shared assets)")
    template = work / "chat.jinja"
    template.write_text(STORY_TEMPLATE)
    head = load_target_head(STORIES)
    kept = torch.arange(0, head.vocab_size, 2)
    d2t, t2d = kept - torch.arange(len(kept)), torch.zeros(head.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    config = DraftConfig.from_target(head, draft_vocab_size=len(kept))
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(config, head, d2t, t2d)
    weights, mapping = work / "draft.safetensors", work / "mapping.safetensors"
    tensors = {n: p.contiguous() for n, p in draft.trainable_state_dict().items()}
    save_file({**tensors, "d2t": d2t, "t2d": t2d}, str(weights), {"draft_config": json.dumps(config.to_dict())})
    save_file({"d2t": d2t, "t2d": t2d}, str(mapping))
    export(str(weights), str(mapping), str(STORIES), str(work / "export"), {})
    questions = work / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in [
        {"question_id": 1, "category": "story", "turns": ["Once upon a time", "And then?"]},
        {"question_id": 2, "category": "animals", "turns": ["The cat sat"]}]))
    return str(template), str(work / "export" / "eagle3"), str(questions)


def add_compare_args(p: argparse.ArgumentParser, bench: str, smoke_draft: str) -> None:
    """The arguments of compare_set's runs, shared with bench/vllm_variant_load.py."""
    p.add_argument("--target", help="HF target dir")
    p.add_argument("--chat-template", help="a Jinja file overriding the target's template (both evaluators)")
    p.add_argument("--draft", help="the exported eagle3/ folder")
    p.add_argument("--set", action="append", default=[], help="NAME=FILE:MAX_NEW_TOKENS[:first] (repeat)")
    p.add_argument("--limit", type=int, default=None, help="the first LIMIT questions of each --set (default all)")
    p.add_argument("--k", type=int, default=3, help="draft tokens the server proposes (K)")
    p.add_argument("--reference-batch-size", type=int, default=128,
                   help="rows per batched greedy decode of the HF evaluator (its references; no timing here)")
    p.add_argument("--hf-dtype", default="auto", help="target dtype of the HF evaluator (auto: bf16 on GPU)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeat)")
    p.add_argument("--fake", action="store_true", help="tests/fake_vllm_spec_server.py instead of vLLM")
    p.add_argument("--smoke", action="store_true", help=f"CPU: stories260K, {smoke_draft}, the fake")
    p.add_argument("--work", help="scratch folder (reports, plots)")
    p.add_argument("--out", help=f"results file (default bench/results/{bench}.json)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_compare_args(p, BENCH, "a random exported draft")
    p.add_argument("--speed-set", help="question file for the tokens/s runs (first turns)")
    p.add_argument("--speed", action="append", default=[], help="CONCURRENCY:QUESTIONS (repeat)")
    p.add_argument("--speed-max-new-tokens", type=int, default=256)
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="--set runs without the server that has no draft (no mismatch count, no tokens/s ratio)")
    p.add_argument("--temperature", type=float, default=None,
                   help="also the vLLM side's tau at this temperature > 0 on every --set")
    args = p.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="vllm-eval-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.chat_template, args.draft, questions = smoke_inputs(Path(args.work))
        args.target, args.fake, args.speed_set = str(STORIES), True, questions
        args.set, args.speed, args.speed_max_new_tokens = [f"stories={questions}:8", f"first={questions}:8:first"], ["1:2", "2:2"], 8
    if not (args.target and args.draft and (args.set or args.speed)):
        p.error("--target, --draft and a --set or --speed are required (or --smoke)")
    if args.temperature is not None and args.temperature <= 0:
        p.error(f"--temperature {args.temperature}: give a temperature > 0 (T = 0 is always measured)")
    target = {"path": str(Path(args.target).resolve()), "chat_template": args.chat_template}
    result = {"command": " ".join(sys.argv), "engine": "fake" if args.fake else "vllm", "k": args.k,
              "sets": {}, "speed": []}
    for spec in args.set:
        name, rest = spec.split("=", 1)
        result["sets"][name] = compare_set(args, target, name, rest)
    for spec in args.speed:
        concurrency, questions = (int(x) for x in spec.split(":"))
        result["speed"].append(speed(args, target, concurrency, questions))
    from results import record

    print("recorded in", record(BENCH, vc.device_name(), result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
