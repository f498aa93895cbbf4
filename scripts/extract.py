"""extract rule: hidden states of one token shard (HF server or vLLM backend)."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def extract(job):
    p = job.params
    # Runtime knobs (batch size, devices, server and vLLM engine settings) come from the config, not
    # params: they do not change the stored bytes, so changing them must not re-extract.
    runtime = dict(job.config["extract"])
    params = {**runtime, "backend": p.backend, "storage_dtype": p.storage_dtype,
              "aux_layer_ids": list(p.aux_layer_ids), "image": p.image}
    if p.backend == "vllm":
        from eagle3build.extraction.vllm import extract_shard_vllm

        # The server's context is sized to the longest sample (prepare.max_length + 1), not the model's.
        params["max_length"] = job.config["prepare"]["max_length"]
        extract_shard_vllm(job.input.tokens, job.output.hidden, {**params, "target": dict(p.target)}, p.run_dir)
        return
    from eagle3build.extraction.job import extract_shard

    print(extract_shard(job.input.tokens, job.output.hidden, dict(p.target), params, p.run_dir))


run_job(extract)  # the job a rule's run: block handed over (eagle3build/jobs.py)
