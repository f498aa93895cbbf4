"""vLLM extraction against the HF backend, slot by slot, each also against an fp32 forward.

    # the DeepSeek-V3 stand-ins (MLA + MoE, random weights, the SmolLM2 tokenizer so its token shards serve):
    python3 bench/vllm_extract_compare.py make-dsv3 W/targets --tokenizer-from models/SmolLM2-135M-Instruct
    python3 bench/vllm_extract_compare.py long-shard W/long.safetensors --tokenizer models/SmolLM2-135M-Instruct
    python3 bench/vllm_extract_compare.py run --work W \
        --target smollm2=models/SmolLM2-135M-Instruct --target dsv3_top2=W/targets/dsv3_top2 \
        --target dsv3_all=W/targets/dsv3_all --target dsv3_top2_nosc=W/targets/dsv3_top2_nosc \
        --hf-from dsv3_top2_nosc=dsv3_top2 --shards build/tokens/demo/*.safetensors W/long.safetensors \
        --vllm-arg=--enforce-eager --out bench/results/vllm_extract_compare.json
    python3 bench/vllm_extract_compare.py smoke --work W --out W/vllm_extract_compare.json   # CPU, fake engine

Per target: the HF backend (`eagle3build.extraction.hf_server.Extractor`, what the extraction server runs) in
bf16 and fp32, and `extract.backend: vllm` (`eagle3build.extraction.vllm.extract_shard_vllm`: the project's
server manager, relay, client and shard writer; the engine started with the project's own `vllm serve` argv) on
the same token shards. Every hidden shard's input_ids / loss_mask / cu_seqlens must be equal; each stored row
(token, slot) gives a relative difference ||a - b|| / ||b||: vLLM vs HF-bf16, HF-bf16 vs HF-fp32, vLLM vs
HF-fp32. For a MoE target whose top-k can flip (k < experts) the HF-bf16 forward also records each token's
router margin (k-th minus (k+1)-th selection score) in every MoE layer, and each slot reports how many of its
rows beyond 2% had a margin below 1e-3 in an earlier MoE layer (router near-ties) against all rows.

make-dsv3 writes three targets with the same random weights (H 512, 8 layers, first dense, MLA q_lora 256 /
kv_lora 512 / rope 64 / nope 128 / v 128, 8 routed experts + 1 shared, n_group 1, vocab 49,152):
dsv3_top2 (top-2, `topk_method: noaux_tc`, `scoring_func: sigmoid` as real DeepSeek-V3 / Kimi configs say),
dsv3_all (top-8 of 8: no selection can flip) and dsv3_top2_nosc (dsv3_top2 without `scoring_func`, the config
as transformers writes it: vLLM then weights the experts with softmax while HF always uses sigmoid).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import vllm_common as vc

from eagle3build.config import default_aux_layer_ids
from eagle3build.extraction.hf_server import Extractor
from eagle3build.extraction.vllm import extract_shard_vllm, stop_servers
from eagle3build.shards import read_hidden, read_meta, read_tokens, write_tokens

BENCH = "vllm_extract_compare"
SLOTS = ("aux0", "aux1", "aux2", "final")
DSV3 = dict(vocab_size=49152, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
            num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
            n_routed_experts=8, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=256, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
DSV3_TINY = {**DSV3, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
             "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
             "max_position_embeddings": 4096}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


# ---------------------------------------------------------------- targets
def make_dsv3(out: Path, tokenizer_from: Path | None, tiny: bool = False) -> dict:
    """dsv3_top2, dsv3_all and dsv3_top2_nosc under `out` (same weights); returns their configs' routing keys."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    shape = DSV3_TINY if tiny else DSV3
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**shape, num_experts_per_tok=2)).to(torch.bfloat16)
    variants = {"dsv3_top2": {"num_experts_per_tok": 2, "scoring_func": "sigmoid"},
                "dsv3_all": {"num_experts_per_tok": shape["n_routed_experts"], "scoring_func": "sigmoid"},
                "dsv3_top2_nosc": {"num_experts_per_tok": 2}}
    routing = {}
    for name, keys in variants.items():
        folder = out / name
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(keys, topk_method="noaux_tc")  # vLLM creates e_score_correction_bias only with it
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        for f in TOKENIZER_FILES:
            if tokenizer_from and (tokenizer_from / f).exists():
                shutil.copy2(tokenizer_from / f, folder / f)
        routing[name] = {k: config.get(k) for k in ("num_experts_per_tok", "n_routed_experts", "topk_method",
                                                   "scoring_func")}
    return routing


