"""tokens rule: chat template + assistant-only loss mask for one shard."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def tokens(job):
    from eagle3build.data.prepare import tokenize_shard

    tokenizer = dict(job.params.tokenizer)
    thinking = tokenizer.pop("thinking", None)  # in the param only when not the default (staleness)
    tokenize_shard(job.input.conversations, job.output.tokens, job.output.report, tokenizer,
                   job.params.max_length, thinking)


run_job(tokens)  # the job a rule's run: block handed over (eagle3build/jobs.py)
