"""vocab_count rule: loss-masked token counts of one shard."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def count(job):
    from eagle3build.draft.vocab import count_shard

    count_shard(job.input.tokens, job.output.counts, job.params.vocab_size)


run_job(count)  # the job a rule's run: block handed over (eagle3build/jobs.py)