LONG_LENGTHS = [300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500, 1600, 1700, 1800, 1900,
                2000, 350, 650, 950, 1250, 1550, 1850]


def long_shard(out: Path, tokenizer_dir: str, alpaca_dir: Path, lengths: list[int]) -> dict:
    """One token shard of long conversations: alpaca_eval instruction/answer pairs chained into multi-turn
    conversations (the target's chat template) until each reaches its length, then cut there."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [json.loads(f.read_text()) for f in sorted(alpaca_dir.glob("*.json"))]
    ids_list, j = [], 0
    for length in lengths:
        messages: list[dict] = []
        while True:
            row = rows[j % len(rows)][(j * 7) % len(rows[j % len(rows)])]
            j += 1
            messages += [{"role": "user", "content": row["instruction"]}, {"role": "assistant", "content": row["output"]}]
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            if len(ids) >= length:
                break
        ids_list.append(list(ids)[:length])
    write_tokens(out, ids_list, [[1] * len(x) for x in ids_list], {"tokenizer": Path(tokenizer_dir).name,
                                                                    "note": "alpaca_eval chained, cut"})
    return {"samples": len(ids_list), "tokens": sum(map(len, ids_list))}


def moe_gates(decoder) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, router) of every MoE layer whose top-k selection can flip."""
    gates = []
    for i, layer in enumerate(decoder.layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias") and gate.top_k < gate.num_experts:
            gates.append((i, gate))
    return gates


@torch.inference_mode()
def router_margins(model_dir: str, shards: list[Path], device: str) -> dict | None:
    """Per token and MoE layer: k-th minus (k+1)-th selection score (sigmoid + bias), HF bf16, batch 1."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    gates = moe_gates(lm.model)
    if not gates:
        return None
    captured = {}
    for i, gate in gates:
        gate.register_forward_hook(lambda mod, args, out, i=i: captured.__setitem__(i, out[0]))
    margins = {}
    for shard in shards:
        tokens, per_sample = read_tokens(shard), []
        cu = tokens.cu_seqlens.tolist()
        for s in range(tokens.num_samples):
            captured.clear()
            lm.model(input_ids=tokens.input_ids[cu[s]:cu[s + 1]].long()[None].to(device))
            cols = []
            for i, gate in gates:
                scores = (captured[i].float().sigmoid() + gate.e_score_correction_bias.float()).sort(-1, True).values
                cols.append((scores[:, gate.top_k - 1] - scores[:, gate.top_k]).cpu())
            per_sample.append(torch.stack(cols, 1))
        margins[shard.name] = torch.cat(per_sample)
    del lm
    return {"moe_layers": [i for i, _ in gates], "margins": margins}


# ---------------------------------------------------------------- extraction
def run_hf(model_dir: str, shards: list[Path], out: Path, dtype: str, device: str) -> list[dict]:
    n = vc.model_shape(model_dir)[0]
    ex = Extractor(model_dir, default_aux_layer_ids(n), device, dtype)
    out.mkdir(parents=True, exist_ok=True)
    runs = [{"shard": s.name, **ex.extract_shard(str(s), str(out / s.name), "bf16", 65536, 64, progress=False)}
            for s in shards]
    del ex
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return runs


def run_vllm(model_dir: str, shards: list[Path], out: Path, run_dir: Path, args) -> list[dict]:
    max_len = max(max(read_tokens(s).lengths) for s in shards)
    params = vc.extract_params(model_dir, "bf16", args.concurrency, fake=args.fake, max_length=max_len,
                               gpu_memory_utilization=args.gpu_memory_utilization, extra_args=args.vllm_arg)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for s in shards:
            start = time.perf_counter()
            extract_shard_vllm(str(s), str(out / s.name), params, str(run_dir))
            runs.append({"shard": s.name, "seconds": time.perf_counter() - start})
    finally:
        stop_servers(run_dir)
    return runs


# ---------------------------------------------------------------- comparison
def margin_report(d: torch.Tensor, margins: torch.Tensor, moe_layers: list[int], layer: int) -> dict | None:
    cols = [c for c, m in enumerate(moe_layers) if m < layer]
    if not cols:
        return None
    low = margins[:, cols].min(1).values < 1e-3
    bad = d > 0.02
    return {"rows_over_2pct": int(bad.sum()), "rows_over_2pct_with_margin_below_1e-3": int((bad & low).sum()),
            "rows_with_margin_below_1e-3": int(low.sum()), "rows": int(d.numel())}


def compare_target(vllm_dir: Path, bf16_dir: Path, fp32_dir: Path | None, margins: dict | None) -> dict:
    """Per slot over all shards (and per shard): vLLM vs HF-bf16, HF-bf16 vs fp32, vLLM vs fp32."""
    pairs = {"vllm_vs_hf_bf16": [], "hf_bf16_vs_fp32": [], "vllm_vs_fp32": []}
    per_slot = [{k: [] for k in pairs} for _ in SLOTS]
    near_ties = [[] for _ in SLOTS]
    report = {"shards": {}}
    for hf_path in sorted(bf16_dir.glob("*.safetensors")):
        h, v = read_hidden(hf_path), read_hidden(vllm_dir / hf_path.name)
        f = read_hidden(fp32_dir / hf_path.name) if fp32_dir and (fp32_dir / hf_path.name).exists() else None
        same = all(torch.equal(getattr(h, k), getattr(v, k)) for k in ("input_ids", "loss_mask", "cu_seqlens"))
        mh, mv = read_meta(hf_path), read_meta(vllm_dir / hf_path.name)
        report["shards"][hf_path.name] = {
            "same_tokens": same, "rows": int(h.hidden.shape[0]),
            "meta_differs": sorted(k for k in set(mh) | set(mv) if mh.get(k) != mv.get(k))}
        for s in range(len(SLOTS)):
            d = vc.rel_rows(v.hidden[:, s], h.hidden[:, s])
            per_slot[s]["vllm_vs_hf_bf16"].append(d)
            if f is not None:
                per_slot[s]["hf_bf16_vs_fp32"].append(vc.rel_rows(h.hidden[:, s], f.hidden[:, s]))
                per_slot[s]["vllm_vs_fp32"].append(vc.rel_rows(v.hidden[:, s], f.hidden[:, s]))
            if margins is not None:
                near_ties[s].append(margin_report(d, margins["margins"][hf_path.name], margins["moe_layers"],
                                                  mh["layer_ids"][s]))
    layer_ids = read_meta(next(iter(sorted(bf16_dir.glob("*.safetensors")))))["layer_ids"]
    report["slots"] = {}
    for s, name in enumerate(SLOTS):
        slot = {"layer": layer_ids[s]}
        slot.update({k: vc.row_stats(torch.cat(ds)) for k, ds in per_slot[s].items() if ds})
        parts = [p for p in near_ties[s] if p]
        if parts:
            slot["router_near_ties"] = {k: sum(p[k] for p in parts) for k in parts[0]}
        report["slots"][name] = slot
    return report


def print_table(results: dict) -> None:
    print("| target | slot | vLLM vs HF-bf16 max / mean | rows >1% / >2% / >5% | HF-bf16 vs fp32 max / mean "
          "| vLLM vs fp32 max / mean |")
    for target, rep in results.items():
        for slot, s in rep["slots"].items():
            v, h, f = s["vllm_vs_hf_bf16"], s.get("hf_bf16_vs_fp32"), s.get("vllm_vs_fp32")
            pct = lambda st: f"{st['max']:.2%} / {st['mean']:.2%}" if st else "-"  # noqa: E731
            print(f"| {target} | {slot} ({s['layer']}) | {pct(v)} | {v['rows_over_0.01']} / {v['rows_over_0.02']}"
                  f" / {v['rows_over_0.05']} | {pct(h)} | {pct(f)} |")


# ---------------------------------------------------------------- commands
def run(args) -> dict:
    work = Path(args.work)
    targets = dict(t.split("=", 1) for t in args.target)
    hf_from = dict(t.split("=", 1) for t in args.hf_from)
    shards = [Path(s) for s in args.shards]
    result = {"command": " ".join(sys.argv), "engine": "fake" if args.fake else "vllm", "shards":
              {s.name: {"samples": read_tokens(s).num_samples, "tokens": int(read_tokens(s).input_ids.numel())}
               for s in shards}, "timings": {}, "targets": {}}
    margins = {}
    for name, model in targets.items():
        timing = result["timings"][name] = {}
        source = hf_from.get(name)
        if source is None:
            for dtype in ["bfloat16"] + (["float32"] if args.fp32 else []):
                timing[f"hf_{dtype}"] = run_hf(model, shards, work / "hf" / f"{name}_{dtype}", dtype, args.device)
            margins[name] = router_margins(model, shards, args.device)
        timing["vllm"] = run_vllm(model, shards, work / "vllm" / name, work / "run" / name, args)
        hf = source or name
        result["targets"][name] = compare_target(
            work / "vllm" / name, work / "hf" / f"{hf}_bfloat16",
            work / "hf" / f"{hf}_float32" if args.fp32 else None, margins.get(hf))
        result["targets"][name]["hf_from"] = hf
        result["targets"][name]["config"] = {k: v for k, v in json.loads((Path(model) / "config.json").read_text())
                                             .items() if k in ("model_type", "num_hidden_layers", "hidden_size",
                                                               "num_experts_per_tok", "n_routed_experts",
                                                               "topk_method", "scoring_func", "kv_lora_rank")}
    print_table(result["targets"])
    return result


def smoke(args) -> dict:
    """Everything on CPU: a tiny Llama and tiny DeepSeek-V3 stand-ins, the fake engine."""
    work = Path(args.work)
    llama = vc.tiny_llama(work / "targets" / "llama")
    make_dsv3(work / "targets", None, tiny=True)
    shards = vc.random_shards(work / "tokens", 128, [[40, 17, 64], [90, 33]])
    args.target = [f"llama={llama}", *(f"{n}={work / 'targets' / n}" for n in
                                       ("dsv3_top2", "dsv3_all", "dsv3_top2_nosc"))]
    args.hf_from, args.shards, args.fake = ["dsv3_top2_nosc=dsv3_top2"], [str(s) for s in shards], True
    return run(args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-dsv3", help="write the three DeepSeek-V3 stand-ins")
    m.add_argument("out")
    m.add_argument("--tokenizer-from", help="a target dir whose tokenizer files the stand-ins get")
    m.add_argument("--tiny", action="store_true")
    ls = sub.add_parser("long-shard", help="a token shard of long chained alpaca_eval conversations")
    ls.add_argument("out")
    ls.add_argument("--tokenizer", required=True, help="the target dir whose tokenizer and chat template to use")
    ls.add_argument("--alpaca-eval", default=str(vc.ROOT.parent / "shared/assets/data/train/alpaca_eval"))
    ls.add_argument("--lengths", type=int, nargs="+", default=LONG_LENGTHS)
    for name in ("run", "smoke"):
        r = sub.add_parser(name)
        r.add_argument("--work", required=name == "smoke", help="scratch folder (hidden shards, run dirs)")
        r.add_argument("--out", help="results file (default bench/results/vllm_extract_compare.json)")
        r.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
        r.add_argument("--no-fp32", dest="fp32", action="store_false", help="skip the fp32 reference")
        r.add_argument("--concurrency", type=int, default=8)
        r.add_argument("--gpu-memory-utilization", type=float, default=0.3)
        r.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeat)")
        if name == "run":
            r.add_argument("--target", action="append", required=True, help="NAME=DIR (repeat)")
            r.add_argument("--hf-from", action="append", default=[],
                           help="NAME=OTHER: compare NAME's vLLM states with OTHER's HF states (same weights; OTHER listed first)")
            r.add_argument("--shards", nargs="+", required=True)
            r.add_argument("--fake", action="store_true", help="tests/fake_vllm_server.py instead of vLLM")
    args = p.parse_args()
    if args.cmd == "make-dsv3":
        print(json.dumps(make_dsv3(Path(args.out), Path(args.tokenizer_from) if args.tokenizer_from else None,
                                   args.tiny), indent=1))
        return 0
    if args.cmd == "long-shard":
        print(long_shard(Path(args.out), args.tokenizer, Path(args.alpaca_eval), args.lengths))
        return 0
    if args.work is None:
        args.work = tempfile.mkdtemp(prefix="vllm-compare-")
    result = smoke(args) if args.cmd == "smoke" else run(args)
    from results import record

    print("recorded in", record(BENCH, vc.device_name(), result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
