"""extract rule: hidden states of one token shard (HF server or vLLM backend)."""
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, snakemake.scriptdir + "/..")  # noqa: F821
from eagle3build.cli import run_rule  # noqa: E402


def extract(sm):
    import os

    p = sm.params
    # Runtime knobs (batch size, devices, server and vLLM engine settings) come from the config, not
    # params: they do not change the stored bytes, so changing them must not re-extract.
    runtime = dict(sm.config["extract"])
    params = {**runtime, "backend": p.backend, "storage_dtype": p.storage_dtype,
              "aux_layer_ids": list(p.aux_layer_ids), "image": p.image}
    out_root = os.path.dirname(os.path.dirname(os.path.dirname(sm.output.hidden)))
    if p.backend == "vllm":
        from eagle3build.vllm_backend import extract_shard_vllm

        extract_shard_vllm(sm.input.tokens, sm.output.hidden, {**params, "target": dict(p.target)}, p.run_dir)
        return
    from eagle3build.extract import extract_shard, pending_token_shards

    stats = extract_shard(sm.input.tokens, sm.output.hidden, dict(p.target), params, p.run_dir,
                          pending_tokens=pending_token_shards(out_root, sm.input.tokens))
    print(stats)


run_rule(snakemake, extract)  # noqa: F821 (injected by Snakemake)
