"""vocab rule: merge counts, keep the top K ids, write d2t/t2d and the coverage report."""
import os
import sys

# Import the package that sits next to this workflow, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3build.jobs import run_job  # noqa: E402


def vocab(job):
    from eagle3build.draft.vocab import build_mapping

    report = build_mapping(list(job.input.counts), job.output.mapping, job.output.report, job.params.draft_vocab_size,
                           job.params.vocab_size)
    print(report)


run_job(vocab)  # the job a rule's run: block handed over (eagle3build/jobs.py)
